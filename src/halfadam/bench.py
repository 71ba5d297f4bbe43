"""``halfadam bench``: one optimizer step's time for every halfadam implementation against torch.

For each case (parameters split into equal tensors) and each parameter dtype (float16, bfloat16,
float32) it times ``halfadam.AdamW(implementation=...)`` for ``reference``, ``foreach``, ``fused`` and
``cpp`` (the C++ CPU kernel, where it applies), and ``torch.optim.AdamW`` on float32 parameters with
``foreach=False`` (for-loop), ``foreach=True`` and ``fused=True``, all in the same run.
Configurations are timed round-robin (one step each per round, after warm-up rounds that include the
first-step compilation) and the median per configuration is reported, so load from other processes
affects every column alike.

Figures: ms per step; ns per parameter; GB/s at the nominal 28 bytes per parameter that a
mixed-precision or fp32 AdamW step must move (read grad, read+write weight, moments; see the README);
the ratio to ``torch.optim.AdamW(fused=True)`` on fp32; and the optimizer's memory (state plus its
flat scratch buffers, distinct storages counted once). The JSON rows also give the bytes the configuration
moves per element (``bytes_moved_per_param``, :func:`bytes_moved`): counted from its own tensors after its
timed steps, the gradient read, the parameter read and written (halfadam's master-sync rule reads it; without
a master it is the weight), and every state tensor read and written (a master or its remainder, moments,
Kahan compensation, 8-bit codes, their per-block scales and tie bytes and per-tensor code tables, by their
element sizes); left out are the 0-d step counters (per tensor, not per element) and halfadam's flat scratch
buffers. That is one pass over memory, what the C++ kernel and DeepSpeed's CPU Adam make; a step of
several passes (torch's for-loop and foreach AdamW, halfadam's reference and foreach) or one that gathers
parameters under 65,536 elements into scratch buffers (halfadam's foreach and fused) moves more, so for
those it is a lower bound.

``--per-core`` (CPU only) times every configuration at 1 thread and prints per configuration its
nanoseconds per element per core, its bytes moved per element and their ratio, the crossover: the memory
bandwidth per core (GB/s, bytes per ns) below which the step is memory-bound on a host, however it compares
at 1 thread. ``--host-cores N --host-bandwidth GBS`` add each configuration's predicted step time for
``--model-params`` parameters (default 7e9) on that host, :func:`predict_step_seconds`, a roofline:
``max(numel * ns_per_element / cores, numel * bytes_per_element / bandwidth)``; ``--host-bandwidth here``
measures this machine's (:func:`measure_bandwidth` at N threads), for checking a prediction against a
step timed here at ``--threads N``.

``--peers`` adds a row per peer of :mod:`halfadam.cli.peers` whose package is installed (optimi with
Kahan summation, torchao's bf16 stochastic-rounding and 8-bit AdamW, bitsandbytes' 8-bit AdamW,
DeepSpeed's CPU Adam), timed in the same rounds on tensors of the same sizes and seed, bfloat16
parameters and gradients (float32 for DeepSpeed's CPU Adam, which steps ZeRO-Offload's float32 master
copy; bfloat16 for its bf16-state configuration, ``fp32_optimizer_states=False``); a peer that is
missing or fails one step is skipped with one line on stderr.

A configuration that raises while it is built or timed (a damaged compile cache, an unsupported
kernel) becomes a row marked ``failed: <ExceptionType>: <first line>`` (in JSON: a row with a
``failed`` entry and no timings); the other configurations are still timed, and the command then ends
with one line on stderr and exit status 1. Bad options end with one line and exit status 2, before
anything is timed.

Use ``python -m halfadam.bench`` or ``python benchmarks/bench_step.py``. The module follows the
``halfadam.cli`` command protocol (``HELP``, ``add_arguments(parser)``, ``run(args) -> int``), so
``halfadam bench`` is the entry ``"bench": "halfadam.bench"`` in ``halfadam.cli.COMMANDS``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from halfadam.cli.args import nonnegative_int, positive_float, positive_int, resolve_device
from halfadam.cli.errors import CLIError
from halfadam.cli.modes import DTYPE_ALIASES, STATE_MODES
from halfadam.cli.peers import PEERS, select as select_peers, tensor_parts

if TYPE_CHECKING:
    import torch

#: One-line summary (the ``halfadam.cli`` command protocol).
HELP = "time one optimizer step of each halfadam implementation against torch.optim.AdamW"

BYTES_PER_PARAM = 28
IMPLS = ("reference", "foreach", "fused", "cpp", "triton", "auto")
#: ``--dtypes`` names -> torch's (``--dtypes`` also takes torch's names: float16, bfloat16, float32).
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
#: Elements per quantization block (:data:`halfadam.encodings.BLOCK`; tests/test_bench.py checks), without torch.
BLOCK = 128
#: What a run without options times (5 s and 0.9 GB on 2 cores, 2026-12-06): every state mode in the
#: implementation a user gets (``auto``) on one 4M-parameter case of bfloat16 parameters, against torch's AdamW.
#: (``foreach`` is left out: in the 8-bit modes its eager step takes half a second at this size.)
QUICK = dict(sizes=[4_000_000], tensors=16, small=False, dtypes=["bf16"], impls=["auto"],
             state_modes=list(STATE_MODES), warmup=2, repeat=7)
#: ``--full``: the sweep that was the default until 2026-12 (about 4 min and 9 GB on 2 cores).
FULL = dict(sizes=[1_000_000, 20_000_000], tensors=50, small=True, dtypes=list(DTYPES), impls=list(IMPLS[:5]),
            state_modes=["fp32", "compact"], warmup=2, repeat=7)
#: 2,000 tensors of 10 elements: next to no arithmetic, so its time is the per-step overhead (Python,
#: validation, kernel entry); printed after the tables as microseconds per step and per tensor.
OVERHEAD_CASE = "overhead 20000/2000"
TORCH_VARIANTS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def gpt_shapes(layers: int = 24, width: int = 2048, vocab: int = 50257, context: int = 2048) -> List[tuple]:
    """The parameter shapes of a GPT-2-style model, by default the 1.3B-parameter one (GPT-3 XL's
    sizes: 24 layers of width 2048, 50,257 tokens, 2,048 positions): 292 tensors, 1.316B elements."""
    shapes = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return shapes + [(width,), (width,)]


def matrix_shapes(numel: int, tensors: int) -> List[tuple]:
    """``numel`` parameters as ``tensors`` equal matrices whose rows are whole BLOCKs, so that every state
    mode stores its per-block encodings (a real model's matrices do; 1-D tensors keep float32 fields):
    rows of 1,024 elements where each tensor's share divides into them, else of BLOCK elements, the
    share rounded to whole rows. Shares below BLOCK stay 1-D (the overhead case's 10-element tensors)."""
    per = numel // tensors
    if per < BLOCK:
        return [(per,)] * (tensors - 1) + [(numel - per * (tensors - 1),)]
    width = 1024 if per % 1024 == 0 else BLOCK
    return [(max(1, round(per / width)), width)] * tensors


def _case(name: str, shapes: List[tuple], asked: Optional[int] = None, **kw: Any) -> Dict[str, Any]:
    numel = sum(math.prod(s) for s in shapes)
    return dict(name=name, numel=numel, tensors=len(shapes), shapes=shapes, asked=asked or numel, **kw)


def _cases(args) -> List[Dict[str, Any]]:
    sized = [(f"{_fmt(size)}/{args.tensors}", size, args.tensors) for size in args.sizes]
    if args.large:
        sized.append((f"100M/{args.tensors}", 100_000_000, args.tensors))
    cases = [_case(name, matrix_shapes(numel, tensors), numel) for name, numel, tensors in sized]
    if getattr(args, "gpt", False):
        cases.append(_case(f"gpt-1.3B/{len(gpt_shapes())}", gpt_shapes(), on_device=True))
    if args.small:
        cases += [_case(name, matrix_shapes(numel, tensors), numel)
                  for name, numel, tensors in (("many-small 2M/2000", 2_000_000, 2000), (OVERHEAD_CASE, 20_000, 2000))]
    return cases


def _describe_case(case: Dict[str, Any]) -> Optional[str]:
    """A line for a case whose tensors are not what its name says: a count rounded to whole rows, or
    1-D tensors (which keep float32 fields in every per-block state mode)."""
    shape = case["shapes"][0]
    if len(shape) == 1:
        return (f"{case['name']}: {case['tensors']} 1-D tensors of {shape[0]} elements, fewer than a block: the "
                f"split, bf16, compact and tiny modes keep float32 fields for them (12 B/param)")
    if case["asked"] != case["numel"]:
        return (f"{case['name']}: {case['numel']:,} parameters ({case['asked']:,} asked), {case['tensors']} "
                f"matrices of {shape[0]} rows of {shape[1]} elements (rows of whole {BLOCK}-element blocks)")
    return None


def _fmt(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else str(n)


def _make_params(case: Dict[str, Any], dtype: torch.dtype, device: str, seed: int) -> List[torch.Tensor]:
    """The case's parameters (``case["shapes"]``: :func:`matrix_shapes`, or a model's) with gradients;
    values drawn on the CPU, or on the device for a model's (a 1.3B GPT)."""
    import torch

    on = dict(device=device) if case.get("on_device") else {}
    g = torch.Generator(**on).manual_seed(seed)
    params = []
    for shape in case["shapes"]:
        p = (torch.randn(shape, generator=g, **on) * 0.02).to(device=device, dtype=dtype).requires_grad_()
        p.grad = (torch.randn(shape, generator=g, **on) * 1e-3).to(device=device, dtype=dtype)
        params.append(p)
    return params


def _memory_bytes(opt: torch.optim.Optimizer, scratch: bool = True, counters: bool = True) -> int:
    """Bytes of the optimizer's state (0-d step counters included, unless not ``counters``) and, with
    ``scratch``, of its flat scratch buffers; a storage shared by several tensors counts once."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        for part in tensor_parts(t):  # a tensor subclass (torchao's 8-bit state), FlashOptim's state: what it holds
            s = part.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()

    for st in opt.state.values():
        for v in st.values():
            if counters or getattr(v, "ndim", None) != 0:
                add(v)
    for layout in getattr(opt, "_layouts", {}).values() if scratch else ():
        for b in layout.buckets:
            for buf in b.scratch_buffers():
                add(buf)
    return total


def bytes_moved(opt: torch.optim.Optimizer) -> float:
    """Bytes one step of ``opt`` moves per parameter element, from its tensors (the module's docstring says what
    is counted): each gradient read once, each parameter read and written, each state storage (distinct storages
    once, 0-d step counters and scratch buffers aside) read and written; over the parameters' elements.
    Its state must exist (after a step).

    Raises:
        ValueError: ``opt`` has no parameter elements.
    """
    params = [p for group in opt.param_groups for p in group["params"]]
    numel = sum(p.numel() for p in params)
    if numel == 0:
        raise ValueError("bytes_moved: the optimizer has no parameter elements")
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    weights = sum(p.numel() * p.element_size() for p in params)
    return (grads + 2 * weights + 2 * _memory_bytes(opt, scratch=False, counters=False)) / numel


def predict_step_seconds(numel: float, ns_per_element: float, bytes_per_element: float, cores: int,
                         bandwidth_gbs: float) -> float:
    """The predicted seconds of one step over ``numel`` elements on a host of ``cores`` cores and
    ``bandwidth_gbs`` GB/s of memory bandwidth (all cores together), a roofline: the compute time
    ``numel * ns_per_element / cores`` (``ns_per_element``: one core's, measured at 1 thread) or the memory
    time ``numel * bytes_per_element / bandwidth``, whichever is longer. The step is memory-bound where
    ``bandwidth_gbs / cores`` (a core's share) is below ``bytes_per_element / ns_per_element`` (bytes per ns
    are GB/s), the crossover ``--per-core`` prints.

    Raises:
        ValueError: ``numel``, ``ns_per_element`` or ``bytes_per_element`` not a finite number >= 0, ``cores``
            not an integer >= 1, or ``bandwidth_gbs`` not a finite number > 0 (the message names it).
    """
    def number(value, types=(int, float)):
        return isinstance(value, types) and not isinstance(value, bool) and math.isfinite(value)

    for name, value in (("numel", numel), ("ns_per_element", ns_per_element), ("bytes_per_element", bytes_per_element)):
        if not number(value) or value < 0:
            raise ValueError(f"predict_step_seconds: {name} must be a finite number >= 0, got {value!r}")
    if not number(cores, int) or cores < 1:
        raise ValueError(f"predict_step_seconds: cores must be an integer >= 1, got {cores!r}")
    if not number(bandwidth_gbs) or bandwidth_gbs <= 0:
        raise ValueError(f"predict_step_seconds: bandwidth_gbs must be a finite number > 0, got {bandwidth_gbs!r}")
    return max(numel * ns_per_element / cores * 1e-9, numel * bytes_per_element / (bandwidth_gbs * 1e9))


def measure_bandwidth(threads: int, numel: int = 1 << 27, repeat: int = 5) -> float:
    """This machine's memory bandwidth in GB/s at ``threads`` threads, as an optimizer step uses it:
    ``a.add_(b)`` over two float32 tensors of ``numel`` elements (2 x 512 MiB by default, beyond the
    caches: the 2-core machine of the docs reports a 480 MiB L3), 8 bytes read and 4 written per element
    (every line written was read, as in a step: no uncounted write-allocate traffic); the fastest of
    ``repeat`` calls after an untimed one (STREAM's convention: the figure least disturbed by other load on
    a shared machine). torch's thread count is restored.

    Raises:
        ValueError: ``threads``, ``numel`` or ``repeat`` below 1.
    """
    import torch

    for name, value in (("threads", threads), ("numel", numel), ("repeat", repeat)):
        if value < 1:
            raise ValueError(f"measure_bandwidth: {name} must be at least 1, got {value!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.ones(numel), torch.ones(numel)
        a.add_(b)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            a.add_(b)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 12 * numel / min(times) / 1e9


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


#: Seconds until ``step()`` returned, by optimizer id, for the last measure() (on a GPU: the host's part).
_host_seconds: Dict[int, List[float]] = {}


def _time_step(opt: torch.optim.Optimizer, device: str) -> float:
    """Seconds one ``opt.step()`` takes on ``device`` (synchronised before and after): one configuration timed
    once; the seconds until ``step()`` returned are appended to ``_host_seconds[id(opt)]``."""
    _sync(device)
    t0 = time.perf_counter()
    opt.step()
    _host_seconds.setdefault(id(opt), []).append(time.perf_counter() - t0)
    _sync(device)
    return time.perf_counter() - t0


def _failure(exc: BaseException) -> str:
    """``<ExceptionType>: <first line of its message>``, what a failed row shows."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def measure(args) -> List[Dict[str, Any]]:
    """Time every configuration; returns one dict per (case, implementation, dtype).

    A configuration whose optimizer cannot be built or whose step raises gives a row with ``failed``
    (:func:`_failure`) and no timings; it is not stepped again, and the others go on.
    """
    peers = [PEERS[name] for name in getattr(args, "peer_names", [])]
    on_cpu = args.device == "cpu"
    _host_seconds.clear()
    for impl, why in (("cpp", "the C++ kernel runs CPU tensors only"),
                      ("triton", "the Triton kernel is timed on CUDA only (the test suite runs it on the CPU "
                                 "under TRITON_INTERPRET=1, far too slow to time)")):
        if impl in args.impls and on_cpu != (impl == "cpp"):
            print(f"halfadam bench: {impl} skipped on {args.device}: {why}", file=sys.stderr)
    if "auto" in args.impls:
        runs = "cpp where the C++ kernel builds, else fused" if on_cpu else "triton where triton imports, else fused"
        print(f"halfadam bench: auto is implementation='auto': on {args.device}, {runs}", file=sys.stderr)
    if not args.json:
        print(_legend(args) + "\n", flush=True)
    rows = []
    for case in _cases(args):
        note = _describe_case(case)
        if note is not None:
            print(f"halfadam bench: {note}", file=sys.stderr)
        configs = _configs(case, args, peers)
        times, first = _time_configs(configs, args)
        case_rows, torch_fused = _case_rows(case, configs, times, first, args)
        rows += case_rows
        _add_ratios([r for r in rows if r["case"] == case["name"] and "failed" not in r], torch_fused)
        _add_per_core([r for r in rows if r["case"] == case["name"] and "failed" not in r], args)
        del configs
        gc.collect()
        if not args.json:
            columns = _PER_CORE_COLUMNS if getattr(args, "per_core", False) else _COLUMNS
            print(_table([r for r in rows if r["case"] == case["name"]], columns), flush=True)
            if case["name"] == OVERHEAD_CASE:
                print(_overhead([r for r in rows if r["case"] == case["name"]]), flush=True)
    return rows


def _configs(case: Dict[str, Any], args, peers: list) -> List[list]:
    """The case's configurations, each ``[label dict, optimizer or None, failure or None]``: torch's AdamW
    variants, halfadam's per dtype, implementation and state mode, and the ``peers``; a configuration whose
    parameters or optimizer cannot be built is there with its failure (:func:`_failure`)."""
    import torch

    import halfadam

    on_cpu = args.device == "cpu"
    configs: List[list] = []  # [label dict, optimizer or None, failure or None]

    def add(label, dtype, build):
        try:
            configs.append([label, build(_make_params(case, dtype, args.device, 0)), None])
        except Exception as exc:
            configs.append([label, None, _failure(exc)])

    for variant, kw in TORCH_VARIANTS.items():
        add(dict(impl=f"torch {variant}", dtype="fp32"), torch.float32,
            lambda params, kw=kw: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kw))
    if "bf16" in args.dtypes:  # torch's fused step on bf16 parameters: bf16 state, no master (lossy, 14 B moved)
        add(dict(impl="torch fused", dtype="bf16"), torch.bfloat16,
            lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True))
    for dname in args.dtypes:
        for impl in args.impls:
            for mode in args.state_modes:
                if impl in ("cpp", "triton") and on_cpu != (impl == "cpp"):
                    continue  # said once, in measure()
                add(dict(impl=f"halfadam {impl}", dtype=dname, state=mode), getattr(torch, DTYPES[dname]),
                    lambda params, impl=impl, mode=mode: halfadam.AdamW(
                        params, lr=1e-3, weight_decay=0.01, implementation=impl, state_mode=mode))
    for peer in peers:
        dname = next(k for k, v in DTYPES.items() if v == peer.dtype)
        add(dict(impl=peer.label, dtype=dname), peer.param_dtype,
            lambda params, peer=peer: peer.build(params, lr=1e-3, weight_decay=0.01))
    return configs


def _time_configs(configs: List[list], args) -> Tuple[Dict[int, List[float]], Dict[int, float]]:
    """Step the configurations round-robin, ``args.warmup`` untimed rounds and then ``args.repeat`` timed
    ones; returns the timed seconds and the first step's, by configuration index. A configuration whose
    step raises gets its failure (its optimizer dropped) and is not stepped again."""
    times: Dict[int, List[float]] = {i: [] for i in range(len(configs))}
    first: Dict[int, float] = {}
    for r in range(args.warmup + args.repeat):
        for i, config in enumerate(configs):
            if config[2] is not None:
                continue
            try:
                dt = _time_step(config[1], args.device)
            except Exception as exc:
                config[1:] = [None, _failure(exc)]  # its tensors go; the other configurations carry on
                continue
            if r == 0:
                first[i] = dt
            if r >= args.warmup:
                times[i].append(dt)
    return times, first


def _case_rows(case: Dict[str, Any], configs: List[list], times: Dict[int, List[float]], first: Dict[int, float],
               args) -> Tuple[List[Dict[str, Any]], Optional[float]]:
    """One row per configuration of ``case`` (its median step time and what follows from it, or its failure),
    and the median seconds of ``torch.optim.AdamW(fused=True)`` on fp32 (``None`` if it failed)."""
    import torch

    rows, torch_fused = [], None
    for i, (label, opt, failed) in enumerate(configs):
        row = dict(case=case["name"], numel=case["numel"], tensors=case["tensors"], device=args.device,
                   threads=torch.get_num_threads(), **label)
        if failed is not None:
            rows.append(dict(row, failed=failed))
            continue
        t = statistics.median(times[i])
        if label["impl"] == "torch fused" and label["dtype"] == "fp32":
            torch_fused = t
        rows.append(dict(row, ms=t * 1e3, ns_per_param=t / case["numel"] * 1e9,
                         gb_per_s=BYTES_PER_PARAM * case["numel"] / t / 1e9,
                         first_step_s=first[i], memory_mb=_memory_bytes(opt) / 2**20,
                         host_us=statistics.median(_host_seconds.pop(id(opt))[args.warmup:]) * 1e6,
                         state_bytes_per_param=_memory_bytes(opt, scratch=False) / case["numel"],
                         bytes_moved_per_param=bytes_moved(opt)))
    return rows, torch_fused


def _add_ratios(here: List[Dict[str, Any]], torch_fused: Optional[float]) -> None:
    """Add to the timed rows of a case their ratios: to torch's fused fp32 step (``torch_fused`` seconds), and
    for halfadam's, the reference implementation's time over theirs and their time over the fp32 state's."""
    for row in here:
        row["vs_torch_fused"] = row["ms"] / 1e3 / torch_fused if torch_fused else None
    ref = {(r["dtype"], r["state"]): r["ms"] for r in here if r["impl"] == "halfadam reference"}
    fp32_state = {(r["dtype"], r["impl"]): r["ms"] for r in here if r.get("state") == "fp32"}
    for row in here:
        key = (row["dtype"], row.get("state"))
        if key in ref and row["impl"].startswith("halfadam"):
            row["speedup_vs_reference"] = ref[key] / row["ms"]
        if (row["dtype"], row["impl"]) in fp32_state and row["impl"].startswith("halfadam"):
            row["vs_fp32_state"] = row["ms"] / fp32_state[(row["dtype"], row["impl"])]


def _add_per_core(here: List[Dict[str, Any]], args) -> None:
    """Under ``--per-core`` (1 thread), add to the timed rows of a case ns per element per core and the crossover
    bandwidth per core; with ``--host-cores``, the predicted step on that host (:func:`predict_step_seconds`) and
    which term bounds it."""
    if not getattr(args, "per_core", False):
        return
    for row in here:
        ns, moved = row["ns_per_param"] * row["threads"], row["bytes_moved_per_param"]
        row.update(ns_per_param_core=ns, crossover_gb_per_s_core=moved / ns)
        if args.host_cores is not None:
            cores, bandwidth = args.host_cores, args.host_bandwidth
            row.update(model_params=args.model_params, host_cores=cores, host_bandwidth_gbs=bandwidth,
                       predicted_s=predict_step_seconds(args.model_params, ns, moved, cores, bandwidth),
                       bound="memory" if moved * cores / bandwidth > ns else "compute")


def _overhead(rows: List[Dict[str, Any]]) -> str:
    """One line per configuration of the overhead case: its step time as per-step and per-tensor overhead."""
    lines = ["per-step overhead (a step over 2,000 tensors of 10 elements: Python, validation, kernel entry):"]
    for r in rows:
        state = f" ({r['state']} state)" if r.get("state") else ""
        if "failed" in r:
            lines.append(f"  {r['impl']} {r['dtype']}{state}: failed: {r['failed']}")
            continue
        vs = "" if r["vs_torch_fused"] is None else f", {r['vs_torch_fused']:.2f}x torch fused"
        host = f", host {r['host_us']:.0f} us/step" if r["device"] != "cpu" else ""
        lines.append(f"  {r['impl']} {r['dtype']}{state}: {r['ms'] * 1e3:.0f} us/step, "
                     f"{r['ms'] * 1e3 / r['tensors']:.2f} us/tensor{vs}{host}")
    return "\n".join(lines) + "\n"


def _fixed(value: Optional[float], digits: int = 2) -> str:
    """``value`` with ``digits`` decimals below 100, none from 100 on (short columns); ``""`` for ``None``."""
    if value is None:
        return ""
    return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:.0f}"


#: The figures' columns of a table: header and the row's figure as text ("" where it has none).
_COLUMNS = [
    ("ms/step", lambda r: _fixed(r["ms"])),
    ("GB/s", lambda r: f"{r['gb_per_s']:.1f}"),
    ("x fused", lambda r: _fixed(r.get("vs_torch_fused"))),
    ("x ref", lambda r: _fixed(r.get("speedup_vs_reference"), 1)),
    ("x fp32", lambda r: _fixed(r.get("vs_fp32_state"))),
    ("B/param", lambda r: f"{r['state_bytes_per_param']:.2f}"),
    ("1st s", lambda r: _fixed(r["first_step_s"])),
    ("opt MB", lambda r: f"{r['memory_mb']:.0f}"),
]

#: The columns, one line each, printed once before the first table (each line under 100 characters).
LEGEND = """\
ms/step: median step time; GB/s: at the 28 bytes per parameter an AdamW step moves
x fused: time over torch.optim.AdamW(fused=True) on fp32 parameters (lower is faster)
x ref: halfadam reference's time over this row's (same dtype and state)
x fp32: this row's time over the fp32 state's (same implementation and dtype)
B/param: state bytes per parameter; 1st s: the first step (allocation, compilation)
opt MB: the optimizer's state and scratch buffers"""

#: ``--per-core``'s columns: the figures of a step at 1 thread that predict it on a host.
_PER_CORE_COLUMNS = [
    ("ms/step", lambda r: _fixed(r["ms"])),
    ("ns/el", lambda r: _fixed(r["ns_per_param_core"])),
    ("B/el", lambda r: _fixed(r["bytes_moved_per_param"])),
    ("GB/s/core", lambda r: _fixed(r["crossover_gb_per_s_core"])),
    ("pred ms", lambda r: _fixed(r["predicted_s"] * 1e3 if "predicted_s" in r else None)),
    ("bound", lambda r: r.get("bound", "")),
]

#: ``--per-core``'s legend (and :func:`_legend`'s lines for a host).
PER_CORE_LEGEND = """\
ms/step: median step time at 1 thread; ns/el: nanoseconds per element per core (ms/step / elements)
B/el: bytes a step moves per element: the gradient read, the parameter and state read and written
GB/s/core: B/el / ns/el, the memory bandwidth per core below which this step is memory-bound"""


def _legend(args) -> str:
    """The legend printed before the first table: :data:`LEGEND`, or :data:`PER_CORE_LEGEND` under ``--per-core``
    with the predicted step's host."""
    if not getattr(args, "per_core", False):
        return LEGEND
    if args.host_cores is None:
        return PER_CORE_LEGEND
    return (f"{PER_CORE_LEGEND}\npred ms: a step of {args.model_params:,} parameters on {args.host_cores} cores at "
            f"{args.host_bandwidth:.1f} GB/s,\n  max(elements x ns/el / cores, elements x B/el / bandwidth); "
            f"bound: the larger term")

#: The widest a table's line may be (a failed row's message is cut to fit).
WIDTH = 100


def _case_heading(rows: List[Dict[str, Any]]) -> str:
    """The line above a case's table: its name, parameters, tensors, device and threads."""
    r = rows[0]
    return (f"{r['case']}: {r['numel']:,} parameters in {r['tensors']:,} tensors, {r['device']}, "
            f"{r['threads']} thread{'s' * (r['threads'] != 1)}")


def _table(rows: List[Dict[str, Any]], columns: Optional[list] = None) -> str:
    """The rows of one case as a text table under its heading, at most :data:`WIDTH` characters wide, in
    ``columns`` (default :data:`_COLUMNS`); a column no row has a figure for is left out, and a failed row
    shows ``failed: ...`` after its labels."""
    timed = [r for r in rows if "failed" not in r]
    columns = [(head, figure) for head, figure in columns or _COLUMNS if any(figure(r) for r in timed)]
    head = ["implementation", "dtype", "state"] + [h for h, _ in columns]
    lines = [head]
    for r in rows:
        labels = [r["impl"], r["dtype"], r.get("state", "-")]
        lines.append(labels + ([f"failed: {r['failed']}"] if "failed" in r else [f(r) for _, f in columns]))
    widths = [max(len(line[i]) for line in lines if len(line) == len(head) or i < 3) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text = [line if len(line) <= WIDTH else line[: WIDTH - 3] + "..." for line in text]
    return "\n".join([_case_heading(rows), *text]) + "\n"


#: ``--sizes`` suffixes: ``1k``, ``1.5M``, ``1G`` (or ``1B``, a billion).
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}


def _size(part: str) -> float:
    """One ``--sizes`` count: an integer, a number Python reads (``1e6``) or one with a suffix of
    :data:`_SUFFIXES` (``1M``, ``1.5M``, ``20k``); NaN when it is none of these."""
    part = part.strip().replace("_", "")
    scale = _SUFFIXES.get(part[-1:].lower()) if part[:-1] else None
    try:
        return int(part) if scale is None and part.isdigit() else float(part[:-1] if scale else part) * (scale or 1)
    except ValueError:
        return math.nan


def _sizes(text: str) -> List[int]:
    """``--sizes``: comma-separated positive integer parameter counts: ``1000000``, ``1e6``, ``1M``, ``1.5M``,
    ``20k``."""
    sizes = []
    for part in text.split(","):
        value = _size(part)
        if not (math.isfinite(value) and value >= 1 and value == round(value)):
            where = f" in {text!r}" if "," in text else ""
            raise argparse.ArgumentTypeError(f"expected positive integer parameter counts like 1M,20M or 1e6,2e7, got "
                                             f"{part.strip()!r}{where}")
        sizes.append(int(round(value)))
    return sizes


def _count(text: str) -> int:
    """``--model-params``: one positive integer parameter count, as :func:`_size` reads it (``7B``, ``7e9``,
    ``20M``)."""
    value = _size(text)
    if not (math.isfinite(value) and value >= 1 and value == round(value)):
        raise argparse.ArgumentTypeError(f"expected a positive integer parameter count like 7B, 7e9 or 20M, got "
                                         f"{text.strip()!r}")
    return int(round(value))


def _bandwidth(text: str):
    """``--host-bandwidth``: a finite number of GB/s > 0, or ``here`` (measured, :func:`measure_bandwidth`)."""
    if text.strip().lower() == "here":
        return "here"
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive number of GB/s or 'here', got {text!r}") from None


def _names(text: str) -> List[str]:
    """A comma-separated list (``--impls``, ``--state-modes``; :func:`run` checks each name)."""
    return [name.strip() for name in text.split(",")]


def _dtype_names(text: str) -> List[str]:
    """``--dtypes``: :func:`_names`, torch's names (float16, bfloat16, float32) as the short ones."""
    return [DTYPE_ALIASES.get(name.lower(), name.lower()) for name in _names(text)]


def _default(key: str) -> str:
    """``(default X; --full: Y)`` for an option of :data:`QUICK` and :data:`FULL`."""
    def show(value):
        return ",".join(_fmt(v) if isinstance(v, int) else str(v) for v in value) if isinstance(value, list) else value
    return f"(default {show(QUICK[key])}; --full: {show(FULL[key])})"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``halfadam bench``'s options on ``parser`` (returned)."""
    parser.description = (
        f"{HELP}. Without options (5 s, up to 50 s when the cores are busy, and 0.9 GB on 2 cores): every "
        f"state mode ({','.join(STATE_MODES)}) in the implementation halfadam picks (auto) on one 4M-parameter case in "
        f"bfloat16, against torch's AdamW; --full for the full sweep. Options given replace the defaults, also "
        f"under --full.")
    parser.add_argument("--full", action="store_true",
                        help="the full sweep: 1M and 20M parameters in 50 tensors, the many-small and overhead cases, "
                             "every dtype and implementation, state modes fp32,compact (about 4 min and 9 GB on 2 "
                             "cores)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    parser.add_argument("--sizes", type=_sizes,
                        help=f"comma-separated parameter counts such as 1M,20M, 1.5M, 20k or 1e6, each split into "
                             f"--tensors tensors {_default('sizes')}")
    parser.add_argument("--tensors", type=positive_int, help=f"tensors per size case {_default('tensors')}")
    parser.add_argument("--large", action="store_true", help="also 100M parameters (needs ~10 GB)")
    parser.add_argument("--gpt", action="store_true",
                        help="also the parameter list of a 1.3B-parameter GPT (292 tensors of its real shapes; "
                             "about 20 GB per configuration: choose few --impls/--state-modes)")
    parser.add_argument("--no-small", action="store_true",
                        help="with --full, skip its many-small-tensors case (2000 tensors, 2M) and its overhead case "
                             "(2000 tensors of 10 elements)")
    parser.add_argument("--dtypes", type=_dtype_names,
                        help=f"fp16,bf16,fp32 (or float16,bfloat16,float32) {_default('dtypes')}")
    parser.add_argument("--impls", type=_names,
                        help=f"{','.join(IMPLS)} {_default('impls')}. reference: one update per tensor; foreach: "
                             "eager ops over flat buffers; fused: torch.compile (Inductor C++ on CPU, Triton on CUDA); "
                             "cpp: the hand-written C++ CPU kernel (CPU only, every state mode; skipped elsewhere); "
                             "triton: the hand-written Triton kernel, one launch per bucket (CUDA only here; the test "
                             "suite runs it on the CPU under TRITON_INTERPRET=1); auto: what implementation='auto' "
                             "runs, cpp on the CPU where it builds (the first run on a machine compiles it, a minute "
                             "or two, once), triton on CUDA where triton imports, else fused")
    parser.add_argument("--state-modes", type=lambda s: list(STATE_MODES) if s == "all" else _names(s),
                        help=f"halfadam state modes to time (state_mode=...): {','.join(STATE_MODES)} or all "
                             f"{_default('state_modes')}; 'x fp32' is each row's time over the fp32-state one")
    parser.add_argument("--warmup", type=nonnegative_int,
                        help=f"untimed rounds; the first compiles {_default('warmup')}")
    parser.add_argument("--repeat", type=positive_int,
                        help=f"timed rounds; the median is reported {_default('repeat')}")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch.set_num_threads for the run (default: torch's default, all cores)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of tables")
    parser.add_argument("--peers", action="store_true",
                        help="also time the optimizers a user would pick instead of halfadam, each only if its "
                             "package is installed: " + ", ".join(f"{p.source} ({p.package})" for p in PEERS.values()))
    parser.add_argument("--per-core", action="store_true",
                        help="time every configuration at 1 thread (CPU only) and print per configuration: ns per "
                             "element per core, bytes moved per element (gradient read, parameter and state read and "
                             "written) and their ratio, the memory bandwidth per core (GB/s) below which the step "
                             "is memory-bound")
    parser.add_argument("--host-cores", type=positive_int,
                        help="with --host-bandwidth (implies --per-core): also print each configuration's predicted "
                             "step on a host of this many cores, max(elements x ns/el / cores, elements x B/el / "
                             "bandwidth)")
    parser.add_argument("--host-bandwidth", type=_bandwidth,
                        help="that host's memory bandwidth in GB/s, all cores together, or 'here': this machine's, "
                             "measured at --host-cores threads (a float32 add over 2 x 512 MiB)")
    parser.add_argument("--model-params", type=_count,
                        help="parameters of the predicted step, such as 7B, 7e9 or 20M (default 7B)")
    return parser


def _fill_defaults(args) -> None:
    """Set the options left out to :data:`QUICK`'s values, or :data:`FULL`'s under ``--full``."""
    chosen = FULL if getattr(args, "full", False) else QUICK
    for key, value in chosen.items():
        if key == "small":
            args.small = value and not getattr(args, "no_small", False)
        elif getattr(args, key, None) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)


def _check_per_core(args) -> None:
    """Check ``--per-core`` and the host options (CLIError for a combination that cannot run) and settle them:
    the host options imply ``--per-core``, which runs at 1 thread; ``--model-params`` defaults to 7B."""
    args.per_core = getattr(args, "per_core", False)
    for key in ("host_cores", "host_bandwidth", "model_params"):
        setattr(args, key, getattr(args, key, None))
    if (args.host_cores is None) != (args.host_bandwidth is None):
        raise CLIError("--host-cores and --host-bandwidth go together (a host's cores and its memory bandwidth in "
                       "GB/s, or 'here')")
    if args.model_params is not None and args.host_cores is None:
        raise CLIError("--model-params needs --host-cores and --host-bandwidth (the host of the predicted step)")
    args.per_core = args.per_core or args.host_cores is not None
    if not args.per_core:
        return
    option = "--per-core" if args.host_cores is None else "--host-cores (--per-core)"
    if args.device != "cpu":
        raise CLIError(f"{option} times CPU steps: --device must be cpu, got {args.device}")
    if args.threads not in (None, 1):
        raise CLIError(f"{option} times at 1 thread: leave out --threads (got --threads {args.threads})")
    args.threads = 1
    if args.model_params is None:
        args.model_params = 7_000_000_000


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``argparse`` subparsers object; the handler is ``args.func(args)``."""
    p = subparsers.add_parser("bench", help="time one optimizer step against torch.optim.AdamW",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Run the benchmark for parsed ``args`` (see :func:`add_arguments`); returns the exit status.

    0: every configuration was timed; 1: some failed (rows marked ``failed``, one line on stderr).
    Raises :class:`~halfadam.cli.CLIError` (one line, exit status 2 under :func:`halfadam.cli.main`)
    for options argparse cannot check, before anything is timed.
    """
    import torch

    _fill_defaults(args)
    args.device = str(resolve_device(args.device))
    for option, what, names, known in (("--dtypes", "dtype", args.dtypes, DTYPES),
                                       ("--impls", "implementation", args.impls, IMPLS),
                                       ("--state-modes", "state mode", args.state_modes, STATE_MODES)):
        for name in names:
            if name not in known:
                also = ", or all" if option == "--state-modes" else ""
                raise CLIError(f"{option}: unknown {what} {name!r} (choose from {', '.join(known)}{also})")
    for size in args.sizes:
        if size < args.tensors:
            raise CLIError(f"--sizes {size} is smaller than --tensors {args.tensors} (each tensor needs at least "
                           f"one parameter)")
    _check_per_core(args)
    if args.host_bandwidth == "here":
        args.host_bandwidth = measure_bandwidth(args.host_cores)
        print(f"halfadam bench: --host-bandwidth here: {args.host_bandwidth:.1f} GB/s measured at {args.host_cores} "
              f"thread{'s' * (args.host_cores != 1)}", file=sys.stderr)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.peer_names = []
    if getattr(args, "peers", False):
        log = lambda line: print(f"halfadam bench: {line}", file=sys.stderr)  # noqa: E731 - stdout may be JSON
        args.peer_names = select_peers([], add=True, bench=True, device=args.device, log=log)
    rows = measure(args)
    if args.json:
        print(json.dumps(rows, indent=1))
    failed = [r for r in rows if "failed" in r]
    if failed:
        print(f"halfadam bench: {len(failed)} of {len(rows)} configurations failed (the rows marked failed)",
              file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``halfadam bench`` as a standalone program: ``python -m halfadam.bench [options]``.

    The same as ``halfadam bench`` (:func:`halfadam.cli.main`): bad options print one line and return 2.
    """
    from halfadam.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
