"""The documentation stays true: links resolve, every fault and every public name is documented."""

from __future__ import annotations

import re
from pathlib import Path

import rlx_nb
from rlx_nb.backends.faults import CATALOGUE

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_every_catalogue_fault_is_documented():
    text = (ROOT / "docs" / "hardening.md").read_text()
    assert [f for f in CATALOGUE if f"`{f}`" not in text] == []


def test_the_readme_shows_the_two_commands_and_an_install_line():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text and "pip install 'rlx_nb[" in text
    for name in ("backend_divergence", "localize", "explore", "merge_reports", "precision_sweep", "register_backend"):
        assert name in text and name in rlx_nb.__all__
