"""Ways to run :func:`halfadam.functional.adam_update_` over a parameter group.

* :func:`reference_step`: one ``adam_update_`` call per parameter (the readable definition and the
  fallback for anything unusual);
* :func:`flat_step` over a :class:`halfadam.buckets.Bucket`: ``adam_coefficients`` eagerly (a few 0-d
  float64 ops), then ``adam_elementwise_`` over the flat buffers through :func:`_flat_kernel`, either
  compiled by ``torch.compile`` (``"fused"``) or run eagerly in cache-sized chunks (``"foreach"``);
  or, for CPU buckets in every state mode (8-bit moments included), the hand-written C++ kernel of
  :mod:`halfadam.kernels.cpp` (``"cpp"``): the same equations and encodings, bit for bit, one call per
  bucket, reading every gradient and writing every parameter where it lies; or the hand-written
  Triton kernel of :mod:`halfadam.kernels.triton` (``"triton"``: CUDA, and CPU tensors under
  ``TRITON_INTERPRET=1``), one launch per bucket through a table of the tensors' addresses;
* :func:`capturable_step`: the Triton launch with the step counts and coefficients on the device and
  ``found_inf`` read by the kernel (``capturable=True``: nothing read on the host);
* :func:`shard_step`: kernel calls for parameters with their own state tensors (FSDP2's local
  shards): C++ calls on the CPU; Triton launches on a GPU, the state addresses in the tensor table.

Which one ``"auto"`` runs: ``"cpp"`` for CPU buckets when the kernel builds (it moves each byte once,
with no per-call entry cost); ``"triton"`` for CUDA buckets (and FSDP2 shards) where the triton
package imports; otherwise ``"fused"`` (no C++ compiler, no Triton); ``"foreach"`` once a
compilation has failed.

Each execution receives the same inputs from the optimizer: a list of ``(param, grad)`` pairs, the
optimizer's per-parameter ``state`` (already initialised), and the group's resolved hyperparameters.
It advances ``state["step"]`` (once the update has succeeded: a step that raises leaves the counts),
applies the master-sync rule (:func:`halfadam.functional.sync_master_`:
an element of a parameter that no longer equals its rounded master was written by someone else, and
the master takes that value), updates the fp32 master weights (or fp32 parameters) and moments, and
writes every low-precision parameter back in place (``param.copy_``: round to nearest even), never
rebinding ``param.data``.
"""

from __future__ import annotations

import logging
import types
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ._dtensor import is_dtensor
from .buckets import Bucket, bucket_key
from . import encodings, selfcheck
from .kernels import cpp as cpu_kernel
from .encodings import StateFormat, encoded_update_, for_param, update_param_
from .functional import ADAM, Rule, sync_master_

__all__ = ["Hyperparameters", "IMPLEMENTATIONS", "reference_step", "flat_step", "capturable_step", "shard_step",
           "check_capturable", "check_implementation", "compile_available"]

#: Accepted values of the optimizers' ``implementation`` argument.
IMPLEMENTATIONS = ("auto", "triton", "cpp", "fused", "foreach", "reference")


class Hyperparameters:
    """A parameter group's hyperparameters resolved for the current step (plain Python numbers): ``lr``,
    ``weight_decay``, the update ``rule`` (:class:`halfadam.functional.Rule`, Adam's by default), the
    rule's own ``options`` (Adam: ``beta1``, ``beta2``, ``eps``, ``decay``, ``optimized_update``) and
    the kernels' ``flags`` they make (``rule.flags``, computed once)."""

    __slots__ = ("lr", "weight_decay", "rule", "options", "flags")

    def __init__(self, lr: float, weight_decay: float = 0.0, rule: Rule = ADAM, **options: object) -> None:
        self.lr, self.weight_decay, self.rule, self.options = lr, weight_decay, rule, options
        self.flags: Tuple[bool, bool] = rule.flags(options)

    def coefficients(self, step, lr=None, weight_decay=None) -> tuple:
        """The rule's coefficients of these values at ``step`` (a number, or a tensor of steps for
        per-parameter coefficients on the device; ``lr``/``weight_decay`` given as tensors make
        tensors of every coefficient)."""
        return self.rule.coefficients(step, self.lr if lr is None else lr,
                                      self.weight_decay if weight_decay is None else weight_decay, **self.options)

    def for_check(self) -> "Hyperparameters":
        """The values the self-check steps the kernels with: the same rule and flags."""
        return Hyperparameters(1e-3, 0.1, self.rule, **self.rule.check_options(self.options))


