"""halfadam: Adam/AdamW for float16/bfloat16 parameters with fp32 master weights.

Public API: :class:`AdamW`, :class:`Adam`, :class:`AdamFP16`, :class:`WeightDecay`,
:class:`GradScaler`, :class:`CheckpointError`; the learning-rate schedules in :mod:`halfadam.schedules`; checkpoint helpers in
:mod:`halfadam.checkpoint`; torch.distributed helpers in :mod:`halfadam.distributed`.
"""

from . import checkpoint, distributed, schedules
from .optimizer import Adam, AdamFP16, AdamW, WeightDecay
from .scaler import GradScaler
from .state_dict import CheckpointError

__all__ = ["AdamW", "Adam", "AdamFP16", "WeightDecay", "GradScaler", "CheckpointError", "schedules", "checkpoint",
           "distributed"]
__version__ = "0.1.0"
