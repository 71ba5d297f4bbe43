"""Option types and checks that more than one command shares (``halfadam train``, ``halfadam bench``).

The ``*_int`` and ``*_float`` functions are argparse ``type=`` callables: a bad value is an
``argparse.ArgumentTypeError``, which argparse prints as one line. :func:`resolve_device` checks a
``--device`` value against this machine and raises :class:`~halfadam.cli.errors.CLIError`.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from .errors import CLIError

if TYPE_CHECKING:
    import torch

__all__ = ["nonnegative_float", "nonnegative_int", "positive_float", "positive_int", "resolve_device"]


def positive_int(text: str) -> int:
    """An integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _float(text: str, *, positive: bool) -> float:
    """A finite number > 0 (``positive``) or >= 0."""
    kind = "a positive" if positive else "a non-negative"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind} number, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(f"expected {kind} number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _float(text, positive=True)


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    return _float(text, positive=False)


def resolve_device(name: str) -> torch.device:
    """The device ``--device name`` names: ``auto`` is CUDA where available, else the CPU; CLIError for
    an unknown device or one this machine does not have."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CLIError(f"unknown device {name!r} (use cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CLIError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CLIError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise CLIError(f"unsupported device {name!r} (use cpu, cuda, cuda:N or auto)")
    return device
