"""Training divergence on five kinds of model over 200+ steps (#64): legitimate training backends give no finding.

Models: an MLP (AdamW), a CNN with BatchNorm (SGD with momentum), a small transformer LM (AdamW), a GPT-2 built from
a config and trained on kwargs batches with its own loss (AdamW), an MLP with dropout under a fixed seed (SGD with
momentum).  Backends: every default training backend (``cpu-nomkldnn``, ``cpu-inductor``, ``cpu-inductor-optimizer``,
``threads``, the optimizer's foreach, for-loop and fused implementations) and ``ddp`` (2 local gloo ranks) on the
models whose step DDP keeps (no BatchNorm, no dropout).  A finding is a backend with a local step past the line; a
trajectory outside its envelope is counted too (the CLI's ``--trajectory`` gate).

    python bench/training_models.py [--steps 200] [--models mlp,cnn,lm,gpt2,dropout]

Writes ``bench/results/training_models.md`` and ``.csv``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

import rlx_nb
from rlx_nb.training.backends import DEFAULT

RESULTS = Path(__file__).resolve().parent / "results"


def _adamw(p):
    return torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01)


def _sgd(p):
    return torch.optim.SGD(p, lr=0.02, momentum=0.9)


def _mse(m, b):
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


def _xent(m, b):
    return torch.nn.functional.cross_entropy(m(b[0]), b[1])


class _LM(torch.nn.Module):
    def __init__(self, vocab: int = 64, width: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.block = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        n = ids.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n)
        return self.head(self.block(self.embed(ids), src_mask=mask, is_causal=True))


def _lm_loss(m, b):
    logits = m(b[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))


def _cases():
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                              torch.nn.Linear(64, 4))  # fmt: skip
    mlp_data = [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)) for _ in range(8)]
    torch.manual_seed(0)
    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Flatten(), torch.nn.Linear(8 * 7 * 7, 10))  # fmt: skip
    cnn_data = [(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(8)]
    torch.manual_seed(0)
    lm = _LM()
    lm_data = [torch.randint(0, 64, (8, 33), generator=g) for _ in range(8)]
    torch.manual_seed(0)
    drop = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4))
    yield "mlp", mlp, mlp_data, _mse, _adamw, True
    yield "cnn", cnn, cnn_data, _xent, _sgd, False
    yield "lm", lm, lm_data, _lm_loss, _adamw, True
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(cfg)
    ids = [torch.randint(0, 64, (4, 16), generator=g) for _ in range(8)]
    yield "gpt2", gpt2, [{"input_ids": t, "labels": t} for t in ids], None, _adamw, True
    yield "dropout", drop, mlp_data, _mse, _sgd, False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--models", default="mlp,cnn,lm,gpt2,dropout")
    args = parser.parse_args()
    wanted = set(args.models.split(","))
    rows = []
    for name, model, data, loss, opt, ddp in _cases():
        if name not in wanted:
            continue
        backends = [*DEFAULT, "ddp"] if ddp else list(DEFAULT)
        start = time.perf_counter()
        report = rlx_nb.training_divergence(model, data, loss, optimizer=opt, steps=args.steps, backends=backends,
                                            label=name, progress=False)  # fmt: skip
        seconds = time.perf_counter() - start
        local = report.local
        for b in backends:
            mine = local[local.backend == b]
            rows.append({"model": name, "backend": b, "steps": args.steps, "local_steps": len(mine),
                         "past_line": int((mine.verdict == "SUSPECT").sum()),
                         "worst_local": round(float(mine.line.max()), 3) if len(mine) else float("nan"),
                         "leaves_envelope": report.leaving.get(b, ""), "failed": report.failed.get(b, ""),
                         "seconds": round(seconds, 1)})  # fmt: skip
        print(f"{name}: {seconds:.0f} s; " + "; ".join(report.lines()), file=sys.stderr)
    _write(rows, args.steps)


def _write(rows: list[dict], steps: int) -> None:
    with open(RESULTS / "training_models.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    findings = [r for r in rows if r["past_line"]]
    leaving = [r for r in rows if r["leaves_envelope"] != ""]
    failed = [r for r in rows if r["failed"]]
    lines = [
        f"# Training divergence on five kinds of model, {steps} steps (bench/training_models.py)",
        "",
        f"torch {torch.__version__}; {len(rows)} (model, backend) runs; local steps past the line: "
        f"**{len(findings)}**; trajectories leaving their envelope: **{len(leaving)}**; backends that could not run: "
        f"{len(failed)}.",
        "",
        "| model | backend | local steps | past the line | worst local (x line) | leaves envelope at | failed | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | `{r['backend']}` | {r['local_steps']} | {r['past_line']} | {r['worst_local']} | "
                     f"{r['leaves_envelope']} | {r['failed'][:90]} | {r['seconds']} |")  # fmt: skip
    (RESULTS / "training_models.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'training_models.md'}")


if __name__ == "__main__":
    main()