def reference_step(pairs: List[Tuple[Tensor, Tensor]], state: Dict[Tensor, dict], hp: Hyperparameters,
                   grad_scale: Optional[Tensor] = None, fmt: StateFormat = StateFormat(),
                   offsets: Optional[List[int]] = None) -> None:
    """The readable definition: one ``hp.rule.elementwise`` call per parameter (Adam's:
    :func:`halfadam.functional.adam_update_`'s per-element half).

    For a parameter with a master weight the update runs on ``state["master_weight"]`` and the result
    is copied into the parameter; for a float32 (or float64) parameter without one it runs on the
    parameter itself; for a half-precision parameter whose master weights are off it runs on a
    temporary fp32 copy (the "fp32 compute, no master" baseline, which loses updates below half an ulp).
    With an encoded state (``fmt`` other than fp32) each parameter's state is decoded, updated by the
    same equations and encoded back (:func:`halfadam.encodings.update_param_`); ``offsets`` gives each
    parameter's position in its whole tensor (a DTensor's local shard), from which random bits are drawn.
    """
    if grad_scale is not None:
        grad_scale = grad_scale.to(dtype=torch.float32).reshape(())
    for k, (param, grad) in enumerate(pairs):
        if grad_scale is not None:
            grad = grad.to(torch.float32) * grad_scale.to(grad.device)
        st = state[param]
        step = st["step"].item() + 1  # the step being taken; counted once its update has succeeded
        pfmt = for_param(fmt, param, encodings.has_master(st))
        if not pfmt.is_fp32:
            update_param_(pfmt, param, st, grad, hp.coefficients(step), int(step), rule=hp.rule, flags=hp.flags,
                          offset=offsets[k] if offsets else 0)
            st["step"] += 1
            continue
        master = st.get("master_weight")
        compute_dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
        if master is not None:
            sync_master_(master, param)
        weight = master if master is not None else param.to(compute_dtype)
        hp.rule.elementwise(weight, grad.to(compute_dtype), [st[key] for key, _ in pfmt.moments],
                            hp.coefficients(step), hp.flags)
        if weight is not param:
            param.copy_(weight)
        st["step"] += 1


# ---------------------------------------------------------------------------------------- flat paths
def _flat_kernel(stored: Dict[str, Tensor], grad: Tensor, param: Optional[Tensor], coefficients: Tuple[Tensor, ...],
                 seed: Optional[Tensor], grad_scale: Optional[Tensor], *, fmt: StateFormat, rule: Rule,
                 flags: Tuple[bool, bool]) -> None:
    """One bucket segment's update over flat buffers: unscale, then :func:`halfadam.encodings.encoded_update_`
    (decode the state, master sync, :func:`adam_elementwise_`, encode, write the parameter back).

    ``stored`` holds the segment's state buffers by key (and ``"weight"``, the float32 weight updated
    in place, when there is no master); ``grad`` is the flat gradient in any float dtype; ``param``
    (or ``None``) holds the parameters' current values (read first, for the master sync) and receives
    the new weights rounded to the parameters' dtype. Every changing value is a 0-d tensor (the
    coefficients, ``seed``: the step as int64, the loss scale), so the compiled form is reused for
    any learning rate, weight decay, step or loss scale.
    """
    g = grad.to(torch.float32)
    if grad_scale is not None:
        g = g * grad_scale
    encoded_update_(stored, param, g, coefficients, seed, fmt=fmt, rule=rule, flags=flags)


