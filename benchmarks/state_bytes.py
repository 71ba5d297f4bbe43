"""State bytes per parameter of every state mode over the parameter shapes of real architectures.

    python benchmarks/state_bytes.py

The shapes are written down from the models' public definitions (nothing is downloaded; each list's
total is checked against the published parameter count in ``tests/test_state_bytes.py``): GPT-2 small
and BERT-base (Hugging Face transformers), ViT-B/16, ResNet-50, ConvNeXt-T and EfficientNet-B0
(torchvision), T5-small and whisper-tiny (transformers), the Stable Diffusion 1.x U-Net (diffusers'
``UNet2DConditionModel`` with SD 1.5's configuration), and the MLP of ``halfadam train --task digits``
(built by the package).

Per architecture and bf16 parameters with master weights, each mode's bytes are counted from
:mod:`halfadam.encodings` as the optimizer lays them out (``state_nbytes``: per element, and per block
of 128 elements of a row, a row's short last block counted as one; ``for_param``: 1-D parameters keep
float32 fields), including each parameter's 4-byte step count. The "falls back" column is the share
of parameters whose format loses the mode's per-block encodings (the 1-D ones).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from halfadam import encodings  # noqa: E402

Shape = Tuple[int, ...]


def _linear(out: int, inp: int, bias: bool = True) -> List[Shape]:
    return [(out, inp)] + ([(out,)] if bias else [])


def _norm(n: int) -> List[Shape]:
    return [(n,), (n,)]


def gpt2_small() -> List[Shape]:
    """GPT-2 (124M): HF ``GPT2Model`` (Conv1D weights are (in, out)); the LM head is tied to wte."""
    d, shapes = 768, [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += _norm(d) + [(d, 3 * d), (3 * d,), (d, d), (d,)] + _norm(d) + [(d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + _norm(d)


def bert_base() -> List[Shape]:
    """BERT-base uncased: HF ``BertModel`` with its pooler."""
    d, shapes = 768, [(30522, 768), (512, 768), (2, 768)] + _norm(768)
    for _ in range(12):
        shapes += 4 * _linear(d, d) + _norm(d) + _linear(4 * d, d) + _linear(d, 4 * d) + _norm(d)
    return shapes + _linear(d, d)


def vit_b_16() -> List[Shape]:
    """torchvision ``vit_b_16``: patch conv, class token, positions, 12 encoder blocks, the head."""
    d, shapes = 768, [(768, 3, 16, 16), (768,), (1, 1, 768), (1, 197, 768)]
    for _ in range(12):
        shapes += _norm(d) + [(3 * d, d), (3 * d,)] + _linear(d, d) + _norm(d) + _linear(4 * d, d) + _linear(d, 4 * d)
    return shapes + _norm(d) + _linear(1000, d)


def t5_small() -> List[Shape]:
    """T5-small: HF ``T5ForConditionalGeneration`` (shared embedding tied to the LM head; relative
    attention biases in the first layer of each stack; no biases in linears)."""
    d, ff, shapes = 512, 2048, [(32128, 512)]
    for stack, attentions in (("encoder", 1), ("decoder", 2)):
        for layer in range(6):
            for _ in range(attentions):
                shapes += 4 * _linear(d, d, bias=False) + [(d,)]
            if layer == 0:
                shapes.append((32, 8))
            shapes += _linear(ff, d, bias=False) + _linear(d, ff, bias=False) + [(d,)]
        shapes.append((d,))
    return shapes


def whisper_tiny() -> List[Shape]:
    """whisper-tiny: HF ``WhisperModel`` (k_proj without bias; output projection tied)."""
    d, shapes = 384, [(384, 80, 3), (384,), (384, 384, 3), (384,), (1500, 384)]

    def attention() -> List[Shape]:
        return _linear(d, d, bias=False) + _linear(d, d) + _linear(d, d) + _linear(d, d) + _norm(d)

    for _ in range(4):
        shapes += attention() + _linear(4 * d, d) + _linear(d, 4 * d) + _norm(d)
    shapes += _norm(d) + [(51865, 384), (448, 384)]
    for _ in range(4):
        shapes += attention() + attention() + _linear(4 * d, d) + _linear(d, 4 * d) + _norm(d)
    return shapes + _norm(d)


def resnet50() -> List[Shape]:
    """torchvision ``resnet50``: bottlenecks [3, 4, 6, 3]; batch norms' weights and biases."""
    shapes, inp = [(64, 3, 7, 7)] + _norm(64), 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(width, inp, 1, 1)] + _norm(width) + [(width, width, 3, 3)] + _norm(width)
            shapes += [(4 * width, width, 1, 1)] + _norm(4 * width)
            if b == 0:
                shapes += [(4 * width, inp, 1, 1)] + _norm(4 * width)
            inp = 4 * width
    return shapes + _linear(1000, 2048)


def convnext_tiny() -> List[Shape]:
    """torchvision ``convnext_tiny``: depths [3, 3, 9, 3], dims [96, 192, 384, 768]."""
    shapes = [(96, 3, 4, 4), (96,)] + _norm(96)
    dims = (96, 192, 384, 768)
    for i, (dim, depth) in enumerate(zip(dims, (3, 3, 9, 3))):
        if i:
            shapes += _norm(dims[i - 1]) + [(dim, dims[i - 1], 2, 2), (dim,)]
        for _ in range(depth):
            shapes += [(dim, 1, 7, 7), (dim,)] + _norm(dim) + _linear(4 * dim, dim) + _linear(dim, 4 * dim) + [(dim, 1, 1)]
    return shapes + _norm(768) + _linear(1000, 768)


