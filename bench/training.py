"""Training divergence's cost (#64): time and peak memory against one plain training run, in fresh processes.

Anchors, measured in the same run: one plain training loop of the same model, batches, optimizer and steps
(``loss.backward(); optimizer.step()``, nothing else).  ``rlx_nb.training_divergence`` with one backend runs the
oracle, the backend and the envelope's K runs (two one-ulp starts and another thread count: K = 3) in lockstep, and
judges its local steps (the first, log-spaced ones, the last).  Targets: the trajectories (every run) <= (K + 2)x the
plain run, the local steps <= 20% on top of them (so the whole call <= 1.2 (K + 2)x); a 10M-parameter model for 100 steps completes with peak memory
<= 3x one plain run's (memory: peak RSS above what the process held once torch, rlx_nb and the model were loaded).

    python bench/training.py [--steps 100] [--params 10]

Writes ``bench/results/training.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from _child import run_measured, write_result

K = 3  # (the default envelope: two one-ulp runs and one on another thread count)


def _model(million: float):
    import torch

    torch.manual_seed(0)
    # An MLP of about ``million`` M parameters: 512 -> h -> h/2 -> 512 with h chosen for the count.
    h = 4096 if million >= 10 else max(256, int(4096 * (million / 10) ** 0.5))
    model = torch.nn.Sequential(torch.nn.Linear(512, h), torch.nn.GELU(), torch.nn.Linear(h, h // 2), torch.nn.GELU(),
                                torch.nn.Linear(h // 2, 512))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g)) for _ in range(4)]
    return model, data


def _child(workflow: str, steps: int, million: float, threads: int) -> None:
    import torch

    import rlx_nb

    if threads:
        torch.set_num_threads(threads)

    model, data = _model(million)

    def loss_fn(m, b):
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    def adamw(p):
        return torch.optim.AdamW(p, lr=1e-4)

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (after the imports and the model)
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    local = 0.0
    if workflow == "plain":
        opt = adamw(list(model.parameters()))
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            loss_fn(model, data[step % len(data)]).backward()
            opt.step()
        said = f"loss {float(loss_fn(model, data[0])):.4f}"
    else:
        report = rlx_nb.training_divergence(model, data, loss_fn, optimizer=adamw, steps=steps,
                                            backends=["optimizer:foreach"], progress=False)  # fmt: skip
        said = report.lines()[0]
        local = report.local_seconds
    seconds = time.perf_counter() - start
    print(json.dumps({"params": params, "seconds": seconds, "local_seconds": local, "base_rss": base, "said": said}))


def _run(workflow: str, steps: int, million: float, threads: int = 0) -> dict:
    return {"workflow": workflow, **run_measured(__file__, workflow, str(steps), str(million), str(threads))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--params", type=float, default=10.0, help="the model's size, in millions of parameters")
    args = parser.parse_args()
    import torch

    # Torch's own thread count, and one thread: the envelope's run on another thread count takes one fewer (n - 1),
    # or two where the process runs one; on a 2-core host that is one thread at torch's default, and a one-ulp run
    # steps beside it on the other core (rlx_nb.training.paired).
    counts = [0] + ([1] if torch.get_num_threads() > 1 else [])
    rows, lines = [], []
    for threads in counts:
        plain = _run("plain", args.steps, args.params, threads)
        divergence = _run("divergence", args.steps, args.params, threads)
        time_ratio = divergence["seconds"] / plain["seconds"]
        trajectories = divergence["seconds"] - divergence["local_seconds"]
        local_share = divergence["local_seconds"] / trajectories
        grown = {r["workflow"]: r["peak_rss"] - r["base_rss"] for r in (plain, divergence)}
        memory_ratio = grown["divergence"] / grown["plain"]
        where = f"torch's {torch.get_num_threads()} threads" if not threads else f"{threads} thread"
        these = [{"name": f"trajectories (every run, the envelope's too) vs one plain run ({where})",
                  "ratio": trajectories / plain["seconds"], "target": K + 2},
                 {"name": f"local steps on top of the trajectories ({where})", "ratio": local_share, "target": 0.2},
                 {"name": f"the whole call vs one plain run ({where})", "ratio": time_ratio, "target": (K + 2) * 1.2},
                 {"name": f"peak memory vs one plain run, above the loaded process ({where})", "ratio": memory_ratio,
                  "target": 3.0}]  # fmt: skip
        rows += these
        lines += [
            f"Plain run on {where}: {plain['seconds']:.1f} s, peak RSS {plain['peak_rss'] / 1e9:.2f} GB "
            f"({grown['plain'] / 1e6:.0f} MB above the loaded process); training_divergence {divergence['seconds']:.1f} s "
            f"(local steps {divergence['local_seconds']:.1f} s), peak RSS {divergence['peak_rss'] / 1e9:.2f} GB "
            f"({grown['divergence'] / 1e6:.0f} MB above). Its line: `{divergence['said']}`",
            "",
        ]
    lines = [
        "# Training divergence: cost against one plain training run",
        "",
        f"An MLP of {plain['params'] / 1e6:.1f}M parameters, AdamW, batches of 64, {args.steps} steps; "
        f"`training_divergence(..., backends=['optimizer:foreach'])` with the default envelope (K = {K} runs) and "
        "local steps, against the plain loop; each in a fresh process (`python bench/training.py`), at torch's "
        "thread count and on one thread (the envelope's run on another thread count takes one fewer, or two where "
        "the process runs one: on this 2-core host, one thread at torch's default, where a one-ulp run of the "
        "envelope steps beside it on the other core).",
        "",
        "| figure | measured | target | |",
        "|---|---|---|---|",
        *(
            f"| {r['name']} | {r['ratio']:.2f}x | <= {r['target']:g}x | {'ok' if r['ratio'] <= r['target'] else 'MISSED'} |"
            for r in rows
        ),
        "",
        *lines,
    ]
    write_result("training.md", lines, rows)
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