def _describe(exc: BaseException) -> str:
    """``<ExceptionType>: <first line of its message>`` (at most 200 characters of it)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def _cached(bucket: Bucket, name: str, key, build):
    """``bucket.kernel_cache``'s value ``name`` for ``key``, built by ``build(key)`` when the key changed
    (one entry per name: a cache that changing subsets or addresses cannot grow)."""
    found = bucket.kernel_cache.get(name)
    if found is None or found[0] != key:
        found = bucket.kernel_cache[name] = (key, build(key))
    return found[1]


_compiled_kernels: Dict[tuple, object] = {}
_compiled_ran: set = set()  # variants that have run once (compiled) in this process
_compile_failed: Optional[str] = None


def _get_compiled(key: tuple = ()):
    """The compiled :func:`_flat_kernel` for one variant (dtypes, decay mode, ``optimized_update``).

    Sizes are dynamic (the callers mark dimension 0 of every tensor argument with
    ``maybe_mark_dynamic``), so one graph serves every size; every hyperparameter, the step and the
    loss scale are 0-d tensors, so a variant compiles once and no value change recompiles. (Not
    ``dynamic=True``: it also turns Python float arguments into symbols, and with torch 2.13's FX
    graph cache a kernel then reused another's float constants, silently;
    ``tests/test_executions.py::test_fused_variants_do_not_share_constants``.) Each variant gets its
    own copy of the function's code object, hence its own Dynamo cache and recompile limit: a process
    mixing float16, bfloat16 and float32 buckets, scaler and no scaler, never hits the shared limit.
    """
    fn = _compiled_kernels.get(key)
    if fn is None:
        code = _flat_kernel.__code__.replace(co_name=f"_flat_kernel_{len(_compiled_kernels)}")
        variant = types.FunctionType(code, _flat_kernel.__globals__, code.co_name, _flat_kernel.__defaults__,
                                     _flat_kernel.__closure__)
        # emulate_precision_casts: keep the float32 -> half rounding in the master-sync comparison,
        # which Inductor otherwise elides (see halfadam.functional.sync_master_).
        fn = _compiled_kernels[key] = torch.compile(variant, fullgraph=True,
                                                    options={"emulate_precision_casts": True})
    return fn


def compile_available() -> bool:
    """False once a compilation has failed in this process (``auto`` then runs ``foreach``)."""
    return _compile_failed is None


def _run_kernel(implementation: str, *args, **kwargs) -> None:
    global _compile_failed
    if implementation == "fused" or (implementation == "auto" and _compile_failed is None):
        try:
            stored, grad, param = args[:3]
            key = (grad.device.type, grad.dtype, None if param is None else param.dtype, args[5] is None,
                   tuple(sorted(stored)), tuple(sorted(kwargs.items())))
            for t in [*stored.values(), grad, param]:
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            _get_compiled(key)(*args, **kwargs)
            _compiled_ran.add(key)
            return
        except Exception as exc:  # no C++ compiler / Triton, unsupported backend...
            # only a failure to compile falls back; an error of a kernel that has run is the step's
            compiling = key not in _compiled_ran or isinstance(exc, torch._dynamo.exc.TorchDynamoException)
            if implementation == "fused" or not compiling:
                raise
            _compile_failed = _describe(exc)
            warnings.warn(
                "halfadam: torch.compile of the fused step failed; implementation='auto' falls back to "
                f"'foreach' for the rest of this process ({_compile_failed})", RuntimeWarning, stacklevel=4)
    _eager_chunks(*args, **kwargs)


#: Elements per eager chunk on the CPU: the temporaries of one chunk (256 KiB each) stay in cache,
#: and large flat buffers do not allocate (and page-fault) full-size temporaries on every op. On a
#: GPU each op is one launch, so the whole buffer is one chunk (on an H200, 64K-element chunks made
#: a 20M-parameter step 138x slower than torch's fused one).
EAGER_CHUNK = 1 << 16


def _eager_chunks(stored, grad, param, *rest, **kwargs) -> None:
    """:func:`_flat_kernel` run eagerly, chunk by chunk over the flat buffers (the foreach path)."""
    n = grad.numel()
    chunk = EAGER_CHUNK if grad.device.type == "cpu" else max(n, 1)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        _flat_kernel(encodings.slice_flat(stored, start, end), grad[start:end],
                     None if param is None else param[start:end], *rest, **kwargs)


def capturable_step(bucket: Bucket, items: List[Tuple[int, Tensor]], hp: Hyperparameters, implementation: str,
                    grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
    """One Triton launch for the parameters of ``items`` that reads no value on the host (``capturable=True``).

    The step counts live on the bucket's device (``bucket.steps``), so they may differ between the
    parameters (each gets its own coefficients, computed on the device); ``found_inf`` (a 1-element
    float32 device tensor or ``None``): where it is nonzero the kernel writes nothing and the counts
    stay. Every operation is a device operation with the host's numbers baked in (lr, weight decay),
    so the step can be captured in a CUDA graph once the tensor table is built (a warm-up step).

    Raises:
        RuntimeError: the Triton kernel cannot run this bucket (``capturable=True`` runs only it).
    """
    _uses_triton(bucket, "triton", hp)  # raises where it cannot run (the optimizer allows only auto and triton)
    if not _agrees("triton", "capturable", bucket.format, bucket.has_master, bucket.dtype,
                   _launch_grad_dtype([g for _, g in items], bucket.dtype), hp, grad_scale, bucket.device):
        raise RuntimeError("capturable=True runs only the Triton kernel, and it failed its self-check on this "
                           "configuration (see the warning above); use capturable=False")
    index = _cached(bucket, "index", tuple(i for i, _ in items),
                    lambda key: torch.tensor(key, dtype=torch.int64, device=bucket.device))
    steps = bucket.steps[index] + 1  # the steps being taken
    _triton_step(bucket, items, hp, grad_scale, _triton().device_scalars(hp.coefficients(steps), steps), found_inf)
    taken = torch.ones_like(steps) if found_inf is None else (1 - found_inf.to(steps.dtype)).expand_as(steps)
    bucket.steps.index_add_(0, index, taken)


def flat_step(bucket: Bucket, items: List[Tuple[int, Tensor]], hp: Hyperparameters, implementation: str,
              grad_scale: Optional[Tensor] = None) -> None:
    """One step for the parameters ``bucket.params[i]`` of ``items`` (``(i, grad)`` pairs, ``i`` rising).

    All of them must have the same step count. Parameters of the bucket that are not in ``items``
    (no gradient this step) are left untouched: the kernel runs over each run of consecutive
    indices. ``implementation`` is ``"fused"`` (the kernel compiled by ``torch.compile``: Inductor
    C++ on CPU, Triton on CUDA), ``"foreach"`` (the same function run eagerly over the flat buffers
    in chunks of :data:`EAGER_CHUNK` elements on the CPU, whole on a GPU: a few ops per chunk
    instead of per tensor), ``"cpp"`` (the C++ kernel: CPU buckets, every state format) or
    ``"auto"`` (cpp where it applies and builds, else fused, or foreach when compiling is
    impossible here).
    """
    device = bucket.device
    subset = None if len(items) == len(bucket.params) else [i for i, _ in items]
    step = bucket.steps[items[0][0]] + 1  # the step being taken; counted once the update has succeeded
    grad_dtype = items[0][1].dtype
    if _uses_triton(bucket, implementation, hp):
        if _guarded_triton_step(implementation, bucket, items, hp, grad_scale,
                                _triton().scalars(hp.coefficients(int(step)), int(step), device)):
            bucket.advance_steps(subset)
            return
        if _triton_failed is None:  # it failed its self-check
            implementation = "foreach"
    kernel = _cpp_kernel(bucket.device, bucket.format, implementation, hp)
    if kernel is not None:
        if _agrees("cpp", "bucket", bucket.format, bucket.has_master, bucket.dtype, grad_dtype, hp, grad_scale, device):
            _cpp_step(kernel, bucket, items, hp, grad_scale, int(step))
            bucket.advance_steps(subset)
            return
        implementation = "foreach"
    f64 = dict(dtype=torch.float64, device=device)
    coefficients = hp.coefficients(step.to(**f64), torch.tensor(hp.lr, **f64), torch.tensor(hp.weight_decay, **f64))
    seed = encodings.random_seed(bucket.format, step, device)  # None unless the format rounds stochastically
    if grad_scale is not None:
        grad_scale = grad_scale.to(device=device, dtype=torch.float32).reshape(())
    fmt = bucket.format
    rest = dict(fmt=fmt, rule=hp.rule, flags=hp.flags)
    grads = dict(items)
    for i, j, kind in _segments(bucket, items):
        if kind == "tails":  # rows ending in short blocks: stepped in its padded layout, eagerly
            grad = grads[i] if grad_scale is None else grads[i].to(torch.float32) * grad_scale
            update_param_(fmt, bucket.params[i], bucket.state_views(i), grad, hp.coefficients(int(step)), int(step),
                          rule=hp.rule, flags=hp.flags)
            continue
        a, b = bucket.offsets[i], bucket.offsets[j - 1] + bucket.sizes[j - 1]
        stored = bucket.segment(i, j)
        if kind == "direct":  # one large parameter: read its gradient and write it in place, no copies
            param, grad = bucket.params[i].detach().view(-1), grads[i].view(-1)
            if not bucket.has_master:
                stored["weight"], param = param, None
            _run_kernel(implementation, stored, grad, param, coefficients, seed, grad_scale, **rest)
            continue
        # a run of smaller parameters: gather their values and gradients into flat buffers, one kernel
        # call, copy the results into the parameters
        seg_grads = [grads[k] for k in range(i, j)]
        gdtype = seg_grads[0].dtype
        if any(g.dtype != gdtype for g in seg_grads):
            gdtype = torch.float32  # mixed gradient dtypes: gather (converting) into a float32 buffer
        buf = bucket.grad_buffer(gdtype)
        torch._foreach_copy_(bucket.views(buf)[i:j], seg_grads)
        out_views = bucket.views(bucket.out)[i:j]
        torch._foreach_copy_(out_views, bucket.params[i:j])
        param = bucket.out[a:b]
        if not bucket.has_master:
            stored["weight"], param = param, None
        _run_kernel(implementation, stored, buf[a:b], param, coefficients, seed, grad_scale, **rest)
        torch._foreach_copy_(bucket.params[i:j], out_views)
    bucket.advance_steps(subset)


_log = logging.getLogger("halfadam")
_auto_logged: set = set()
_triton_launched = False  # a Triton launch has succeeded in this process
_triton_failed: Optional[str] = None  # why auto stopped running it (its first launch failed)


def _guarded_triton_step(implementation: str, *args) -> bool:
    """:func:`_triton_step` once its configuration passed its self-check (``False`` where it failed it);
    under ``"auto"``, a failure of the process's first launch (the kernel does not
    compile for this GPU, say) is a one-time RuntimeWarning and ``False``: auto then runs ``fused`` for
    the rest of the process. A failure after a launch has succeeded, or with ``"triton"``, raises."""
    global _triton_launched, _triton_failed
    bucket, items, hp, grad_scale = args[:4]
    try:
        if not _agrees("triton", "bucket", bucket.format, bucket.has_master, bucket.dtype,
                       _launch_grad_dtype([g for _, g in items], bucket.dtype), hp, grad_scale, bucket.device):
            return False
        _triton_step(*args)
    except Exception as exc:
        if implementation != "auto" or _triton_launched:
            raise
        _triton_failed = _describe(exc)
        warnings.warn(f"halfadam: the Triton kernel's first launch failed; implementation='auto' runs 'fused' "
                      f"(torch.compile) for the rest of this process ({_triton_failed})", RuntimeWarning, stacklevel=5)
        return False
    _triton_launched = True
    return True


def _uses_triton(bucket: Bucket, implementation: str, hp: Hyperparameters) -> bool:
    """Whether ``implementation`` runs the Triton kernel on ``bucket``: ``"triton"`` (raising where it
    cannot run), or ``"auto"`` on a CUDA bucket where Triton imports (one log line per device type).

    Raises:
        RuntimeError: ``implementation="triton"`` where the kernel cannot run (the reason is in the message).
    """
    return implementation in ("triton", "auto") and _runs_rule("triton", hp, implementation) and _triton_runs(
        bucket.device, implementation, lambda: f"this bucket ({bucket.device}, {bucket.format.describe()})")


def _triton_runs(device: torch.device, implementation: str, what: Callable[[], str]) -> bool:
    """:func:`_uses_triton` for tensors on ``device`` (``what()`` names them in the error)."""
    if implementation == "triton":
        reason = _triton().unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"implementation='triton' cannot run {what()}: {reason}; use implementation='auto'")
        return True
    if implementation != "auto" or device.type != "cuda" or _triton_failed is not None:
        return False
    triton_kernel = _triton()
    use = triton_kernel.available(device)
    if device.type not in _auto_logged:
        _auto_logged.add(device.type)
        _log.info("halfadam: implementation='auto' runs %s on %s", "the Triton kernel ('triton')" if use else
                  f"'fused' (torch.compile): {triton_kernel.unavailable_reason(device)}", device.type)
    return use


def shard_step(pairs: List[Tuple[Tensor, Tensor]], state: Dict[Tensor, dict], hp: Hyperparameters,
               implementation: str, grad_scale: Optional[Tensor] = None, fmt: StateFormat = StateFormat(),
               offsets: Optional[List[int]] = None) -> List[int]:
    """Kernel calls for parameters whose state tensors are their own (FSDP2's local shards, whose state
    stays DTensors sharded like them for DCP), in every state format: on a GPU the Triton kernel, its
    tensor table carrying each shard's state addresses, one launch per (device, dtype, state format,
    step count); on the CPU the C++ kernel, one call per shard. ``offsets``: each shard's first
    element in its whole parameter (the random bits' positions). Takes the contiguous parameters (with
    contiguous state) the kernel runs for ``implementation`` ("auto", "triton" or "cpp"); returns the
    indices of ``pairs`` it did not take (for :func:`reference_step`)."""
    left, launches, coefficients = [], {}, {}
    for k, (p, g) in enumerate(pairs):
        st = state[p]
        with_master = encodings.has_master(st)
        pfmt = for_param(fmt, p, with_master)
        keys = [*encodings.element_keys(pfmt, with_master), *encodings.block_keys(pfmt, with_master)]
        fits = (p.dtype == torch.float32 or (p.dtype in (torch.float16, torch.bfloat16) and with_master)) \
            and p.is_contiguous() and all(st[key].is_contiguous() for key in keys)
        step = int(st["step"].item()) + 1  # the step being taken
        kernel = _cpp_kernel(p.device, pfmt, implementation, hp) if fits else None
        if kernel is not None and not _agrees("cpp", "shard", pfmt, with_master, p.dtype, g.dtype, hp, grad_scale,
                                              p.device):
            left.append(k)
        elif kernel is not None:
            if step not in coefficients:
                coefficients[step] = hp.coefficients(step)
            _cpp_call(kernel, [p], [g], {key: st[key].view(-1) for key in keys}, [0], [0],
                      [encodings.kernel_row_length(pfmt, tuple(p.shape), with_master)],
                      [offsets[k] if offsets else 0], pfmt, hp, coefficients[step], grad_scale, step)
            st["step"] += 1
        elif fits and implementation in ("auto", "triton") \
                and _runs_rule("triton", hp, implementation) \
                and _triton_runs(p.device, implementation, lambda: f"a parameter shard on {p.device}"):
            launches.setdefault((p.device, p.dtype, pfmt, with_master, step), []).append(k)
        else:
            left.append(k)
    for (device, dtype, pfmt, with_master, step), ks in launches.items():
        triton_kernel = _triton()
        params, grads = [pairs[k][0].detach() for k in ks], [pairs[k][1] for k in ks]
        gdtype = _launch_grad_dtype(grads, dtype)
        if not _agrees("triton", "shard", pfmt, with_master, dtype, gdtype, hp, grad_scale, device):
            left.extend(ks)
            continue
        grads = [g.to(gdtype).contiguous() for g in grads]
        rows = [encodings.kernel_row_length(pfmt, tuple(p.shape), with_master) for p in params]
        sizes = [_work_size(p.numel(), r, pfmt) for p, r in zip(params, rows)]
        table = triton_kernel.tensor_table(params, grads, sizes, [0] * len(ks), [offsets[k] if offsets else 0 for k in ks],
                                           device, rows, [0] * len(ks),
                                           states=[_slots(state[pairs[k][0]], pfmt) for k in ks])
        triton_kernel.launch(triton_kernel.work_list(sizes, device), table,
                             triton_kernel.scalars(hp.coefficients(step), step, device), {},
                             param_dtype=dtype, grad_dtype=gdtype, master=_master_kind(pfmt, with_master),
                             **_triton_rule(pfmt, hp), grad_scale=None if grad_scale is None else
                             grad_scale.to(device=device, dtype=torch.float32).reshape(1))
        for k in ks:
            state[pairs[k][0]]["step"] += 1
    return left


def _agrees(kernel: str, layout: str, fmt: StateFormat, has_master: bool, dtype: torch.dtype,
            grad_dtype: torch.dtype, hp: Hyperparameters, grad_scale: Optional[Tensor], device: torch.device) -> bool:
    """:func:`halfadam.selfcheck.kernel_agrees` for this configuration, run through ``layout``'s execution."""
    variant = f"{cpu_kernel.lanes()} lanes" if kernel == "cpp" else \
        "interpreted" if device.type == "cpu" else "compiled"
    config = selfcheck.Config(kernel, str(device), dtype, grad_dtype, fmt, has_master, hp.rule.describe(hp.flags),
                              grad_scale is not None, layout, variant)

    def run(implementation: str, case: dict) -> None:  # called only by a check
        check_hp = hp.for_check()
        params, grads, scale = case["params"], case["grads"], case["grad_scale"]
        if layout == "shard":
            pairs, offsets = list(zip(params, grads)), [2 * p.numel() for p in params]  # a third of 3 shards
            if implementation == "reference":
                reference_step(pairs, case["state"], check_hp, scale, fmt, offsets)
            elif shard_step(pairs, case["state"], check_hp, implementation, scale, fmt, offsets):
                raise RuntimeError(f"self-check: the {implementation} kernel did not take the synthetic shards")
        elif layout == "capturable" and implementation == "triton":
            capturable_step(case["bucket"], list(enumerate(grads)), check_hp, implementation, scale)
        else:
            flat_step(case["bucket"], list(enumerate(grads)), check_hp, implementation, scale)

    return selfcheck.kernel_agrees(config, run)