def efficientnet_b0() -> List[Shape]:
    """torchvision ``efficientnet_b0``: MBConv stages with squeeze-excitation (squeeze = in // 4)."""
    shapes = [(32, 3, 3, 3)] + _norm(32)
    for expand, k, inp, out, layers in ((1, 3, 32, 16, 1), (6, 3, 16, 24, 2), (6, 5, 24, 40, 2), (6, 3, 40, 80, 3),
                                        (6, 5, 80, 112, 3), (6, 5, 112, 192, 4), (6, 3, 192, 320, 1)):
        for layer in range(layers):
            c_in = inp if layer == 0 else out
            hidden, squeeze = c_in * expand, max(1, c_in // 4)
            if expand != 1:
                shapes += [(hidden, c_in, 1, 1)] + _norm(hidden)
            shapes += [(hidden, 1, k, k)] + _norm(hidden)
            shapes += [(squeeze, hidden, 1, 1), (squeeze,), (hidden, squeeze, 1, 1), (hidden,)]
            shapes += [(out, hidden, 1, 1)] + _norm(out)
    return shapes + [(1280, 320, 1, 1)] + _norm(1280) + _linear(1000, 1280)


def sd_unet() -> List[Shape]:
    """The Stable Diffusion 1.x U-Net: diffusers' ``UNet2DConditionModel`` with block channels
    (320, 640, 1280, 1280), 2 layers per block, cross-attention from 768, conv projections."""
    temb = 1280

    def resnet(cin: int, cout: int) -> List[Shape]:
        s = _norm(cin) + [(cout, cin, 3, 3), (cout,)] + _linear(cout, temb) + _norm(cout) + [(cout, cout, 3, 3), (cout,)]
        return s + ([(cout, cin, 1, 1), (cout,)] if cin != cout else [])

    def transformer(c: int) -> List[Shape]:
        s = _norm(c) + [(c, c, 1, 1), (c,)] + _norm(c)
        s += 3 * _linear(c, c, bias=False) + _linear(c, c) + _norm(c)
        s += _linear(c, c, bias=False) + 2 * _linear(c, 768, bias=False) + _linear(c, c) + _norm(c)
        return s + _linear(8 * c, c) + _linear(c, 4 * c) + [(c, c, 1, 1), (c,)]

    def conv(c: int) -> List[Shape]:
        return [(c, c, 3, 3), (c,)]

    shapes = [(320, 4, 3, 3), (320,)] + _linear(temb, 320) + _linear(temb, temb)
    channels, inp = (320, 640, 1280, 1280), 320
    for i, c in enumerate(channels):  # down: cross-attention in the first three
        for _ in range(2):
            shapes += resnet(inp, c) + (transformer(c) if i < 3 else [])
            inp = c
        shapes += conv(c) if i < 3 else []
    shapes += resnet(1280, 1280) + transformer(1280) + resnet(1280, 1280)  # mid
    rev, prev = channels[::-1], 1280
    for i, c in enumerate(rev):  # up: cross-attention in the last three; skips from the down path
        skip_in = rev[min(i + 1, len(rev) - 1)]
        for j in range(3):
            shapes += resnet((prev if j == 0 else c) + (skip_in if j == 2 else c), c) + (transformer(c) if i else [])
        shapes += conv(c) if i < 3 else []
        prev = c
    return shapes + _norm(320) + [(4, 320, 3, 3), (4,)]


def digits_mlp() -> List[Shape]:
    """``halfadam train --task digits``'s model (64 features, 10 classes), as the package builds it."""
    from halfadam.cli.models import DigitsMLP

    return [tuple(p.shape) for p in DigitsMLP(64, 10).parameters()]


ARCHITECTURES: Dict[str, Callable[[], List[Shape]]] = {
    "GPT-2 small": gpt2_small, "BERT-base": bert_base, "ViT-B/16": vit_b_16, "T5-small": t5_small,
    "whisper-tiny": whisper_tiny, "ResNet-50": resnet50, "ConvNeXt-T": convnext_tiny, "SD-1.x U-Net": sd_unet,
    "EfficientNet-B0": efficientnet_b0, "halfadam train --task digits": digits_mlp,
}


def state_bytes(shapes: List[Shape], mode: str, dtype: torch.dtype = torch.bfloat16) -> Tuple[float, float]:
    """``(state bytes per parameter, share of parameters that lose the mode's per-block encodings)``
    for parameters of ``shapes`` in ``dtype`` with master weights, in state mode ``mode``."""
    fmt = encodings.state_format(mode)
    total = numel = fallen = 0
    for shape in shapes:
        n = math.prod(shape)
        own = encodings.for_param(fmt, torch.empty(shape, dtype=dtype, device="meta"), True)
        total += encodings.state_nbytes(own, shape) + 4  # + the 0-d float32 step
        numel += n
        fallen += n if own != fmt else 0
    return total / numel, fallen / numel


def main() -> int:
    modes = list(encodings.PRESETS)
    head = ["architecture", "parameters"] + [f"{m} B/param" for m in modes] + ["falls back (compact)"]
    rows = [head]
    for name, build in ARCHITECTURES.items():
        shapes = build()
        figures = {m: state_bytes(shapes, m) for m in modes}
        rows.append([name, f"{sum(math.prod(s) for s in shapes):,}"] + [f"{figures[m][0]:.2f}" for m in modes]
                    + [f"{100 * figures['compact'][1]:.1f}%"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print("bf16 parameters with master weights; each parameter's 4-byte step included")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
