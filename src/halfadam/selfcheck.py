"""The hand-written kernels, checked against the reference on first use.

The C++ kernel is compiled by each user's compiler for each user's CPU, and the Triton kernel by
Triton for each user's GPU: whoever first runs one on new hardware is its first tester, and a wrong
bit in an 8-bit code or a remainder does not show in a loss curve for thousands of steps. So the
first time a process steps a :class:`Config` (kernel, device, parameter and gradient dtypes, state
format, update rule and its flags (Adam's decay mode and ``optimized_update``), loss scale or none, layout (a bucket, FSDP2 shards or a
capturable launch) and variant (the C++ kernel's lane width, the Triton kernel compiled or interpreted)), :func:`kernel_agrees` runs that kernel for two steps over a small synthetic set of
parameters, and ``implementation="foreach"`` beside it on the same device (the same equations,
:func:`halfadam.encodings.encoded_update_`, in eager torch ops; for shards, the per-parameter
reference path), and compares every output bit: parameters, master weights, remainders, moments or
their codes, block scales and step counts (two nans count as equal whatever their payload).

The synthetic set (:func:`synthetic_set`; 5 tensors, 4,382 elements): a one-element tensor, tensors
whose sizes are no multiple of the vector width (so they start at unaligned offsets) and rows ending
in a short block; parameters of both signs spread over eight binades, with ±0, subnormals, the
smallest normal and huge values, and master weights at and next to the parameter dtype's rounding
midpoints (fp32 masters); gradients over nine binades, a row of zeros, subnormal and huge
gradients, nan, inf and -inf; weight decay on; a loss scale of 2**-10 where the configuration has
one; a user's write to the parameters between the two steps (the master-sync rule).

On any difference: one :class:`RuntimeWarning` naming the configuration, the field and the first
differing element with both values, and the configuration runs the reference execution
(``"foreach"``, or the per-parameter path for shards) for the rest of the process: the same results,
slower. A capturable step has no such path and raises :class:`RuntimeError` instead.

A model's 1-D parameters (biases, norms) keep fp32 fields in every mode, so they form a configuration of
their own beside the matrices'.

Threads: one check runs at a time in a process. A thread that meets a configuration not yet checked
while another thread checks (any configuration) waits for that check to end, then runs its own, so no
thread keeps a kernel's result before its configuration's verdict; a check's own kernel calls go
unchecked in the checking thread only.

Cost: one check per configuration and process: 10-130 ms each on the C++ kernel (a 2-core AMD EPYC,
loaded; the 8-bit modes cost most, nearly all of it the eager reference), so a model's first step takes
about 30-150 ms longer; ``halfadam doctor`` prints the figure here, and :func:`results` holds each
check's time. ``HALFADAM_SELFCHECK=0`` (or ``false``/``off``/``no``) turns it off.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch import Tensor

from . import encodings
from .buckets import Bucket
from .encodings import StateFormat

__all__ = ["Config", "Verdict", "kernel_agrees", "enabled", "recheck", "results", "synthetic_set", "compare"]

ENV = "HALFADAM_SELFCHECK"
LAYOUTS = ("bucket", "shard", "capturable")
#: the synthetic tensors' shapes: one element; 7- and 130-element rows (no multiple of 8 or 16: unaligned
#: offsets, rows ending in a short block of a blocked format); whole blocks.
SHAPES = ((1, 1), (5, 7), (3, 200), (17, 130), (6, 256))
LOSS_SCALE = 2.0 ** -10  # the grad_scale (1 / loss scale) a scaled configuration is checked with


@dataclass(frozen=True)
class Config:
    """One kernel configuration, checked once per process."""

    kernel: str  # "cpp" or "triton"
    device: str  # str(torch.device)
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    fmt: StateFormat  # the format of the parameters stepped (encodings.for_param's)
    has_master: bool
    rule: str  # the update rule and its kernel flags (halfadam.functional.Rule.describe)
    scaled: bool  # a grad_scale (loss scale) is applied
    layout: str = "bucket"  # one of LAYOUTS
    variant: str = ""  # the C++ kernel's lane width; the Triton kernel compiled or interpreted

    def describe(self) -> str:
        name = {"cpp": "the C++ kernel ('cpp')", "triton": "the Triton kernel ('triton')"}[self.kernel]
        dt = lambda d: str(d).replace("torch.", "")  # noqa: E731
        return (f"{name} on {self.device}: {dt(self.param_dtype)} parameters, {dt(self.grad_dtype)} gradients, "
                f"state {self.fmt.describe()}{'' if self.has_master else ' (no master)'}, rule {self.rule}, "
                f"{'a loss scale' if self.scaled else 'no loss scale'}, "
                f"{self.layout} layout, {self.variant}")


@dataclass(frozen=True)
class Verdict:
    """A check's result: ``difference`` is ``None`` where every bit agreed, else what differed first."""

    config: Config
    difference: Optional[str]
    seconds: float

    @property
    def agrees(self) -> bool:
        return self.difference is None