def _work_size(numel: int, row_length: int, fmt: StateFormat) -> int:
    """The elements a kernel steps for a tensor of ``numel`` elements in rows of ``row_length``: its blocks
    times BLOCK in a blocked format (each row padded to whole blocks), else ``numel``."""
    if not fmt.blocked:
        return numel
    return encodings.blocks_in_rows(numel, row_length) * encodings.BLOCK


def _launch_grad_dtype(grads: List[Tensor], param_dtype: torch.dtype) -> torch.dtype:
    """The gradient dtype of one Triton launch: the gradients' own when they share one that is float32
    or the parameters' dtype, else float32 (the others are converted)."""
    dtype = grads[0].dtype
    return dtype if dtype in (torch.float32, param_dtype) and all(g.dtype == dtype for g in grads) else torch.float32


def _master_kind(fmt: StateFormat, has_master: bool) -> int:
    """The Triton kernel's code for how the master is kept."""
    kernel = _triton()
    if not has_master:
        return kernel.MASTER_NONE
    return {"fp32": kernel.MASTER_FP32, "split": kernel.MASTER_SPLIT, "split8": kernel.MASTER_SPLIT8}[fmt.master]


def _triton():
    """:mod:`halfadam.kernels.triton`, imported on first use (it imports triton)."""
    from .kernels import triton as triton_kernel
    return triton_kernel


