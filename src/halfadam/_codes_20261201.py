"""The uint8 moment codes of halfadam up to 2026-12-01, kept to read the checkpoints they wrote.

Each uint8 moment had one float32 ``*_absmax`` per 128-element block (the absmax of the block's
finite values, its sign bit set where the block held a nan or an inf). ``exp_avg`` stored
``(index - 127) mod 256`` into Dettmers' signed dynamic tree map (bitsandbytes
``create_dynamic_map``); ``exp_avg_sq`` stored code 0 for 0 and ``absmax * 2**(-24 * (255 - c) / 254)``
for codes 1..255. In a flagged block, map indices 126, 128, 129 meant -inf, +inf, nan (``exp_avg``)
and codes 1, 2 meant +inf, nan (``exp_avg_sq``). Only the decoder is kept: loading such a state
decodes it and encodes it in today's codes (:mod:`halfadam.encodings`).
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
from torch import Tensor

BLOCK = 128
_NONFINITE = {"exp_avg": ((128, math.inf), (126, -math.inf), (129, math.nan)),
              "exp_avg_sq": ((1, math.inf), (2, math.nan))}
_TABLES: Dict[str, Tensor] = {}


def dynamic_map() -> Tensor:
    """Dettmers' signed dynamic tree map: 256 sorted float32 values in [-1, 1]; decade ``i`` (values
    in [0.1, 1] * 10**(i - 6)) holds ``2**i`` linear levels on each side of 0."""
    data = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float64)
        means = ((bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        data += means + [-x for x in means]
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def _table(name: str) -> Tensor:
    if name not in _TABLES:
        if name == "exp_avg":
            _TABLES[name] = dynamic_map()
        else:
            codes = torch.arange(256, dtype=torch.float64)
            _TABLES[name] = torch.where(codes > 0, torch.exp2((codes - 255) * (24.0 / 254)), 0.0).float()
    return _TABLES[name]


def decode(name: str, codes: Tensor, absmax: Tensor) -> Tensor:
    """The float32 values (flat) of ``name``'s uint8 ``codes`` (flat, whole blocks) and ``absmax`` (one per block)."""
    table = _table(name).to(codes.device)
    index = codes.to(torch.int64)
    if name == "exp_avg":
        index = (index + 127) & 255
    absmax = absmax.reshape(-1, 1)
    flagged = absmax.view(torch.int32) < 0
    index = index.view(-1, BLOCK)
    values = table[index] * absmax.abs()
    for code, special in _NONFINITE[name]:
        values = torch.where(flagged & (index == code), special, values)
    return values.view(-1)
