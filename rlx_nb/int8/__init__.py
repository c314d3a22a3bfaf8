"""int8: a PT2E-quantized model's runtimes judged against its Q/DQ simulation -- the run (:mod:`rlx_nb.int8.run`),
the call (:mod:`rlx_nb.int8.divergence`), its localization (:mod:`rlx_nb.int8.locate`), the quantization
(:mod:`rlx_nb.int8.quantize`), where a correct kernel may round the other way (:mod:`rlx_nb.int8.requantization`)
and planted kernel bugs (:mod:`rlx_nb.int8.faults`).  The comparison, verdict and report are a float model's."""
