"""halfadam: Adam/AdamW for float16/bfloat16 parameters with fp32 master weights.

Public API: :class:`AdamW`, :class:`Adam`, :class:`AdamFP16`, :class:`WeightDecay`, :class:`SGD`, :class:`Lion`,
:class:`GradScaler`, :class:`CheckpointError`; the learning-rate schedules in :mod:`halfadam.schedules`; checkpoint helpers in
:mod:`halfadam.checkpoint`; torch.distributed helpers in :mod:`halfadam.distributed`.

The names are imported on first use (``halfadam.AdamW``, ``from halfadam import AdamW``), so that
``import halfadam.cli`` and ``halfadam --help`` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names below are, for type checkers and the API docs
    from . import checkpoint, distributed, schedules
    from .lion import Lion
    from .optimizer import Adam, AdamFP16, AdamW, WeightDecay
    from .sgd import SGD
    from .scaler import GradScaler
    from .state_dict import CheckpointError

__all__ = ["AdamW", "Adam", "AdamFP16", "WeightDecay", "SGD", "Lion", "GradScaler", "CheckpointError", "schedules", "checkpoint",
           "distributed"]
__version__ = "0.1.0"

#: Each public name -> the module that defines it (a submodule's own name: the submodule).
_HOMES = {"AdamW": ".optimizer", "Adam": ".optimizer", "AdamFP16": ".optimizer", "WeightDecay": ".optimizer", "SGD": ".sgd", "Lion": ".lion",
          "GradScaler": ".scaler", "CheckpointError": ".state_dict", "schedules": ".schedules",
          "checkpoint": ".checkpoint", "distributed": ".distributed"}


def __getattr__(name: str):
    """Import a public name on first use (PEP 562), or a submodule (``halfadam.encodings``, as when this
    module imported them all); later uses find it in the module's globals."""
    home = _HOMES.get(name, "." + name)
    try:
        module = importlib.import_module(home, __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}{home}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = module if home == "." + name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
