"""DistributedDataParallel over 2 local ranks as a training backend (#64): the batch split between real gloo ranks,
the gradients averaged across them, judged against one process on the verdict's scale; what DDP cannot make the
one-process step (batch statistics, random numbers per rank, a batch that does not split) said, not judged."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

import rlx_nb

pytestmark = pytest.mark.xdist_group("ddp")


def _mse(m, b):
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


def _data(rows: int = 16) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(4)]


def _mlp(*middle: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), *middle, torch.nn.GELU(), torch.nn.Linear(32, 1))


def _adamw(p):
    return torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)


def test_ddp_over_two_ranks_reads_round_off_not_bit_for_bit_on_an_mlp_and_a_hugging_face_model():
    report = rlx_nb.training_divergence(_mlp(), _data(), _mse, optimizer=_adamw, steps=12, backends=["ddp"],
                                        progress=False)  # fmt: skip
    assert report.failed == {} and report.suspects == [], report.lines()
    local = report.local
    assert set(local.verdict) == {"round-off"} and len(local) >= 5
    # (the ranks' halves summed in another order than one process's whole batch: other bits, within round-off)
    assert not local.reason.str.contains("bit for bit").all(), local.reason.tolist()
    assert multiprocessing.active_children() == []  # (the ranks end with the call)

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 16))
    lm = rlx_nb.training_divergence(transformers.GPT2LMHeadModel(cfg), [{"input_ids": ids, "labels": ids}],
                                    optimizer=_adamw, steps=4, backends=["ddp"], progress=False)  # fmt: skip
    assert lm.failed == {} and lm.suspects == [] and set(lm.local.verdict) == {"round-off"}, lm.lines()


def test_a_loss_summed_over_the_batch_is_past_the_line_under_ddps_averaging():
    # DDP averages the ranks' gradients: right for a loss that is a mean over the batch, half the gradient of a sum.
    # The judgement sees it (the machinery compares what the ranks computed, it does not pass DDP by construction).
    def summed(m, b):
        return torch.nn.functional.mse_loss(m(b[0]), b[1], reduction="sum")

    report = rlx_nb.training_divergence(_mlp(), _data(), summed, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                                        steps=3, backends=["ddp"], progress=False)  # fmt: skip
    assert report.suspects == ["ddp"]
    first = report.local.iloc[0]
    assert first.verdict == "SUSPECT" and first.step == 0


@pytest.mark.parametrize(
    ("middle", "rows", "says"),
    [
        ((torch.nn.BatchNorm1d(32),), 16, r"module '1' is a BatchNorm1d: under DDP each rank computes its statistics"),
        ((torch.nn.Dropout(0.1),), 16, r"the forward draws random numbers \(dropout\)"),
        ((), 15, r"a tensor of shape \(15, 8\) has 15 rows: give batches whose first dimension is a multiple of 2"),
    ],
    ids=["batchnorm", "dropout", "odd-rows"],
)
def test_what_ddp_cannot_make_the_one_process_step_is_said_not_judged(middle, rows, says):
    report = rlx_nb.training_divergence(_mlp(*middle), _data(rows), _mse, optimizer=_adamw, steps=2,
                                        backends=["ddp", "optimizer:foreach"], progress=False)  # fmt: skip
    assert "ddp" in report.failed and "ddp" not in report.suspects
    assert __import__("re").search(says, report.failed["ddp"]), report.failed["ddp"]
    assert "optimizer:foreach" not in report.failed  # (the other backends go on)
    assert multiprocessing.active_children() == []


def test_ctrl_c_stops_the_ranks_and_keeps_the_steps_judged():
    parent = os.getpid()
    calls = []

    def interrupting(m, b):
        if os.getpid() == parent:  # (the interrupt is the caller's, as a Ctrl-C in a notebook is)
            calls.append(1)
            if len(calls) == 3 * 10 + 6:  # (inside the oracle's and ddp's steps, after the envelope's)
                raise KeyboardInterrupt
        return _mse(m, b)

    with pytest.raises(KeyboardInterrupt):
        rlx_nb.training_divergence(_mlp(), _data(), interrupting, optimizer=_adamw, steps=10, backends=["ddp"],
                                   progress=False)  # fmt: skip
    assert multiprocessing.active_children() == []
    kept = rlx_nb.interrupted_training()
    assert kept is not None and kept.incomplete.startswith("interrupted at step ") and len(kept.steps) > 0