def check_implementation(implementation: str, capturable: bool) -> None:
    """The optimizer's ``implementation`` and ``capturable`` arguments: ValueError for an
    implementation not in :data:`IMPLEMENTATIONS`, or ``capturable=True`` with one that does not run
    the Triton kernel; TypeError for a ``capturable`` that is not a bool."""
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if not isinstance(capturable, bool):
        raise TypeError(f"capturable must be True or False, got {capturable!r}")
    if capturable and implementation not in ("auto", "triton"):
        raise ValueError(f"capturable=True runs the Triton kernel (implementation='auto' or 'triton'), "
                         f"not implementation={implementation!r}")

def check_capturable(pairs: List[Tuple[Tensor, Tensor]], params: List[Tensor], where: str,
                     use_master: Callable[[Tensor], bool]) -> None:
    """ValueError for a parameter a capturable step cannot take: one on a device the Triton kernel
    does not run on (the CPU, unless under Triton's interpreter), or one outside the buckets
    (float64, a DTensor, a half parameter without master weights, a frozen one), which runs the
    reference path, which reads its step count on the host. ``params``: the group's parameters (to name
    one as ``where['params'][k]``); ``use_master(p)``: whether ``p`` has master weights."""
    for device in {p.device for p, _ in pairs}:
        reason = triton_unavailable(device)
        if reason is not None:
            k = next(i for i, q in enumerate(params) if q.device == device)
            raise ValueError(
                f"capturable=True cannot step {where}['params'][{k}], a {device.type} tensor: a capturable step "
                f"runs the Triton kernel, which needs CUDA tensors ({reason}). Use capturable=True with the "
                f"model on a CUDA device; elsewhere leave it False (the default)")
    for p, _ in pairs:
        if bucket_key(p, use_master(p)) is None:
            k = next(i for i, q in enumerate(params) if q is p)
            raise ValueError(
                f"{where}['params'][{k}] ({p.dtype}{', a DTensor' if is_dtensor(p) else ''}) takes the "
                f"per-parameter reference path, which reads its step count on the host: capturable=True "
                f"steps float32 parameters and float16/bfloat16 ones with master weights")


