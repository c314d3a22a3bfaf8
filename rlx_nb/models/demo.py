"""Embedded default models: small, seeded, built in code (nothing downloads).

Each factory returns ``(model, inputs)``.  The families are those measured in
the design notes — an MLP, a transformer encoder block, a conv net — plus an
RMSNorm classifier whose output includes a cross-entropy loss, so the
backward faults of the catalogue (``fault:rmsnorm-backward``,
``fault:xent-backward``) have something to break.

Examples
--------
>>> from rlx_nb.models import demo
>>> model, inputs = demo.mlp()
>>> tuple(model(*inputs).shape)
(64, 512)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rlx_nb.backends.faults import CATALOGUE, FAULT_FREE
from rlx_nb.errors import InputError


def _seeded(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


class MLP(nn.Module):
    """Linear -> GELU -> Linear."""

    def __init__(self, d_in: int = 512, d_hidden: int = 2048, d_out: int = 512) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    """Multi-head self-attention written out, so ``F.softmax`` is a visible op."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        attn = F.softmax(scores, dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-norm encoder block: LayerNorm -> attention -> LayerNorm -> MLP, with residuals."""

    def __init__(self, d_model: int = 256, heads: int = 4, d_ff: int = 1024) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ConvNet(nn.Module):
    """Two Conv+BatchNorm+ReLU stages, global pooling and a linear head."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1, stride=2),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
        )
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class RMSNormClassifier(nn.Module):
    """RMSNorm -> Linear -> GELU -> RMSNorm -> Linear, returning logits and the cross-entropy loss."""

    def __init__(self, d_model: int = 128, classes: int = 32) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model, eps=1e-6)
        self.fc1 = nn.Linear(d_model, 2 * d_model)
        self.norm2 = nn.RMSNorm(2 * d_model, eps=1e-6)
        self.fc2 = nn.Linear(2 * d_model, classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc2(self.norm2(F.gelu(self.fc1(self.norm1(x)))))
        return {"logits": logits, "loss": F.cross_entropy(logits, target)}


class Block(TransformerBlock):
    """A pre-norm encoder block whose norms are LayerNorm or RMSNorm."""

    def __init__(self, d_model: int, heads: int, norm: str) -> None:
        super().__init__(d_model, heads, 2 * d_model)
        if norm == "rms":
            self.ln1, self.ln2 = nn.RMSNorm(d_model, eps=1e-6), nn.RMSNorm(d_model, eps=1e-6)


class Layered(nn.Module):
    """A stack of encoder blocks, mean pooling, a linear head and a cross-entropy loss."""

    def __init__(
        self, n_layers: int = 3, d_model: int = 64, heads: int = 4, classes: int = 16, norm: str = "layer"
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d_model, heads, norm) for _ in range(n_layers))
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            x = block(x)
        logits = self.head(x.mean(1))
        return {"logits": logits, "loss": F.cross_entropy(logits, target)}


class Recurrent(nn.Module):
    """A two-layer GRU over a sequence, LayerNorm, and a linear head on the last step."""

    def __init__(self, d_in: int = 32, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.gru = nn.GRU(d_in, hidden, num_layers=2, batch_first=True)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(self.norm(out).mean(1))


class NormHeavy(nn.Module):
    """Alternating Linear, LayerNorm, GroupNorm and RMSNorm layers with GELU."""

    def __init__(self, d: int = 128, depth: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(d, d))
            layers.append([nn.LayerNorm(d), nn.GroupNorm(8, d), nn.RMSNorm(d, eps=1e-6)][i % 3])
            layers.append(nn.GELU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _randomize_norms(model: nn.Module, gen: torch.Generator) -> None:
    # Trained-looking affine params and BatchNorm statistics instead of 1s and 0s.
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm, nn.RMSNorm)):
            with torch.no_grad():
                if m.weight is not None:
                    m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                    m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))


def mlp(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """MLP 512 -> 2048 -> 512 with GELU, batch 64."""
    gen = _seeded(seed)
    return MLP().eval(), (torch.randn(64, 512, generator=gen),)


def transformer(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """One pre-norm encoder block (d 256, 4 heads, seq 128, batch 4)."""
    gen = _seeded(seed)
    model = TransformerBlock().eval()
    _randomize_norms(model, gen)
    return model, (torch.randn(4, 128, 256, generator=gen),)


def conv(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Conv+BN(eval)+ReLU x2, 3x64x64 inputs, batch 8."""
    gen = _seeded(seed)
    model = ConvNet().eval()
    _randomize_norms(model, gen)
    return model, (torch.randn(8, 3, 64, 64, generator=gen),)


