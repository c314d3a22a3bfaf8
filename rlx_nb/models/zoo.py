"""Real architectures nobody on this project wrote: Hugging Face ``transformers`` models, small configs.

Each builder returns ``(model, inputs)``: the Hugging Face model exactly as ``transformers`` builds
it (random weights from the config, eval mode, nothing downloaded) and a dict of its own keyword
inputs, so it is passed to :func:`rlx_nb.backend_divergence` as it is — no wrapper, its own
``ModelOutput`` (with caches for the decoders) as the outputs.  The real-architecture benchmark
(``bench/real_models.py``) and the test suite's subset run these.

Needs ``transformers`` (``pip install 'rlx_nb[bench]'``).

Examples
--------
>>> from rlx_nb.models import zoo
>>> model, inputs = zoo.build("resnet", batch=2)   # doctest: +SKIP
>>> sorted(inputs)                                  # doctest: +SKIP
['pixel_values']
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from rlx_nb._support.quiet import quiet
from rlx_nb.errors import InputError

VOCAB = 256
TEXT_LEN = 16
IMAGE = 32
CALIBRATION = 64  # images whose statistics the BatchNorm layers get (a batch of 2 at 1x1 pixels would not do)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("rlx_nb.models.zoo needs transformers: pip install 'rlx_nb[bench]'") from None
    transformers.logging.set_verbosity_error()
    # Building a model imports transformers.modeling_utils and with it every quantizer transformers knows: torchao
    # (installed with rlx_nb[executorch]) prints "Failed to load <its CUDA .so>" and torch's deprecation warnings
    # as it loads, which landed in the user's first cell (notebook 07, with the checkout's paths).  Imported here,
    # kept out as rlx_nb's int8 path keeps torchao's import out; an import that fails still raises.
    if "transformers.modeling_utils" not in sys.modules:  # (once a process: a capture is not free)
        with quiet():
            import transformers.modeling_utils
    return transformers


def _text(gen: torch.Generator, batch: int, *, padded: bool = True) -> dict[str, torch.Tensor]:
    # Token ids and an attention mask whose later rows end in padding, as a real batch does.
    ids = torch.randint(4, VOCAB, (batch, TEXT_LEN), generator=gen)
    mask = torch.ones(batch, TEXT_LEN, dtype=torch.long)
    if padded:
        for row in range(1, batch):
            mask[row, TEXT_LEN - 1 - (row % (TEXT_LEN // 2)) :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _pixels(gen: torch.Generator, batch: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen)}


_LM = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _bert(t: Any, gen: torch.Generator, batch: int):
    config = t.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    return t.BertModel(config), {**_text(gen, batch), "token_type_ids": torch.zeros(batch, TEXT_LEN, dtype=torch.long)}


def _distilbert(t: Any, gen: torch.Generator, batch: int):
    config = t.DistilBertConfig(
        vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64, num_labels=3
    )
    labels = torch.randint(0, 3, (batch,), generator=gen)
    return t.DistilBertForSequenceClassification(config), {**_text(gen, batch), "labels": labels}


def _gpt2(t: Any, gen: torch.Generator, batch: int):
    config = t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    inputs = _text(gen, batch, padded=False)
    return t.GPT2LMHeadModel(config), {**inputs, "labels": inputs["input_ids"].clone()}


def _llama(t: Any, gen: torch.Generator, batch: int):
    return t.LlamaForCausalLM(t.LlamaConfig(**_LM)), _text(gen, batch, padded=False)


def _qwen2(t: Any, gen: torch.Generator, batch: int):
    inputs = _text(gen, batch, padded=False)
    return t.Qwen2ForCausalLM(t.Qwen2Config(**_LM)), {**inputs, "labels": inputs["input_ids"].clone()}


def _mistral(t: Any, gen: torch.Generator, batch: int):
    # A sliding window shorter than the text: its cache layers keep their length as a number, which
    # export tracing turns into a tensor.
    return t.MistralModel(t.MistralConfig(**_LM, sliding_window=TEXT_LEN // 2)), _text(gen, batch)


def _mamba(t: Any, gen: torch.Generator, batch: int):
    # A state-space model: no attention; its cache's convolution and recurrent states are written in place.
    config = t.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, conv_kernel=4)
    return t.MambaModel(config), {"input_ids": _text(gen, batch)["input_ids"]}


def _t5(t: Any, gen: torch.Generator, batch: int):
    config = t.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    inputs = _text(gen, batch)
    inputs["decoder_input_ids"] = torch.randint(4, VOCAB, (batch, TEXT_LEN // 2), generator=gen)
    return t.T5ForConditionalGeneration(config), inputs


def _whisper(t: Any, gen: torch.Generator, batch: int):
    config = t.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=16,
        encoder_layers=2,
        decoder_layers=2,
        d_model=64,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=32,
        max_target_positions=32,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=3,
        decoder_start_token_id=2,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    inputs = {
        "input_features": torch.randn(batch, 16, 64, generator=gen),
        "decoder_input_ids": torch.randint(4, VOCAB, (batch, TEXT_LEN // 2), generator=gen),
    }
    return t.WhisperForConditionalGeneration(config), inputs


def _vit(t: Any, gen: torch.Generator, batch: int):
    config = t.ViTConfig(
        image_size=IMAGE,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
    )
    inputs = {**_pixels(gen, batch), "labels": torch.randint(0, 10, (batch,), generator=gen)}
    return t.ViTForImageClassification(config), inputs


def _vit_pooler(t: Any, gen: torch.Generator, batch: int):
    config = t.ViTConfig(
        image_size=IMAGE,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )
    return t.ViTModel(config, add_pooling_layer=True), _pixels(gen, batch)


def _convnext(t: Any, gen: torch.Generator, batch: int):
    config = t.ConvNextConfig(
        hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=IMAGE, num_labels=10, layer_scale_init_value=1.0
    )
    return t.ConvNextForImageClassification(config), _pixels(gen, batch)


def _resnet(t: Any, gen: torch.Generator, batch: int):
    config = t.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10)
    return t.ResNetForImageClassification(config), _pixels(gen, batch)


def _mobilenet(t: Any, gen: torch.Generator, batch: int):
    config = t.MobileNetV2Config(image_size=IMAGE, depth_multiplier=0.35, num_labels=10)
    return t.MobileNetV2ForImageClassification(config), _pixels(gen, batch)


def _efficientnet(t: Any, gen: torch.Generator, batch: int):
    config = t.EfficientNetConfig(
        image_size=IMAGE,
        width_coefficient=0.25,
        depth_coefficient=0.25,
        hidden_dim=320,  # the top BatchNorm's width: round_filters(1280) at this width coefficient
        num_labels=10,
        in_channels=[32, 16, 24, 40],
        out_channels=[16, 24, 40, 80],
        kernel_sizes=[3, 3, 5, 3],
        strides=[1, 2, 2, 2],
        num_block_repeats=[1, 1, 1, 1],
        expand_ratios=[1, 6, 6, 6],
    )
    return t.EfficientNetForImageClassification(config), _pixels(gen, batch)


def _swin(t: Any, gen: torch.Generator, batch: int):
    config = t.SwinConfig(
        image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10
    )
    return t.SwinForImageClassification(config), _pixels(gen, batch)


BUILDERS: dict[str, Callable[[Any, torch.Generator, int], tuple[torch.nn.Module, dict[str, torch.Tensor]]]] = {
    "bert": _bert,
    "distilbert": _distilbert,
    "gpt2": _gpt2,
    "llama": _llama,
    "qwen2": _qwen2,
    "mistral": _mistral,
    "mamba": _mamba,
    "t5": _t5,
    "whisper": _whisper,
    "vit": _vit,
    "vit-pooler": _vit_pooler,
    "convnext": _convnext,
    "resnet": _resnet,
    "mobilenet": _mobilenet,
    "efficientnet": _efficientnet,
    "swin": _swin,
}
MODELS = tuple(BUILDERS)


def build(name: str, *, batch: int = 2, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The Hugging Face model ``name`` (random weights, eval mode) and its keyword inputs for ``batch`` samples.

    ``seed`` fixes both the weights and the inputs.  Names: :data:`MODELS`.
    """
    t, gen = _start(name, MODELS, "the zoo has", batch, seed)
    model, inputs = BUILDERS[name](t, gen, batch)
    _trained_looking(model, gen, inputs)
    return model.eval(), inputs