def triton_unavailable(device: torch.device) -> Optional[str]:
    """Why the Triton kernel cannot run tensors on ``device``, or ``None`` where it can."""
    return _triton().unavailable_reason(device)


def _triton_step(bucket: Bucket, items: List[Tuple[int, Tensor]], hp: Hyperparameters,
                 grad_scale: Optional[Tensor], scalars: Tensor, found_inf: Optional[Tensor] = None) -> None:
    """One Triton launch for the parameters of ``items``, reading each gradient and writing each parameter
    where it lies, with the step's ``scalars`` (:func:`halfadam.kernels.triton.scalars` or
    ``device_scalars``). A non-contiguous parameter goes through its slice of ``bucket.out``; a
    gradient that is non-contiguous, or of a dtype other than float32 and the parameter's (or of
    mixed dtypes in one call), through a float32 gradient buffer."""
    triton_kernel = _triton()
    device = bucket.device
    index = [i for i, _ in items]
    grads = [g for _, g in items]
    gdtype = _launch_grad_dtype(grads, bucket.dtype)
    params, staged = [], []
    for k, (i, g) in enumerate(items):
        p = bucket.params[i].detach()
        if not p.is_contiguous():
            view = bucket.views(bucket.out)[i]
            view.copy_(p)
            staged.append((p, view))
            p = view
        params.append(p)
        if not g.is_contiguous() or g.dtype != gdtype:
            grads[k] = bucket.views(bucket.grad_buffer(torch.float32))[i].copy_(g) if gdtype == torch.float32 \
                else g.contiguous()
    sizes = lambda: [_work_size(bucket.numels[i], bucket.row_lengths[i], bucket.format) for i in index]  # noqa: E731
    work = _cached(bucket, "work", tuple(index), lambda key: triton_kernel.work_list(sizes(), device))
    table = _cached(bucket, "table", tuple(p.data_ptr() for p in params) + tuple(g.data_ptr() for g in grads),
                    lambda key: triton_kernel.tensor_table(params, grads, sizes(), [bucket.offsets[i] for i in index],
                                                           [0] * len(index), device,
                                                           [bucket.row_lengths[i] for i in index],
                                                           [bucket.block_offsets[i] for i in index]))
    fmt = bucket.format
    if grad_scale is not None:
        grad_scale = grad_scale.to(device=device, dtype=torch.float32).reshape(1)
    triton_kernel.launch(work, table, scalars, _slots(bucket.flat, fmt), param_dtype=bucket.dtype,
                         grad_dtype=gdtype, master=_master_kind(fmt, bucket.has_master), **_triton_rule(fmt, hp),
                         grad_scale=grad_scale, found_inf=found_inf)
    for p, view in staged:
        p.copy_(view)


