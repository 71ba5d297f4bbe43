"""benchmarks/state_bytes.py: the architectures' shape lists hold their published parameter counts, and
the bytes it counts are the optimizer's own layout."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

import halfadam

_spec = importlib.util.spec_from_file_location(
    "state_bytes", Path(__file__).resolve().parents[1] / "benchmarks" / "state_bytes.py")
state_bytes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(state_bytes)

#: published parameter counts (the models' papers, model cards and library summaries)
PUBLISHED = {"GPT-2 small": 124_439_808, "BERT-base": 109_482_240, "ViT-B/16": 86_567_656, "T5-small": 60_506_624,
             "whisper-tiny": 37_760_640, "ResNet-50": 25_557_032, "ConvNeXt-T": 28_589_128,
             "SD-1.x U-Net": 859_520_964, "EfficientNet-B0": 5_288_548}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shape_lists_hold_the_published_counts(name):
    assert sum(math.prod(s) for s in state_bytes.ARCHITECTURES[name]()) == PUBLISHED[name]


def test_bytes_are_the_optimizers_layout():
    """Counted from the shapes, as a real optimizer's state tensors take them (its step counts included)."""
    shapes = [(3, 256), (5,), (4, 9)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
    opt = halfadam.AdamW(params, state_mode="compact")
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    stored = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    assert state_bytes.state_bytes(shapes, "compact")[0] == pytest.approx(stored / sum(p.numel() for p in params))
    # rows of whole blocks: remainder 2 + codes 1 + 1, a tie byte and two uint8 scales per block
    assert state_bytes.state_bytes([(3, 256)], "compact") == (pytest.approx(4 + 3 / 128 + 4 / 768), 0.0)
    # rows of 9: one short block each, its 3 bytes over 9 elements
    assert state_bytes.state_bytes([(4, 9)], "compact") == (pytest.approx(4 + 3 / 9 + 4 / 36), 0.0)
    assert state_bytes.state_bytes(shapes, "compact")[1] == pytest.approx(5 / 809)  # (5,) falls back
