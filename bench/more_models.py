"""Architectures beyond the zoo: the real-architecture benchmark on models the verdict was not tuned on.

The zoo's models (``rlx_nb.models.zoo``) are the ones the project measures itself on.  This benchmark adds 12
more Hugging Face architectures and 5 ``torch.nn`` ones, each chosen for something the zoo lacks, and
runs them through ``bench/real_models.py``'s grid and judgement (legitimate backends must be round-off;
faults more than 10x the oracle's error must be caught):

- BART (encoder-decoder), RoBERTa, ALBERT (shared layers), DeBERTa-v2 (disentangled relative
  attention), BLOOM (ALiBi), GPT-NeoX (partial rotary), OPT, Gemma 2 (soft-capping, sliding window),
  CLIP (two towers, nested outputs), Wav2Vec2 (convolutional front end, group norm), SegFormer,
  MobileViT;
- ``nn.LSTM``, a bidirectional ``nn.GRU``, ``nn.TransformerEncoder`` with a padding mask (PyTorch's
  fused fast path, which writes padded positions as 0), a small U-Net (BatchNorm, ConvTranspose2d,
  bilinear upsampling) and a spectral model (``torch.fft``).

    python bench/more_models.py [--models bart,lstm] [--batches 2] [--seeds 0] [--directions forward]

Writes ``bench/results/more_models.md`` and ``.csv``; runs are saved under ``bench/.cache/more_models/``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from rlx_nb.models import zoo
from rlx_nb.models.zoo import IMAGE, TEXT_LEN, VOCAB, _pixels, _text

SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)


def _bart(t: Any, gen: torch.Generator, b: int):
    c = t.BartConfig(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
    )
    inputs = _text(gen, b)
    inputs["decoder_input_ids"] = torch.randint(4, VOCAB, (b, TEXT_LEN // 2), generator=gen)
    return t.BartModel(c), inputs


def _roberta(t: Any, gen: torch.Generator, b: int):
    return t.RobertaModel(t.RobertaConfig(**{**SMALL, "max_position_embeddings": 80}, num_hidden_layers=2)), _text(
        gen, b
    )


def _albert(t: Any, gen: torch.Generator, b: int):
    return t.AlbertModel(t.AlbertConfig(**SMALL, embedding_size=32, num_hidden_layers=2)), _text(gen, b)


def _deberta(t: Any, gen: torch.Generator, b: int):
    c = t.DebertaV2Config(
        **SMALL,
        num_hidden_layers=2,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        max_relative_positions=32,
        position_buckets=8,
    )
    return t.DebertaV2Model(c), _text(gen, b)


def _bloom(t: Any, gen: torch.Generator, b: int):
    return t.BloomModel(t.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)), _text(gen, b)


def _neox(t: Any, gen: torch.Generator, b: int):
    return t.GPTNeoXModel(t.GPTNeoXConfig(**SMALL, num_hidden_layers=2, rotary_pct=0.25)), _text(gen, b)


def _opt(t: Any, gen: torch.Generator, b: int):
    c = t.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        ffn_dim=128,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
    )
    return t.OPTModel(c), _text(gen, b)


def _gemma2(t: Any, gen: torch.Generator, b: int):
    c = t.Gemma2Config(**SMALL, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, sliding_window=8)
    return t.Gemma2Model(c), _text(gen, b)


def _clip(t: Any, gen: torch.Generator, b: int):
    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE, patch_size=8
    )
    inputs = {**_text(gen, b, padded=False), **_pixels(gen, b)}
    return t.CLIPModel(t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)), inputs


def _wav2vec2(t: Any, gen: torch.Generator, b: int):
    c = t.Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16, 16),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )
    return t.Wav2Vec2Model(c), {"input_values": torch.randn(b, 800, generator=gen)}


def _segformer(t: Any, gen: torch.Generator, b: int):
    c = t.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        num_attention_heads=[1, 2],
        patch_sizes=[7, 3],
        strides=[4, 2],
        decoder_hidden_size=32,
        num_labels=5,
    )
    return t.SegformerForSemanticSegmentation(c), _pixels(gen, b)


def _mobilevit(t: Any, gen: torch.Generator, b: int):
    c = t.MobileViTConfig(
        image_size=IMAGE,
        hidden_sizes=[32, 48, 64],
        neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 160],
        num_attention_heads=2,
        num_labels=10,
    )
    return t.MobileViTForImageClassification(c), _pixels(gen, b)


class Recurrent(torch.nn.Module):
    def __init__(self, cell: torch.nn.RNNBase) -> None:
        super().__init__()
        self.rnn = cell
        self.head = torch.nn.Linear(cell.hidden_size * (2 if cell.bidirectional else 1), 10)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out)


def _lstm(t: Any, gen: torch.Generator, b: int):
    cell = torch.nn.LSTM(32, 64, num_layers=2, batch_first=True)
    return Recurrent(cell), {"x": torch.randn(b, TEXT_LEN, 32, generator=gen)}


def _gru(t: Any, gen: torch.Generator, b: int):
    cell = torch.nn.GRU(32, 64, batch_first=True, bidirectional=True)
    return Recurrent(cell), {"x": torch.randn(b, TEXT_LEN, 32, generator=gen)}


class PaddedEncoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)

    def forward(self, x, pad):
        return self.enc(x, src_key_padding_mask=pad)


def _torch_encoder(t: Any, gen: torch.Generator, b: int):
    pad = torch.zeros(b, TEXT_LEN, dtype=torch.bool)
    for row in range(1, b):
        pad[row, TEXT_LEN - 1 - (row % 8) :] = True
    return PaddedEncoder(), {"x": torch.randn(b, TEXT_LEN, 64, generator=gen), "pad": pad}


class UNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.SiLU())
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.out = nn.Conv2d(32, 4, 1)

    def forward(self, pixel_values):
        d = self.stem(pixel_values)
        h = self.down(d)
        y = self.out(torch.cat([self.up(h), d], 1))
        return y + torch.nn.functional.interpolate(h[:, :4], scale_factor=2, mode="bilinear", align_corners=False)


def _unet(t: Any, gen: torch.Generator, b: int):
    return UNet(), _pixels(gen, b)


class Spectral(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        s = torch.fft.rfft(self.proj(x), dim=-1)
        s = s * torch.exp(-torch.arange(s.shape[-1]) / 16.0)
        return torch.fft.irfft(s, n=64, dim=-1), s.abs()


def _spectral(t: Any, gen: torch.Generator, b: int):
    return Spectral(), {"x": torch.randn(b, TEXT_LEN, 64, generator=gen)}


BUILDERS = {
    "bart": _bart,
    "roberta": _roberta,
    "albert": _albert,
    "deberta": _deberta,
    "bloom": _bloom,
    "neox": _neox,
    "opt": _opt,
    "gemma2": _gemma2,
    "clip": _clip,
    "wav2vec2": _wav2vec2,
    "segformer": _segformer,
    "mobilevit": _mobilevit,
    "lstm": _lstm,
    "gru": _gru,
    "torch-encoder": _torch_encoder,
    "unet": _unet,
    "spectral": _spectral,
}


PADDING = (
    "the eager oracle (and fp64) run nn.TransformerEncoder's fused fast path, which writes the padded positions "
    "as 0; this backend computes them, so those elements differ for real and the rest is round-off (the reason "
    "says 'differs where the model writes zeros')"
)


def main() -> None:
    import real_models

    zoo.BUILDERS.update(BUILDERS)
    for backend in ("cpu-inductor", "onnxruntime", "openvino"):
        real_models.KNOWN_BUGS[("torch-encoder", backend, "forward")] = PADDING
    args = sys.argv[1:]
    defaults = {"--models": ",".join(BUILDERS), "--batches": "2", "--seeds": "0", "--name": "more_models"}
    for flag, value in defaults.items():
        if flag not in args:
            args += [flag, value]
    sys.argv = [sys.argv[0], *args]
    real_models.main()


if __name__ == "__main__":
    main()
