"""Invariance's cost (#65): time against the plain runs of the configurations it compares, and GPT-2 124M's memory.

Anchors, measured in the same run: the model run by hand on exactly the inputs ``rlx_nb.invariance`` runs (the row
alone and each configuration), nothing else.  Targets: <= 3x those runs where nothing differs (a GPT-2 from a config,
batch and position configurations: bit for bit); <= 6x with op recording where one op differs (a model of linears:
``F.linear``'s small-batch path; and on ``cpu-inductor``, whose first parting module is searched by running each
leaf module alone through it, against the oracle's and the backend's runs of the same configurations); GPT-2 small (124M, from its config, random weights) with 128-token prompts completes
with peak memory <= 2x a plain run's of the same configurations (the whole process's peak RSS, the model loaded in
both; a fresh process each).

    python bench/invariance.py

Writes ``bench/results/invariance.md`` and ``.json``.
"""

from __future__ import annotations

import json
import resource
import sys
import time

from _child import run_measured, write_result


def _case(name: str):
    import torch

    torch.manual_seed(0)
    if name == "linears":
        model = torch.nn.Sequential(*[torch.nn.Linear(3072, 3072) for _ in range(6)])  # (rows of one token each)
        return model, torch.randn(4, 3072), {"batch_sizes": (2, 3, 4, 8, 16)}
    if name == "linears-inductor":  # (a backend's first parting module: each leaf run alone through it)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
        return model, torch.randn(4, 1024), {"batch_sizes": (2, 16), "rows": [0], "backends": ["cpu-inductor"]}
    import transformers

    if name == "gpt2-config":
        config = transformers.GPT2Config(vocab_size=1000, n_embd=256, n_layer=4, n_head=4, n_positions=128,
                                         bos_token_id=0, eos_token_id=0)  # fmt: skip
        length, kinds = 128, ["batch", "position"]
    else:  # gpt2-124m
        config, length, kinds = transformers.GPT2Config(bos_token_id=0, eos_token_id=0), 128, None
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    options = {"configs": kinds, "rows": [0]}
    if name == "gpt2-124m":
        options["batch_sizes"] = (2, 4)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, options


def _plain(model, inputs, options) -> None:
    # The same configurations' runs by hand: the row alone and each configuration, under no_grad.
    import torch

    from rlx_nb.configurations import configs as cf
    from rlx_nb.configurations.run import _kinds

    given = cf.Inputs.of(inputs)
    kinds = _kinds(model, given, options.get("configs"))
    sizes = tuple(options.get("batch_sizes", cf.BATCH_SIZES))
    from rlx_nb.backends.registry import get_backend
    from rlx_nb.configurations.run import _OnBackend

    runners = [model, *(_OnBackend(model, get_backend(b)) for b in options.get("backends", []))]
    with torch.no_grad():
        for runner in runners:  # (the oracle's runs, and each backend's of the same configurations)
            for i in options.get("rows", [0, 1]):
                given.call(runner, given.row(i))
                made = [c for c in cf.batch_configs(given, i, sizes) if c.kind in kinds]
                if "padding" in kinds:
                    made += cf.padding_configs(model, given, i, cf.PAD, 0)
                if "cache" in kinds and runner is model:
                    made += cf.cache_configs(model, given, i)
                for c in made:
                    c.run(runner)


def _child(name: str, workflow: str) -> None:
    import rlx_nb

    model, inputs, options = _case(name)
    model.eval()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    said = ""
    if workflow == "plain":
        _plain(model, inputs, options)
    else:
        report = rlx_nb.invariance(model, inputs, progress=False, **{k: v for k, v in options.items() if v is not None})
        said = report.lines()[0]
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"seconds": seconds, "base_rss": base, "params": params, "said": said}))


def _run(name: str, workflow: str) -> dict:
    return run_measured(__file__, name, workflow)


def main() -> None:
    rows, lines = [], []
    for name, target, what in (("gpt2-config", 3.0, "time, nothing differs"),
                               ("linears", 6.0, "time, one op differs (ops recorded)"),
                               ("linears-inductor", 6.0, "time, cpu-inductor's first parting module searched"),
                               ("gpt2-124m", 2.0, "peak memory")):  # fmt: skip
        plain, checked = _run(name, "plain"), _run(name, "invariance")
        if what == "peak memory":  # (the whole process's peak: the model loaded, its runs, what rlx_nb keeps)
            ratio = checked["peak_rss"] / plain["peak_rss"]
        else:
            ratio = checked["seconds"] / plain["seconds"]
        rows.append({"name": f"{name}: {what}", "ratio": ratio, "target": target})
        lines.append(f"- {name}: plain {plain['seconds']:.2f} s, peak RSS {plain['peak_rss'] / 1e9:.2f} GB; invariance "
                     f"{checked['seconds']:.2f} s, peak RSS {checked['peak_rss'] / 1e9:.2f} GB "
                     f"({checked['params'] / 1e6:.0f}M parameters). `{checked['said']}`")  # fmt: skip
    table = [
        "# Invariance: cost against the plain runs of the configurations compared",
        "",
        "Each in a fresh process (`python bench/invariance.py`): the model run by hand on the same configurations' "
        "inputs, against `rlx_nb.invariance` (bit for bit, the float64 row where something differs, the ops where "
        "something differs).",
        "",
        "| case | measured | target | |",
        "|---|---|---|---|",
        *(
            f"| {r['name']} | {r['ratio']:.2f}x | <= {r['target']:g}x | {'ok' if r['ratio'] <= r['target'] else 'MISSED'} |"
            for r in rows
        ),
        "",
        *lines,
    ]
    write_result("invariance.md", table, rows)
    print("\n".join(table))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
    else:
        main()
