"""The precision modes that ``halfadam train`` compares, and how each builds its optimizer and scaler.

Besides :data:`MODES` (the default), ``--modes`` accepts the name of every peer of
:mod:`halfadam.cli.peers` whose package is installed (``--peers`` adds them all), and names that stand
for exactly one mode (:func:`resolve_mode_name`: ``tiny``, ``compact``, ``bfloat16-halfadam``).

Every mode of :data:`MODES` is written for AdamW; :meth:`Mode.with_algorithm` is the same mode for
``--optimizer sgd`` or ``lion`` (:mod:`halfadam.cli.optimizers`: which optimizer each mode then builds).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import halfadam

from .optimizers import ALGORITHMS, build
from .peers import PEERS, Peer, installed

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_ALIASES", "MODES", "Mode", "STATE_MODES", "get_mode", "parse_modes", "resolve_mode_name"]


@dataclass(frozen=True)
class Mode:
    """One way to train: the parameter dtype, which optimizer, and whether a loss scaler is used.

    ``optimizer`` is the kind: ``"torch"`` (the fp32 reference, or naive on half parameters: torch's optimizer
    of the rule, or for Lion, which torch lacks, the reference Lion of :mod:`halfadam.cli.optimizers`),
    ``"halfadam"`` (halfadam's optimizer of the rule) or ``"peer"``; ``algorithm`` the update rule.
    """

    name: str
    dtype: str  # the parameters' dtype as torch names it ("bfloat16"; torch is imported on use), or a torch.dtype
    optimizer: str  # "torch" (the reference or naive), "halfadam" (halfadam.AdamW/SGD/Lion) or "peer" (``peer``'s)
    loss_scaler: str | None  # None or "halfadam" (halfadam.GradScaler)
    description: str
    state_mode: str = "fp32"  # halfadam's state_mode (halfadam.encodings.PRESETS)
    peer: Peer | None = None
    algorithm: str = "adamw"  # the update rule: a key of halfadam.cli.optimizers.ALGORITHMS

    @property
    def _dtype_name(self) -> str:
        """``float32``, ``bfloat16``, ...: the parameters' dtype as torch names it (torch is not imported)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def param_dtype(self) -> torch.dtype:
        """The parameters' dtype (``torch.bfloat16``, ...)."""
        if not isinstance(self.dtype, str):  # a torch.dtype itself (docs/research's modes pass one)
            return self.dtype
        import torch

        return getattr(torch, self.dtype)

    @property
    def source(self) -> str:
        """The optimizer class, e.g. ``halfadam.AdamW``."""
        if self.peer is not None:
            return self.peer.source
        return getattr(ALGORITHMS[self.algorithm], self._kind)

    @property
    def _kind(self) -> str:
        """Which of its rule's optimizers this mode runs: ``"halfadam"``, ``"reference"`` (torch's, float32)
        or ``"naive"`` (torch's, half parameters)."""
        if self.optimizer == "halfadam":
            return "halfadam"
        return "reference" if self._dtype_name == "float32" else "naive"

    def with_algorithm(self, algorithm: str) -> Mode:
        """This mode for the update rule ``algorithm`` (``adamw``: itself): the same dtype, kind, loss scaler
        and state mode, with that rule's optimizer (:mod:`halfadam.cli.optimizers`) and a description naming it.
        ``ValueError`` for an unknown rule, or a peer mode given another rule than AdamW (the peers are AdamWs)."""
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
        if algorithm == self.algorithm:
            return self
        if self.peer is not None:
            raise ValueError(f"mode {self.name} is an AdamW ({self.peer.source}): it runs with --optimizer adamw only")
        return replace(self, algorithm=algorithm, description=_description(self, ALGORITHMS[algorithm]))

    def make_optimizer(self, param_groups, *, lr: float, weight_decay: float,
                       momentum: float | None = None) -> torch.optim.Optimizer:
        """Build this mode's optimizer over ``param_groups`` (same hyperparameters for every mode);
        ``momentum``: SGD's (``None`` for AdamW and Lion)."""
        if self.peer is not None:
            return self.peer.build(param_groups, lr=lr, weight_decay=weight_decay)
        return build(self.algorithm, self._kind, param_groups, lr=lr, weight_decay=weight_decay, momentum=momentum,
                     state_mode=self.state_mode)

    def make_scaler(self, device: torch.device):
        """This mode's loss scaler, or ``None``."""
        if self.loss_scaler == "halfadam":
            return halfadam.GradScaler(device=device.type)
        return None


_MODE_LIST = [
    Mode("fp32", "float32", "torch", None, "torch.optim.AdamW on float32 parameters (the reference)"),
    # torch.amp.GradScaler refuses float16 gradients ("Attempting to unscale FP16 gradients"), so the
    # naive float16 mode trains without loss scaling: small gradients flush to zero, as they would.
    Mode(
        "fp16-naive",
        "float16",
        "torch",
        None,
        "torch.optim.AdamW on float16 parameters, no loss scaling (torch.amp.GradScaler refuses float16 gradients)",
    ),
    Mode("bf16-naive", "bfloat16", "torch", None, "torch.optim.AdamW on bfloat16 parameters"),
    Mode(
        "fp16-halfadam",
        "float16",
        "halfadam",
        "halfadam",
        "halfadam.AdamW (fp32 master weights) + halfadam.GradScaler on float16 parameters",
    ),
    Mode(
        "bf16-halfadam",
        "bfloat16",
        "halfadam",
        None,
        "halfadam.AdamW (fp32 master weights) on bfloat16 parameters, no loss scaling needed",
    ),
    Mode(
        "bf16-halfadam-compact",
        "bfloat16",
        "halfadam",
        None,
        "halfadam.AdamW(state_mode='compact') on bfloat16 parameters: split master weights (bf16 + 16 bits) and "
        "8-bit block-wise moments, about 4.02 bytes of state per parameter of a weight matrix or conv kernel",
        state_mode="compact",
    ),
    Mode(
        "bf16-halfadam-tiny",
        "bfloat16",
        "halfadam",
        None,
        "halfadam.AdamW(state_mode='tiny') on bfloat16 parameters: split8 master weights (bf16 + 8 bits, "
        "stochastically rounded) and 8-bit block-wise moments, about 3.02 bytes of state per parameter of a "
        "weight matrix or conv kernel",
        state_mode="tiny",
    ),
]


def _description(mode: Mode, algorithm) -> str:
    """``mode``'s description for the rule ``algorithm`` (an :class:`~halfadam.cli.optimizers.Algorithm`)."""
    dtype = mode._dtype_name
    if mode.optimizer == "halfadam":
        state = "fp32 master weights and state" if mode.state_mode == "fp32" else f"state_mode={mode.state_mode!r}"
        scaler = " + halfadam.GradScaler" if mode.loss_scaler else ""
        return f"{algorithm.halfadam} ({state}){scaler} on {dtype} parameters"
    if dtype == "float32":
        note = f"; {algorithm.reference_note}" if algorithm.reference_note else ""
        return f"{algorithm.reference} on float32 parameters (the reference{note})"
    naive = ("the reference Lion's update in float32, rounded into the weight, no master"
             if algorithm.name == "lion" else "no master weights")
    scaler = ", no loss scaling" if dtype == "float16" else ""
    return f"{algorithm.naive} on {dtype} parameters ({naive}{scaler})"


#: All modes by name, in their canonical order (the default for ``--modes``).
MODES: dict[str, Mode] = {m.name: m for m in _MODE_LIST}

#: The peers as modes (never a default; see :mod:`halfadam.cli.peers`).
PEER_MODES: dict[str, Mode] = {
    p.name: Mode(p.name, p.dtype, "peer", None, p.description, peer=p)
    for p in PEERS.values() if not p.bench_only
}


def get_mode(name: str, algorithm: str = "adamw") -> Mode:
    """The mode or peer mode called ``name``, for the update rule ``algorithm`` (:meth:`Mode.with_algorithm`)."""
    return (MODES[name] if name in MODES else PEER_MODES[name]).with_algorithm(algorithm)


#: The state modes of ``halfadam.AdamW(state_mode=...)``: the names of :data:`halfadam.encodings.PRESETS`
#: (tests/test_bench.py checks), here without importing torch.
STATE_MODES = ("fp32", "split", "bf16", "compact", "tiny")

#: Dtype names as torch spells them -> as the mode names do (``bfloat16-halfadam-tiny`` is ``bf16-halfadam-tiny``).
DTYPE_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}