def _runs_rule(kernel: str, hp: Hyperparameters, implementation: str) -> bool:
    """Whether ``kernel`` ("cpp" or "triton") runs ``hp.rule`` (:data:`KERNEL_RULES`).

    Raises:
        RuntimeError: ``implementation`` names ``kernel`` and it does not run the rule.
    """
    if hp.rule.kernel in KERNEL_RULES[kernel]:
        return True
    if implementation == kernel:
        raise RuntimeError(f"implementation={kernel!r} does not run the {hp.rule.name} rule yet; use "
                           f"implementation='auto', 'fused' or 'foreach'")
    return False


def _cpp_kernel(device: torch.device, fmt: StateFormat, implementation: str, hp: Hyperparameters):
    """The C++ kernel module if ``implementation`` runs it on parameters on ``device`` in ``fmt``, else ``None``.

    Raises:
        RuntimeError: ``implementation="cpp"`` and ``device`` is not the CPU, or the kernel is
            unavailable here, or it does not run the rule (the reason is in the message).
    """
    if implementation not in ("cpp", "auto") or not _runs_rule("cpp", hp, implementation):
        return None
    if device.type != "cpu":
        if implementation == "cpp":
            raise RuntimeError(
                f"implementation='cpp' runs CPU parameters only; these are on {device} in "
                f"{fmt.describe()}: use implementation='auto' or 'fused'")
        return None
    kernel = cpu_kernel.load()
    if kernel is None and implementation == "cpp":
        raise RuntimeError(f"implementation='cpp': the C++ CPU kernel is unavailable here "
                           f"({cpu_kernel.unavailable_reason()}); use implementation='auto' or 'fused'")
    return kernel


