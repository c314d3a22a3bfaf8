"""int8 memory at real size: GPT-2 small (124M parameters, random weights, 64 tokens) quantized by PT2E, judged on
``executorch-xnnpack`` by :func:`rlx_nb.quantized_divergence`, against checking it by hand -- the converted graph run
once on the CPU (the Q/DQ simulation) and once through the runtime, and the two compared -- each in a fresh process
(peak resident memory).  Target: at most 1.5x.

    python bench/int8_memory.py

Writes ``bench/results/int8_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _child import run_child, write_result

TOKENS = 64


def _model():
    import torch
    import transformers

    transformers.logging.set_verbosity_error()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.GPT2Config(use_cache=False, attn_implementation="eager")  # (GPT-2 small's shape)
            self.model = transformers.GPT2LMHeadModel(config).eval()

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).logits

    torch.manual_seed(0)
    ids = torch.randint(0, 50257, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    return Logits().eval(), (ids,)


def child(how: str) -> dict:
    import torch

    from rlx_nb.int8.quantize import quantize_pt2e

    warnings.filterwarnings("ignore")
    model, inputs = _model()
    converted = quantize_pt2e(model, inputs)
    del model
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    start = time.perf_counter()
    if how == "hand":
        from rlx_nb.backends.registry import get_backend

        with torch.no_grad():
            sim = converted(*inputs)
        got = get_backend("executorch-xnnpack").fn(converted, inputs)
        got = got if isinstance(got, torch.Tensor) else next(iter(got.values()))
        verdict = float((got - sim).abs().max())
    else:
        import rlx_nb

        report = rlx_nb.quantized_divergence(converted, inputs, backends=["executorch-xnnpack"], progress=False)
        verdict = report.record("executorch-xnnpack").verdict
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # (GB: ru_maxrss is in KB on Linux)
    return {"how": how, "peak_gb": peak, "before_gb": before, "seconds": seconds, "result": verdict}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    hand = run_child(__file__, "hand")
    ours = run_child(__file__, "rlx_nb")
    ratio = ours["peak_gb"] / hand["peak_gb"]
    lines = [
        "# int8 memory at real size (GPT-2 small, 64 tokens, executorch-xnnpack)",
        "",
        f"- by hand (the Q/DQ simulation, the runtime, one comparison): peak {hand['peak_gb']:.2f} GB "
        f"({hand['before_gb']:.2f} GB once quantized), {hand['seconds']:.1f} s",
        f"- `quantized_divergence`: peak {ours['peak_gb']:.2f} GB ({ours['before_gb']:.2f} GB once quantized), "
        f"{ours['seconds']:.1f} s; verdict {ours['result']}",
        f"- **ratio {ratio:.2f}x** (target at most 1.5x: {'met' if ratio <= 1.5 else 'not met'}); "
        f"time {ours['seconds'] / hand['seconds']:.2f}x",
    ]
    write_result("int8_memory.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
