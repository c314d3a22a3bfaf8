"""Shared by the benchmarks that measure in fresh processes: run one child, write one result file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def run_child(script: str, *args: str) -> dict:
    """Run ``script --child ARGS`` in a fresh interpreter; its last stdout line is one JSON row."""
    out = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{Path(script).name} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_measured(script: str, *args: str) -> dict:
    """``run_child`` with the child's peak RSS from the kernel (``wait4``, not sampled) added as ``peak_rss``."""
    import os
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, script, "--child", *args], stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        out.seek(0)
        err.seek(0)
        text, errors = out.read(), err.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{Path(script).name} {' '.join(args)} failed:\n{errors[-3000:]}")
    return {"peak_rss": usage.ru_maxrss * 1024, **json.loads(text.strip().splitlines()[-1])}


def write_result(name: str, lines: list[str], rows: list[dict] | None = None) -> None:
    """Write ``bench/results/NAME`` and say where; with ``rows``, also ``NAME`` as ``.json`` (the figures
    ``bench/check.py`` compares a new run with)."""
    path = RESULTS / name
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    if rows is not None:
        figures = path.with_suffix(".json")
        figures.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {figures}")


def read_rows(name: str) -> list[dict]:
    """The committed figures of ``bench/results/NAME`` (its ``.json``), or [] where there are none."""
    figures = (RESULTS / name).with_suffix(".json")
    return json.loads(figures.read_text()) if figures.exists() else []