class _Thread(threading.local):
    checking = False  # this thread runs a check: its own kernel calls are not checked
    rechecked: Optional[Dict[Config, Verdict]] = None  # inside recheck() in this thread: its verdicts so far


_verdicts: Dict[Config, Verdict] = {}
_thread = _Thread()
_lock = threading.Lock()  # held by the thread that checks: one check at a time, the others wait for it


def enabled() -> bool:
    """Whether checks run (``HALFADAM_SELFCHECK`` is not 0/false/off/no, or inside :func:`recheck`)."""
    rechecking = _thread.rechecked is not None
    return rechecking or os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@contextlib.contextmanager
def recheck() -> Iterator[None]:
    """Within it, every configuration the calling thread steps is checked again, ``HALFADAM_SELFCHECK=0``
    or not (``halfadam doctor``), and :func:`results` in that thread holds those checks only; other
    threads keep the earlier verdicts. Afterwards the earlier verdicts stand where they exist (a
    configuration that failed keeps failing) and the new ones are added."""
    outer, _thread.rechecked = _thread.rechecked, {}
    try:
        yield
    finally:
        rechecked, _thread.rechecked = _thread.rechecked, outer
        with _lock:
            for config, verdict in rechecked.items():
                _table().setdefault(config, verdict)


def results() -> Dict[Config, Verdict]:
    """Every check run in this process so far, by configuration (inside :func:`recheck`: those it ran)."""
    return dict(_table())


def _table() -> Dict[Config, Verdict]:
    """The verdicts this thread reads and records: :func:`recheck`'s own inside one, else the process's."""
    return _verdicts if _thread.rechecked is None else _thread.rechecked


def kernel_agrees(config: Config, run: Callable[[str, dict], None]) -> bool:
    """Whether ``config``'s kernel gives the reference's bits (checked on its first use in this process).

    ``run(implementation, case)`` steps :func:`synthetic_set`'s ``case`` with ``implementation``
    (``config.kernel`` or the reference) through the layout's own execution. On the first difference
    a RuntimeWarning says what differed, and ``False`` is returned from then on. An exception from the
    kernel itself (it does not compile here, say) propagates and records nothing.

    One check runs at a time: a thread that meets a configuration not yet checked while another thread
    checks (this configuration or another) waits for that check to end, then uses or runs its own, so
    no thread steps a kernel before its verdict.
    """
    if _thread.checking:
        return True
    verdict = _table().get(config)  # every step after the first: one lookup
    if verdict is None:
        if not enabled() or _capturing(config):
            return True
        with _lock:
            verdict = _table().get(config)  # checked by another thread while this one waited
            fresh = verdict is None
            if fresh:
                verdict = _table()[config] = _timed_check(config, run)
        if fresh and not verdict.agrees:
            warnings.warn(
                f"halfadam: self-check failed for {config.describe()}: {verdict.difference}. This configuration runs "
                f"{'nothing' if config.layout == 'capturable' else 'the reference execution'} for the rest of "
                f"this process (the same results, slower). Please report it to halfadam's issue tracker with the "
                f"output of `halfadam doctor`. To avoid the kernel from the start: implementation='foreach' (or "
                f"HALFADAM_CPP=0 for the C++ one); {ENV}=0 skips the check and trains on the kernel as it is.",
                RuntimeWarning, stacklevel=3)
    return verdict.agrees


def _timed_check(config: Config, run: Callable[[str, dict], None]) -> Verdict:
    """:func:`_check` in this thread (its own kernel calls unchecked), as a :class:`Verdict`."""
    _thread.checking = True
    try:
        start = time.perf_counter()
        difference = _check(config, run)
        return Verdict(config, difference, time.perf_counter() - start)
    finally:
        _thread.checking = False


def _capturing(config: Config) -> bool:
    """Whether a CUDA graph is being captured on ``config``'s device (a check reads the host: it runs in
    the warm-up step before, where a configuration first steps)."""
    return config.device.startswith("cuda") and torch.cuda.is_current_stream_capturing()


@torch.no_grad()
def _check(config: Config, run: Callable[[str, dict], None]) -> Optional[str]:
    device = torch.device(config.device)
    kernel_case, reference_case = (synthetic_set(config, device) for _ in range(2))
    for step in (1, 2):
        if step == 2:  # a user's write between steps: the next step starts from it (master sync)
            for case in (kernel_case, reference_case):
                case["params"][3].detach()[0, :9] = case["params"][3].detach()[1, :9] * -2
        for case in (kernel_case, reference_case):
            case["grads"] = case["all_grads"][step - 1]
        run(config.kernel, kernel_case)
        run("foreach" if config.layout != "shard" else "reference", reference_case)
        difference = compare(kernel_case["outputs"](), reference_case["outputs"]())
        if difference is not None:
            return f"after step {step}, {difference}"
    return None


