"""The precision modes that ``halfadam train`` compares, and how each builds its optimizer and scaler.

Besides :data:`MODES` (the default), ``--modes`` accepts the name of every peer of
:mod:`halfadam.cli.peers` whose package is installed (``--peers`` adds them all).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import halfadam

from .peers import PEERS, Peer, installed

__all__ = ["MODES", "Mode", "get_mode", "parse_modes"]


@dataclass(frozen=True)
class Mode:
    """One way to train: the parameter dtype, which AdamW, and whether a loss scaler is used."""

    name: str
    param_dtype: torch.dtype
    optimizer: str  # "torch" (torch.optim.AdamW), "halfadam" (halfadam.AdamW) or "peer" (``peer``'s)
    loss_scaler: str | None  # None or "halfadam" (halfadam.GradScaler)
    description: str
    state_mode: str = "fp32"  # halfadam's state_mode (halfadam.encodings.PRESETS)
    peer: Peer | None = None

    @property
    def source(self) -> str:
        """The optimizer class, e.g. ``halfadam.AdamW``."""
        if self.peer is not None:
            return self.peer.source
        return "halfadam.AdamW" if self.optimizer == "halfadam" else "torch.optim.AdamW"

    def make_optimizer(self, param_groups, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """Build this mode's optimizer over ``param_groups`` (same hyperparameters for every mode)."""
        if self.peer is not None:
            return self.peer.build(param_groups, lr=lr, weight_decay=weight_decay)
        if self.optimizer == "halfadam":
            return halfadam.AdamW(param_groups, lr=lr, weight_decay=weight_decay, state_mode=self.state_mode)
        return torch.optim.AdamW(param_groups, lr=lr, weight_decay=weight_decay)

    def make_scaler(self, device: torch.device):
        """This mode's loss scaler, or ``None``."""
        if self.loss_scaler == "halfadam":
            return halfadam.GradScaler(device=device.type)
        return None


_MODE_LIST = [
    Mode("fp32", torch.float32, "torch", None, "torch.optim.AdamW on float32 parameters (the reference)"),
    # torch.amp.GradScaler refuses float16 gradients ("Attempting to unscale FP16 gradients"), so the
    # naive float16 mode trains without loss scaling: small gradients flush to zero, as they would.
    Mode(
        "fp16-naive",
        torch.float16,
        "torch",
        None,
        "torch.optim.AdamW on float16 parameters, no loss scaling (torch.amp.GradScaler refuses float16 gradients)",
    ),
    Mode("bf16-naive", torch.bfloat16, "torch", None, "torch.optim.AdamW on bfloat16 parameters"),
    Mode(
        "fp16-halfadam",
        torch.float16,
        "halfadam",
        "halfadam",
        "halfadam.AdamW (fp32 master weights) + halfadam.GradScaler on float16 parameters",
    ),
    Mode(
        "bf16-halfadam",
        torch.bfloat16,
        "halfadam",
        None,
        "halfadam.AdamW (fp32 master weights) on bfloat16 parameters, no loss scaling needed",
    ),
    Mode(
        "bf16-halfadam-compact",
        torch.bfloat16,
        "halfadam",
        None,
        "halfadam.AdamW(state_mode='compact') on bfloat16 parameters: split master weights (bf16 + 16 bits) and "
        "8-bit block-wise moments, about 4.02 bytes of state per parameter of a weight matrix or conv kernel",
        state_mode="compact",
    ),
    Mode(
        "bf16-halfadam-tiny",
        torch.bfloat16,
        "halfadam",
        None,
        "halfadam.AdamW(state_mode='tiny') on bfloat16 parameters: split8 master weights (bf16 + 8 bits, "
        "stochastically rounded) and 8-bit block-wise moments, about 3.02 bytes of state per parameter of a "
        "weight matrix or conv kernel",
        state_mode="tiny",
    ),
]

#: All modes by name, in their canonical order (the default for ``--modes``).
MODES: dict[str, Mode] = {m.name: m for m in _MODE_LIST}

#: The peers as modes (never a default; see :mod:`halfadam.cli.peers`).
PEER_MODES: dict[str, Mode] = {
    p.name: Mode(p.name, p.param_dtype, "peer", None, p.description, peer=p)
    for p in PEERS.values() if not p.bench_only
}


def get_mode(name: str) -> Mode:
    """The mode or peer mode called ``name``."""
    return MODES[name] if name in MODES else PEER_MODES[name]


def parse_modes(text: str) -> list[Mode]:
    """Parse a comma-separated list of mode names (``all`` for every mode of :data:`MODES`); duplicates
    are dropped. A peer's name is accepted when its package is installed.

    Raises ``ValueError`` naming the unknown mode and the valid choices, or the missing package.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("no modes given")
    if names == ["all"]:
        return list(MODES.values())
    modes: list[Mode] = []
    for name in names:
        if name in PEER_MODES and not installed(PEER_MODES[name].peer):
            package = PEER_MODES[name].peer.package
            raise ValueError(f"mode {name} needs the package {package}, which is not installed (pip install {package})")
        if name not in MODES and name not in PEER_MODES:
            raise ValueError(f"unknown mode {name!r} (choose from {', '.join([*MODES, *PEER_MODES])}, or all)")
        if get_mode(name) not in modes:
            modes.append(get_mode(name))
    return modes
