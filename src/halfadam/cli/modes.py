"""The precision modes that ``halfadam train`` compares, and how each builds its optimizer and scaler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import halfadam

__all__ = ["MODES", "Mode", "parse_modes"]


@dataclass(frozen=True)
class Mode:
    """One way to train: the parameter dtype, which AdamW, and whether a loss scaler is used."""

    name: str
    param_dtype: torch.dtype
    optimizer: str  # "torch" (torch.optim.AdamW) or "halfadam" (halfadam.AdamW)
    loss_scaler: str | None  # None or "halfadam" (halfadam.GradScaler)
    description: str
    state_mode: str = "fp32"  # halfadam's state_mode (halfadam.encodings.PRESETS)

    def make_optimizer(self, param_groups, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """Build this mode's optimizer over ``param_groups`` (same hyperparameters for every mode)."""
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
        "8-bit block-wise moments, 4.07 bytes of state per parameter",
        state_mode="compact",
    ),
]

#: All modes by name, in their canonical order (the default for ``--modes``).
MODES: dict[str, Mode] = {m.name: m for m in _MODE_LIST}


def parse_modes(text: str) -> list[Mode]:
    """Parse a comma-separated list of mode names (``all`` for every mode); duplicates are dropped.

    Raises ``ValueError`` naming the unknown mode and the valid choices.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("no modes given")
    if names == ["all"]:
        return list(MODES.values())
    modes: list[Mode] = []
    for name in names:
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r} (choose from {', '.join(MODES)}, or all)")
        if MODES[name] not in modes:
            modes.append(MODES[name])
    return modes