def rmsnorm_classifier(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm classifier over 64 samples of width 128, 32 classes; outputs logits and loss."""
    gen = _seeded(seed)
    model = RMSNormClassifier().eval()
    _randomize_norms(model, gen)
    x = torch.randn(64, 128, generator=gen)
    target = torch.randint(0, 32, (64,), generator=gen)
    return model, (x, target)


def recurrent(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """GRU(32 -> 64, 2 layers) over 24 steps, batch 16."""
    gen = _seeded(seed)
    model = Recurrent().eval()
    _randomize_norms(model, gen)
    return model, (torch.randn(16, 24, 32, generator=gen),)


def norm_heavy(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Linear + LayerNorm/GroupNorm/RMSNorm + GELU, 4 deep, width 128, batch 64."""
    gen = _seeded(seed)
    model = NormHeavy().eval()
    for m in model.modules():
        if isinstance(m, nn.GroupNorm):
            with torch.no_grad():
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
    _randomize_norms(model, gen)
    return model, (torch.randn(64, 128, generator=gen),)


def gpt2(seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Hugging Face GPT-2 (2 layers, width 64, 4 heads, vocab 128) with random weights, eager attention.

    Built from a config, nothing downloads.  Needs ``transformers``; outputs ``logits`` and ``loss``.
    """
    try:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ImportError("the gpt2 demo needs transformers: pip install 'rlx_nb[bench]'") from None
    transformers.logging.set_verbosity_error()
    gen = _seeded(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        use_cache=False,
        attn_implementation="eager",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (4, 32), generator=gen)
    return _HFLoss(model), {"input_ids": ids, "labels": ids.clone()}


class _HFLoss(nn.Module):
    # Keep only the tensors (logits, loss) of a Hugging Face output.
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model(input_ids=input_ids, labels=labels)
        return {"logits": out.logits, "loss": out.loss}


def layered(
    seed: int = 0, *, n_layers: int = 3, norm: str = "layer", fault_layer: int | str | None = None
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A stack of ``n_layers`` encoder blocks (d 64, 4 heads, seq 32, batch 8) returning logits and loss.

    ``norm`` is ``"layer"`` or ``"rms"``.  ``fault_layer`` confines the fault
    catalogue's backends to one place, so localization has a known answer:
    an int keeps faults in that block only; ``"head"`` keeps them out of
    every block (the loss in the top-level forward stays faulty).
    """
    if norm not in ("layer", "rms"):
        raise InputError(f"norm must be 'layer' or 'rms', got {norm!r}")
    gen = _seeded(seed)
    model = Layered(n_layers, norm=norm).eval()
    _randomize_norms(model, gen)
    if fault_layer is not None:
        if fault_layer != "head" and not (isinstance(fault_layer, int) and 0 <= fault_layer < n_layers):
            raise InputError(f"fault_layer must be 'head' or a block index below {n_layers}, got {fault_layer!r}")
        for i, block in enumerate(model.blocks):
            if i != fault_layer:
                setattr(block, FAULT_FREE, True)
    x = torch.randn(8, 32, 64, generator=gen)
    target = torch.randint(0, 16, (8,), generator=gen)
    return model, (x, target)


MODELS: dict[str, Callable[..., tuple[nn.Module, tuple]]] = {
    "mlp": mlp,
    "transformer": transformer,
    "conv": conv,
    "rmsnorm_classifier": rmsnorm_classifier,
}
FAULTS: list[str] = list(CATALOGUE)
"""Names of the fault-injection backends (each a registered, opt-in backend)."""


def long_context_fault(after: int = 24, severity: float = 2e-3, name: str = "long-context-attention"):
    """A backend with a subtle attention bug that only shows once the cache holds more than ``after`` keys.

    Like a tiled attention kernel that mis-scales every tile past the first: the scores of keys at positions
    ``after`` and beyond are multiplied by ``1 + severity``.  A forward pass over a short prompt never meets
    it; a decode meets it at the step whose cache passes ``after`` keys.  Returns a :class:`Backend` to pass
    in ``backends=[...]`` (or to :func:`rlx_nb.register_backend`'s arguments).

    Examples
    --------
    >>> long_context_fault(after=16).name
    'long-context-attention'
    """
    from rlx_nb.backends.base import Backend
    from rlx_nb.backends.faults import SubstituteFunctions, _softmax_targets

    if not isinstance(after, int) or after < 1:
        raise InputError(f"after must be a positive number of keys, got {after!r}")

    def softmax(x: torch.Tensor, dim: int | None = None, *args, **kwargs) -> torch.Tensor:
        if dim not in (-1, x.dim() - 1) or x.shape[-1] <= after:
            return F.softmax(x, dim=dim, dtype=kwargs.get("dtype"))
        late = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        late[after:] = 1.0 + severity
        return F.softmax(x * late, dim=dim, dtype=kwargs.get("dtype"))

    def fn(model, inputs):
        with SubstituteFunctions(_softmax_targets(softmax), name):
            return model(*inputs)

    return Backend(name, fn, default=False, hookable=True,
                   description=f"attention scores of keys past {after} scaled by 1+{severity:g} (a tiling bug)")  # fmt: skip