def synthetic_set(config: Config, device: torch.device) -> dict:
    """Parameters, two steps' gradients and their initial state for ``config`` (the same on every call).

    Returns a dict: ``params`` (float tensors of :data:`SHAPES`, ``requires_grad``), ``all_grads`` (two
    lists of gradients), ``grad_scale`` (a 0-d float32 tensor or ``None``) and ``bucket``: a
    :class:`halfadam.buckets.Bucket` over the parameters whose state is attached to ``state`` (a dict
    by parameter), with fp32 masters set at and next to rounding midpoints; ``outputs()`` gives every
    tensor a step writes, by name.
    """
    gen = torch.Generator().manual_seed(0)
    params, all_grads = [], [[], []]
    for k, shape in enumerate(SHAPES):
        n = torch.Size(shape).numel()
        p = _spread(n, gen, -4, 4, [0.0, -0.0, _tiny(config.param_dtype), _tiny(config.param_dtype) / 8,
                                    torch.finfo(config.param_dtype).max / 4, -1.0, 3.0])
        params.append(p.to(config.param_dtype).view(shape).to(device).requires_grad_(True))
        for s in range(2):
            g = _spread(n, gen, -7, 2, [0.0, _tiny(config.grad_dtype) / 4, torch.finfo(config.grad_dtype).max / 16,
                                        float("nan"), float("inf"), -float("inf")] if k == 4 - s else [])
            if k == 3:
                g.view(shape)[2 + s] = 0  # a row of zeros
            if config.scaled:
                g = g / LOSS_SCALE
            all_grads[s].append(g.to(config.grad_dtype).view(shape).to(device))
    bucket = Bucket(params, config.has_master, config.fmt, steps_on_device=config.layout == "capturable")
    state: Dict[Tensor, dict] = {}
    for i, p in enumerate(params):
        state[p] = {}
        bucket.attach(state[p], i)
    if "master_weight" in bucket.flat:
        _midpoints_(bucket)
    if config.layout == "shard":  # each parameter's state its own tensors, as FSDP2's shards keep it
        for p in params:
            state[p] = {key: v.clone() for key, v in state[p].items()}
    case = dict(params=params, all_grads=all_grads, bucket=bucket, state=state,
                grad_scale=torch.tensor(LOSS_SCALE, device=device) if config.scaled else None)
    case["outputs"] = lambda: _outputs(case, config.layout)
    return case


def _outputs(case: dict, layout: str) -> Dict[str, Tensor]:
    out = {f"params[{k}]": p.detach() for k, p in enumerate(case["params"])}
    if layout == "shard":
        for k, p in enumerate(case["params"]):
            out.update({f"state[params[{k}]][{key!r}]": v for key, v in case["state"][p].items()})
    else:
        bucket = case["bucket"]
        out.update({f"{key} (flat)": v for key, v in bucket.flat.items()})
        out["step (flat)"] = bucket.steps
    return out


def _tiny(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).tiny)


def _spread(n: int, gen: torch.Generator, lo: int, hi: int, specials: List[float]) -> Tensor:
    """``n`` float32 values of both signs, log-uniform over binades ``lo`` to ``hi``, ``specials`` first."""
    x = torch.randn(n, generator=gen).sign() * torch.exp2(torch.empty(n).uniform_(lo, hi, generator=gen))
    x[:len(specials)] = torch.tensor(specials[:n], dtype=torch.float32)
    return x


def _midpoints_(bucket: Bucket) -> None:
    """Every third fp32 master element halfway to its parameter's next value away from zero (a tie of
    the rounding), and every third one just below that midpoint, for finite nonzero parameters."""
    for i, p in enumerate(bucket.params):
        v = p.detach().reshape(-1)
        nxt = (v.view(torch.int16) + 1).view(v.dtype).float()  # the next value away from zero
        mid = (v.float() + nxt) / 2  # exact in float32
        pick = torch.arange(v.numel(), device=v.device) % 3
        ok = torch.isfinite(mid) & (v != 0)
        value = torch.where(ok & (pick == 0), mid, v.float())
        value = torch.where(ok & (pick == 1), torch.nextafter(mid, v.float()), value)
        bucket.view(bucket.flat["master_weight"], i).copy_(value.view(p.shape))


def compare(got: Dict[str, Tensor], want: Dict[str, Tensor]) -> Optional[str]:
    """The first difference of bits between two dicts of tensors (two nans are equal), or ``None``."""
    for name, a in got.items():
        b = want[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name} is {a.dtype} {tuple(a.shape)} where the reference gives {b.dtype} {tuple(b.shape)}"
        a, b = a.detach().reshape(-1), b.detach().reshape(-1)
        if a.is_floating_point():
            bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
            same = (a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())
        else:
            same = a == b
        bad = (~same).nonzero()
        if bad.numel():
            i = int(bad[0])
            return (f"{name} element {i} is {_show(a[i])} where the reference gives {_show(b[i])} "
                    f"({bad.numel()} of {a.numel()} elements differ)")
    return None


def _show(x: Tensor) -> str:
    if not x.is_floating_point():
        return str(int(x))
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()]
    raw = int(x.reshape(1).view(bits)) & ((1 << (8 * x.element_size())) - 1)
    return f"{float(x):.9g} (0x{raw:0{2 * x.element_size()}x})"
