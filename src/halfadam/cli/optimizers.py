"""``halfadam train --optimizer``: the update rules a run can compare (AdamW, SGD, Lion), their default
hyperparameters per task, and which optimizer each kind of mode builds for them.

Every mode of :data:`halfadam.cli.modes.MODES` exists for every rule. For a rule, the modes build:

=========  ==========================  ==========================  =======================================
rule       ``fp32`` (the reference)    ``*-naive`` (no master)     ``*-halfadam*`` (fp32-accurate master)
=========  ==========================  ==========================  =======================================
adamw      ``torch.optim.AdamW``       ``torch.optim.AdamW``       ``halfadam.AdamW(state_mode=...)``
sgd        ``torch.optim.SGD``         ``torch.optim.SGD``         ``halfadam.SGD(state_mode=...)``
lion       ``halfadam.Lion``           :class:`NaiveLion`          ``halfadam.Lion(state_mode=...)``
=========  ==========================  ==========================  =======================================

torch has no Lion: the reference is ``halfadam.Lion`` on float32 parameters, which keeps no master there and
steps the weight with the paper's update (Chen et al. 2023, Algorithm 2), each operation rounded once to
float32 (:func:`halfadam.lion.lion_elementwise_`). The naive Lion is the same update computed in float32
from the half-precision weight and rounded straight back into it, without a master
(:mod:`halfadam.cli.naive_lion`, written for this command), as ``torch.optim.AdamW`` on bf16 parameters is
for AdamW.

torch and halfadam's optimizers are imported by :func:`build` only (``halfadam train --help`` loads neither).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ALGORITHMS", "Algorithm", "build", "defaults"]


@dataclass(frozen=True)
class Algorithm:
    """One update rule of ``--optimizer``: its name, the optimizer each kind of mode builds for it (as text,
    for the table, ``metrics.json`` and ``--help``) and its default hyperparameters per task."""

    name: str  # the --optimizer value: "adamw"
    title: str  # as the header and the plot's title name it: "AdamW"
    reference: str  # the fp32 mode's optimizer
    naive: str  # the naive modes' optimizer (half-precision weights, no master)
    halfadam: str  # the halfadam modes' optimizer
    #: per task: lr, weight_decay and (SGD) momentum, where the command line leaves them unset
    task_defaults: dict
    #: a note on the fp32 mode's optimizer, where it is not torch's
    reference_note: str = ""


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("adamw", "AdamW", "torch.optim.AdamW", "torch.optim.AdamW", "halfadam.AdamW",
              {"char-lm": {"lr": 3e-4, "weight_decay": 0.0}, "digits": {"lr": 1e-3, "weight_decay": 0.0}}),
    # SGD's weight decay is torch.optim.SGD's L2 term (added to the gradient), so it is given small. Its lr (with
    # momentum 0.9) sits well inside the steady range (seed 0, 2026-12-08). char-lm: 0.3 and 1.0 diverge, 0.1 and
    # 0.15 end worse than 0.05 (which ends lowest: 2.058 in fp32, against 0.02's 2.096); from 0.03 up bf16-halfadam's
    # weights end 2-3e-2 from fp32's (3e-3 at 0.02), and at 0.05 the bf16 weights of the forward pass alone move the
    # validation loss by up to 0.5% along the run, as much as naive bf16 loses. digits: 0.03 and 0.1 end chaotically
    # (naive bf16 5% below fp32; bf16-halfadam 97% above).
    Algorithm("sgd", "SGD", "torch.optim.SGD", "torch.optim.SGD", "halfadam.SGD",
              {"char-lm": {"lr": 0.02, "weight_decay": 1e-4, "momentum": 0.9},
               "digits": {"lr": 0.01, "weight_decay": 1e-4, "momentum": 0.9}}),
    # Lion's steps are lr in every element: its lr is about 3x below AdamW's (the best in fp32 of 3e-5 and 1e-4 on
    # char-lm, of 3e-5, 1e-4 and 3e-4 on digits), its decoupled decay 3x a usual AdamW's 0.1 (AdamW's default here
    # is 0), as the paper advises.
    Algorithm("lion", "Lion", "halfadam.Lion", "halfadam.cli.naive_lion.NaiveLion", "halfadam.Lion",
              {"char-lm": {"lr": 1e-4, "weight_decay": 0.3}, "digits": {"lr": 3e-4, "weight_decay": 0.3}},
              reference_note="torch has no Lion: halfadam.Lion on float32 parameters, no master, the paper's "
                             "update to float32 rounding"),
)}


def defaults(algorithm: str, task: str) -> dict:
    """The default ``lr``, ``weight_decay`` and (SGD) ``momentum`` of ``algorithm`` on ``task``."""
    return ALGORITHMS[algorithm].task_defaults[task]


def build(algorithm: str, kind: str, param_groups, *, lr: float, weight_decay: float, momentum: float | None = None,
          state_mode: str = "fp32") -> torch.optim.Optimizer:
    """The optimizer of ``algorithm`` that a mode of ``kind`` trains with, over ``param_groups``.

    ``kind``: ``"reference"`` (the fp32 mode), ``"naive"`` (half-precision weights, no master) or
    ``"halfadam"`` (``state_mode``). ``momentum`` is SGD's (``None``: 0); the other rules take none.
    ``ValueError`` for an unknown ``algorithm`` or ``kind``, or a momentum given to AdamW or Lion.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if kind not in ("reference", "naive", "halfadam"):
        raise ValueError(f"kind must be 'reference', 'naive' or 'halfadam', got {kind!r}")
    if momentum is not None and algorithm != "sgd":
        raise ValueError(f"momentum is SGD's; {algorithm} takes none (got momentum={momentum})")
    import torch

    import halfadam

    hyper = dict(lr=lr, weight_decay=weight_decay)
    if algorithm == "sgd":
        hyper["momentum"] = momentum or 0.0
    if kind == "halfadam":
        cls = {"adamw": halfadam.AdamW, "sgd": halfadam.SGD, "lion": halfadam.Lion}[algorithm]
        return cls(param_groups, state_mode=state_mode, **hyper)
    if algorithm == "lion":
        if kind == "reference":
            return halfadam.Lion(param_groups, **hyper)  # float32 parameters: no master, the update in float32
        from .naive_lion import NaiveLion

        return NaiveLion(param_groups, **hyper)
    return (torch.optim.SGD if algorithm == "sgd" else torch.optim.AdamW)(param_groups, **hyper)