def _short_names() -> str:
    """``tiny = bf16-halfadam-tiny, ...``: the one-part names that stand for one mode of :data:`MODES`."""
    parts = {part for name in MODES for part in name.split("-")}
    short = {part: [n for n in MODES if part in n.split("-")] for part in sorted(parts)}
    return ", ".join(f"{part} = {names[0]}" for part, names in short.items() if len(names) == 1 and part != names[0])


def resolve_mode_name(name: str) -> str:
    """The mode (or peer mode) that ``name`` stands for: its own name; that name with the dtype spelled as
    torch does (``bfloat16-halfadam-tiny``); or parts of exactly one mode's name (``tiny``, ``compact``,
    ``halfadam-tiny``, ``optimi``), in any case.

    Raises ``ValueError`` for a name that stands for no mode, or for several (naming them).
    """
    known = [*MODES, *PEER_MODES]
    if name in known:
        return name
    parts = [DTYPE_ALIASES.get(part, part) for part in name.lower().split("-")]
    if "-".join(parts) in known:
        return "-".join(parts)
    matches = [k for k in known if set(parts) <= set(k.split("-"))]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"mode {name!r} is ambiguous: it stands for {', '.join(matches)} (give one of them)")
    also = ""
    if name.lower() in STATE_MODES:
        also = (f"; no halfadam train mode keeps state_mode={name.lower()!r} (halfadam bench --state-modes "
                f"{name.lower()} times it)")
    raise ValueError(f"unknown mode {name!r} (choose from {', '.join(known)}, or all; short names: "
                     f"{_short_names()}){also}")


def parse_modes(text: str) -> list[Mode]:
    """Parse a comma-separated list of mode names (``all`` for every mode of :data:`MODES`); duplicates
    are dropped. Each name is resolved by :func:`resolve_mode_name` (``tiny`` is ``bf16-halfadam-tiny``).
    A peer's name is accepted when its package is installed.

    Raises ``ValueError`` naming the unknown or ambiguous mode and the valid choices, or the missing package.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("no modes given")
    if names == ["all"]:
        return list(MODES.values())
    modes: list[Mode] = []
    for given in names:
        name = resolve_mode_name(given)
        if name in PEER_MODES and not installed(PEER_MODES[name].peer):
            package = PEER_MODES[name].peer.package
            raise ValueError(f"mode {name} needs the package {package}, which is not installed (pip install {package})")
        if get_mode(name) not in modes:
            modes.append(get_mode(name))
    return modes
