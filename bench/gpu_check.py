"""The GPU checks, as one short script for a session that is lent a CUDA machine.

    python bench/gpu_check.py [--elements 1e8]

1. ``tests/test_gpu.py`` (CUDA backends for real, including outputs compared on the GPU).
2. The device metrics on a float32 pair of ``--elements`` on the GPU against, in the same run,
   the host path on the same pair after copying it to the host, and ``torch.testing.assert_close``'s
   failure path on the GPU (ratios).
3. ``backend_divergence`` with the ``cuda`` backend on a GELU over 5e7 elements: the candidate's
   output must stay on the GPU (no host copy) and the host process's peak RSS is reported.

Writes ``bench/results/gpu_check.md`` (and copies it to ``$OUT`` when set).  Exits 0 with a
message where there is no CUDA device.  ``--device cpu`` is a dry run of the same steps on the CPU
(a CPU backend that compares on its device stands in for ``cuda``), printed and not written: it
checks the script itself before device time is spent on it.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _child import RESULTS, write_result


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", default="1e8")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    import torch

    dry = args.device == "cpu"
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check")
        return
    import rlx_nb
    from rlx_nb.backends.eager import run_eager
    from rlx_nb.numerics import device as device_metrics
    from rlx_nb.numerics import pairs as metrics

    device, backend = args.device, "cuda"
    if dry:
        backend = "dry:compare-on-device"
        rlx_nb.register_backend(backend, run_eager, default=False, replace=True, compare_on_device=True)

    def sync():
        if not dry:
            torch.cuda.synchronize()

    name = "CPU (dry run)" if dry else torch.cuda.get_device_name(0)
    lines = ["# GPU checks", "", f"Device: {name}; torch {torch.__version__}.", ""]
    root = Path(__file__).resolve().parent.parent
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests/test_gpu.py"], cwd=root, capture_output=True, text=True
    )
    lines += ["## tests/test_gpu.py", "", "```", tests.stdout.strip()[-1500:], "```", ""]

    n = int(float(args.elements))
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, device=device, generator=gen)
    b = a + torch.randn(n, device=device, generator=gen) * 1e-7
    b[torch.randint(0, n, (n // 1000,), device=device, generator=gen)] += 1e-3

    def on_gpu(a=a, b=b):
        device_metrics.pair_stats(a, b)
        sync()

    def via_host(a=a, b=b):
        metrics.pair_stats(a.cpu().numpy(), b.cpu().numpy())

    def close(a=a, b=b):
        try:
            torch.testing.assert_close(b, a)
        except AssertionError:
            pass
        sync()

    on_gpu()
    via_host()
    close()
    t_gpu, t_host, t_close = _best(on_gpu), _best(via_host), _best(close)
    want, got = metrics.pair_stats(a.cpu().numpy(), b.cpu().numpy()), device_metrics.pair_stats(a, b)
    same = (got.worst_index, got.max_ulp, got.mismatched) == (want.worst_index, want.max_ulp, want.mismatched)
    lines += [
        f"## Metrics on {n:.0e} float32 elements",
        "",
        "| on the GPU | copied to the host, then the host kernel | assert_close failure on the GPU | same statistics |",
        "|---|---|---|---|",
        f"| {t_gpu * 1e3:.0f} ms | {t_host * 1e3:.0f} ms ({t_host / t_gpu:.1f}x) | {t_close * 1e3:.0f} ms "
        f"({t_close / t_gpu:.1f}x) | {same} |",
        "",
    ]
    del a, b, on_gpu, via_host, close
    if not dry:
        torch.cuda.empty_cache()

    model = torch.nn.GELU()
    x = torch.randn(max(1, n // 2 // 1024), 1024)  # 5e7 elements at the default --elements
    rlx_nb.backend_divergence(model, torch.randn(2, 1024), backends=[backend], progress=False)
    t0 = time.perf_counter()
    report = rlx_nb.backend_divergence(model, x, backends=[backend], progress=False)
    t_e2e = time.perf_counter() - t0
    leaf = report.results.candidates[backend].outputs["out"]
    lines += [
        f"## backend_divergence on {x.numel():.0e} elements, {backend} candidate",
        "",
        f"{t_e2e:.2f} s; verdict {report.record(backend).verdict}; output kept on the device without a host copy: "
        f"{leaf.on_device}; host peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB.",
    ]
    if dry:
        print("\n".join(lines))
        return
    write_result("gpu_check.md", lines)
    if os.environ.get("OUT"):
        shutil.copy(RESULTS / "gpu_check.md", os.environ["OUT"])


if __name__ == "__main__":
    main()
