"""The numbers: pair metrics (pure numpy, fused kernels), similarity conventions, device metrics, errors against the fp64 reference, per-element figures, the number formats."""