def _cpp_step(kernel, bucket: Bucket, items: List[Tuple[int, Tensor]], hp: Hyperparameters,
              grad_scale: Optional[Tensor], step: int) -> None:
    """One C++ kernel call for the parameters of ``items``: gradients read and parameters written in place."""
    if len(items) == len(bucket.params):
        params, layout = bucket.params, (bucket.offsets, bucket.block_offsets, bucket.row_lengths)
    else:
        params = [bucket.params[i] for i, _ in items]
        layout = tuple([column[i] for i, _ in items]
                       for column in (bucket.offsets, bucket.block_offsets, bucket.row_lengths))
    _cpp_call(kernel, params, [g for _, g in items], bucket.flat, *layout, [], bucket.format, hp,
              hp.coefficients(step), grad_scale, step)


def _cpp_call(kernel, params: List[Tensor], grads: List[Tensor], flat: Dict[str, Tensor], offsets: List[int],
              block_offsets: List[int], row_lengths: List[int], positions: List[int], fmt: StateFormat,
              hp: Hyperparameters, coefficients: tuple, grad_scale: Optional[Tensor], step: int) -> None:
    """The C++ kernel's ``adam_step`` over ``params`` whose state lies in the 1-D buffers ``flat`` at
    ``offsets`` (per element) and ``block_offsets`` (per block), in rows of ``row_lengths`` elements
    (:attr:`halfadam.buckets.Bucket.row_lengths`); ``positions``: their first elements' positions in
    their whole parameters, empty for 0."""
    if grad_scale is not None:
        grad_scale = grad_scale.to(device="cpu", dtype=torch.float32).reshape(())
    kernel.adam_step(params, grads, _slots(flat, fmt), offsets, block_offsets, row_lengths, coefficients, grad_scale,
                     *hp.flags, step, positions, hp.rule.kernel)


#: The rules (:attr:`halfadam.functional.Rule.kernel`) each hand-written kernel runs.
KERNEL_RULES = {"cpp": (0, 1, 2), "triton": (0, 1, 2)}


def _slots(stored: Dict[str, Tensor], fmt: StateFormat) -> Dict[str, Tensor]:
    """``stored`` with the rule's moments under the kernels' slot names: the signed moment as ``exp_avg``,
    the square one as ``exp_avg_sq``, each with its per-block scale (SGD's ``momentum_buffer`` is renamed;
    Adam's and Lion's keys are the slots already)."""
    moved = [(key, kind) for key, kind in fmt.moments if key != encodings.slot(kind)]
    if not moved:
        return stored
    out = dict(stored)
    for key, kind in moved:
        out[encodings.slot(kind)] = out.pop(key)
        scale = encodings.scale_key(key, fmt.codes, kind)
        if scale in out:
            out[encodings.scale_key(encodings.slot(kind), fmt.codes, kind)] = out.pop(scale)
    return out


def _triton_rule(fmt: StateFormat, hp: Hyperparameters) -> dict:
    """The Triton launch's rule arguments: the rule id and flags, and each slot's moment dtype (``None``: absent)."""
    kinds = {kind for _, kind in fmt.moments}
    l2, second = hp.flags
    return dict(rule=hp.rule.kernel, l2=l2, optimized_update=second and hp.rule.kernel == 0,
                nesterov=second and hp.rule.kernel == 1,
                exp_avg=fmt.exp_avg if encodings.SIGNED in kinds else None,
                exp_avg_sq=fmt.exp_avg_sq if encodings.SQUARE in kinds else None)


#: Parameters of at least this many elements (contiguous, with a contiguous gradient) get their own
#: kernel call reading the gradient and writing the parameter directly; smaller ones are packed.
DIRECT_MIN_NUMEL = 1 << 16


def _segments(bucket: Bucket, items: List[Tuple[int, Tensor]]):
    """Split ``items`` into ``(i, j, kind)`` runs of consecutive parameters ``i:j``: ``"packed"``, or one
    parameter, ``"direct"`` (a large one) or ``"tails"`` (:meth:`halfadam.buckets.Bucket.has_tails`)."""
    segments, start, end = [], None, None
    for k, g in items:
        if start is not None and k != end:  # a gap (a parameter without a gradient) ends the run
            segments.append((start, end, "packed"))
            start = None
        p = bucket.params[k]
        kind = "tails" if bucket.has_tails(k) else "direct" if (
            bucket.numels[k] >= DIRECT_MIN_NUMEL and bucket.numels[k] == bucket.sizes[k] and p.is_contiguous()
            and g.is_contiguous()) else None
        if kind is not None:
            if start is not None:
                segments.append((start, k, "packed"))
            segments.append((k, k + 1, kind))
            start = None
            continue
        if start is None:
            start = k
        end = k + 1
    if start is not None:
        segments.append((start, end, "packed"))
    return segments
