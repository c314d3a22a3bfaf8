"""The backends: what a backend is (``base``), the registry of names and liveness probes (``registry``), one module
per family, and the sequential-sums run (``sequential``).

A backend is a function ``fn(model, inputs) -> outputs``.  It receives a
private deep copy of the model (eval mode, float32, on the CPU) and the inputs
as a tuple of fresh copies, and returns outputs shaped like the model's.
Built-in backends are registered on first use and probed lazily: a backend
that is not live on this node (no CUDA, no ONNX Runtime, no C compiler) is a
value with a reason, never an import-time crash.
"""