def _start(name: str, names: tuple[str, ...], which: str, batch: Any, seed: int) -> tuple[Any, torch.Generator]:
    # (transformers, a generator): the name and batch checked, torch's and the generator's seeds set.
    if name not in names:
        raise InputError(f"unknown zoo model {name!r}; {which}: {', '.join(names)}")
    if not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch must be a positive integer, got {batch!r}")
    t = _transformers()
    torch.manual_seed(seed)
    return t, torch.Generator().manual_seed(seed)


DECODERS = ("gpt2", "llama", "qwen2", "mistral")
"""The causal language models :func:`decoder` builds (for :func:`rlx_nb.generation_divergence`)."""
PROMPT_LEN = 8


def decoder(
    name: str, *, batch: int = 1, seed: int = 0, prompt_len: int = PROMPT_LEN
) -> tuple[torch.nn.Module, torch.Tensor]:
    """A causal language model ``name`` with its LM head (random weights, eval mode) and a prompt's
    ``input_ids`` (``batch x prompt_len``), positions for 256 tokens.  Names: :data:`DECODERS`.

    Mistral's sliding window (16) is shorter than a long decode, so its cache rolls as it grows.
    """
    t, gen = _start(name, DECODERS, "the zoo's decoders", batch, seed)
    lm = {**_LM, "max_position_embeddings": 256}
    if name == "gpt2":
        model = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256))
    elif name == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(**lm))
    elif name == "qwen2":
        model = t.Qwen2ForCausalLM(t.Qwen2Config(**lm))
    else:
        model = t.MistralForCausalLM(t.MistralConfig(**lm, sliding_window=16))
    ids = torch.randint(4, VOCAB, (batch, prompt_len), generator=gen)
    _trained_looking(model, gen, {"input_ids": ids})
    return model.eval(), ids


@torch.no_grad()
def _trained_looking(model: torch.nn.Module, gen: torch.Generator, inputs: dict[str, torch.Tensor]) -> None:
    # Hugging Face's initialisation (weights of std 0.02 whatever the fan-in, unit norms, zero BatchNorm
    # statistics) makes deep convolutional nets vanish: a MobileNetV2's logits come out near 1e-26, where
    # a float16 run can only underflow.  Weights scaled to their fan-in, norms with affine parameters away
    # from 1 and 0, and BatchNorm statistics measured on a batch keep every activation at a trained
    # network's scale.
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
            fan_in = weight[0].numel()
            weight.copy_(torch.randn(weight.shape, generator=gen) * (2.0 / fan_in) ** 0.5)
            if module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))
        elif "norm" in type(module).__name__.lower() and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1:
            weight.copy_(1.0 + 0.1 * torch.randn(weight.shape, generator=gen))
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.nn.Parameter):
                bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if norms:  # (the convolutional models, whose only input is pixel_values)
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the calibration pass
        model.train()
        model(pixel_values=torch.randn(CALIBRATION, *inputs["pixel_values"].shape[1:], generator=gen))
        model.eval()
