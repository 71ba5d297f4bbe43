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
flat scratch buffers, distinct storages counted once).

``--peers`` adds a row per peer of :mod:`halfadam.cli.peers` whose package is installed (optimi with
Kahan summation, torchao's bf16 stochastic-rounding and 8-bit AdamW, bitsandbytes' 8-bit AdamW,
DeepSpeed's CPU Adam), timed in the same rounds on tensors of the same sizes and seed, bfloat16
parameters and gradients (float32 for DeepSpeed's CPU Adam, which steps ZeRO-Offload's float32 master
copy); a peer that is missing or fails one step is skipped with one line on stderr.

Use ``python -m halfadam.bench`` or ``python benchmarks/bench_step.py``. The module follows the
``halfadam.cli`` command protocol (``HELP``, ``add_arguments(parser)``, ``run(args) -> int``), so
``halfadam bench`` is the entry ``"bench": "halfadam.bench"`` in ``halfadam.cli.COMMANDS``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from halfadam.cli.peers import PEERS, select as select_peers, tensor_parts
from halfadam.cpu_kernel import supports
from halfadam.encodings import PRESETS

#: One-line summary (the ``halfadam.cli`` command protocol).
HELP = "time one optimizer step of each halfadam implementation against torch.optim.AdamW"

BYTES_PER_PARAM = 28
IMPLS = ("reference", "foreach", "fused", "cpp")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
STATE_MODES = tuple(PRESETS)
#: 2,000 tensors of 10 elements: next to no arithmetic, so its time is the per-step overhead (Python,
#: validation, kernel entry); printed after the tables as microseconds per step and per tensor.
OVERHEAD_CASE = "overhead 20000/2000"
TORCH_VARIANTS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def _cases(args) -> List[Dict[str, Any]]:
    cases = []
    for size in args.sizes:
        cases.append(dict(name=f"{_fmt(size)}/{args.tensors}", numel=size, tensors=args.tensors))
    if args.large:
        cases.append(dict(name=f"100M/{args.tensors}", numel=100_000_000, tensors=args.tensors))
    if not args.no_small:
        cases.append(dict(name="many-small 2M/2000", numel=2_000_000, tensors=2000))
        cases.append(dict(name=OVERHEAD_CASE, numel=20_000, tensors=2000))
    return cases


def _fmt(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else str(n)


def _make_params(numel: int, tensors: int, dtype: torch.dtype, device: str, seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = numel // tensors
    params = []
    for i in range(tensors):
        n = per if i < tensors - 1 else numel - per * (tensors - 1)
        p = (torch.randn(n, generator=g) * 0.02).to(device=device, dtype=dtype).requires_grad_()
        p.grad = (torch.randn(n, generator=g) * 1e-3).to(device=device, dtype=dtype)
        params.append(p)
    return params


def _memory_bytes(opt: torch.optim.Optimizer, scratch: bool = True) -> int:
    """Bytes of the optimizer's state (0-d step counters included) and, with ``scratch``, of its flat
    scratch buffers; a storage shared by several tensors counts once."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor):
            for part in tensor_parts(t):  # a tensor subclass (torchao's 8-bit state): what it holds
                s = part.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()

    for st in opt.state.values():
        for v in st.values():
            add(v)
    for layout in getattr(opt, "_layouts", {}).values() if scratch else ():
        for b in layout.buckets:
            for buf in b.scratch_buffers():
                add(buf)
    return total


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(args) -> List[Dict[str, Any]]:
    """Time every configuration; returns one dict per (case, implementation, dtype)."""
    import halfadam

    peers = [PEERS[name] for name in getattr(args, "peer_names", [])]
    rows = []
    for case in _cases(args):
        configs = []  # (label dict, optimizer)
        for variant, kw in TORCH_VARIANTS.items():
            params = _make_params(case["numel"], case["tensors"], torch.float32, args.device, 0)
            configs.append((dict(impl=f"torch {variant}", dtype="fp32"),
                            torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kw)))
        for dname in args.dtypes:
            for impl in args.impls:
                for mode in args.state_modes:
                    if impl == "cpp" and (not supports(PRESETS[mode]) or args.device != "cpu"):
                        continue  # the C++ kernel: CPU only, no 8-bit moments
                    params = _make_params(case["numel"], case["tensors"], DTYPES[dname], args.device, 0)
                    configs.append((dict(impl=f"halfadam {impl}", dtype=dname, state=mode),
                                    halfadam.AdamW(params, lr=1e-3, weight_decay=0.01, implementation=impl,
                                                   state_mode=mode)))
        for peer in peers:
            params = _make_params(case["numel"], case["tensors"], peer.param_dtype, args.device, 0)
            dname = next(k for k, v in DTYPES.items() if v == peer.param_dtype)
            configs.append((dict(impl=peer.label, dtype=dname), peer.build(params, lr=1e-3, weight_decay=0.01)))
        times: Dict[int, List[float]] = {i: [] for i in range(len(configs))}
        first: Dict[int, float] = {}
        for r in range(args.warmup + args.repeat):
            for i, (_, opt) in enumerate(configs):
                _sync(args.device)
                t0 = time.perf_counter()
                opt.step()
                _sync(args.device)
                dt = time.perf_counter() - t0
                if r == 0:
                    first[i] = dt
                if r >= args.warmup:
                    times[i].append(dt)
        torch_fused = None
        for i, (label, opt) in enumerate(configs):
            t = statistics.median(times[i])
            if label["impl"] == "torch fused":
                torch_fused = t
            rows.append(dict(case=case["name"], numel=case["numel"], tensors=case["tensors"], device=args.device,
                             threads=torch.get_num_threads(),
                             **label, ms=t * 1e3, ns_per_param=t / case["numel"] * 1e9,
                             gb_per_s=BYTES_PER_PARAM * case["numel"] / t / 1e9,
                             first_step_s=first[i], memory_mb=_memory_bytes(opt) / 2**20,
                             state_bytes_per_param=_memory_bytes(opt, scratch=False) / case["numel"]))
        for row in rows:
            if row["case"] == case["name"]:
                row["vs_torch_fused"] = row["ms"] / 1e3 / torch_fused
        here = [r for r in rows if r["case"] == case["name"]]
        ref = {(r["dtype"], r["state"]): r["ms"] for r in here if r["impl"] == "halfadam reference"}
        fp32_state = {(r["dtype"], r["impl"]): r["ms"] for r in here if r.get("state") == "fp32"}
        for row in here:
            key = (row["dtype"], row.get("state"))
            if key in ref and row["impl"].startswith("halfadam"):
                row["speedup_vs_reference"] = ref[key] / row["ms"]
            if (row["dtype"], row["impl"]) in fp32_state and row["impl"].startswith("halfadam"):
                row["vs_fp32_state"] = row["ms"] / fp32_state[(row["dtype"], row["impl"])]
        del configs
        gc.collect()
        if not args.json:
            print(_table([r for r in rows if r["case"] == case["name"]]), flush=True)
            if case["name"] == OVERHEAD_CASE:
                print(_overhead([r for r in rows if r["case"] == case["name"]]), flush=True)
    return rows


def _overhead(rows: List[Dict[str, Any]]) -> str:
    """One line per configuration of the overhead case: its step time as per-step and per-tensor overhead."""
    lines = ["per-step overhead (a step over 2,000 tensors of 10 elements: Python, validation, kernel entry):"]
    for r in rows:
        state = f" ({r['state']} state)" if r.get("state") else ""
        lines.append(f"  {r['impl']} {r['dtype']}{state}: {r['ms'] * 1e3:.0f} us/step, "
                     f"{r['ms'] * 1e3 / r['tensors']:.2f} us/tensor, {r['vs_torch_fused']:.2f}x torch fused")
    return "\n".join(lines) + "\n"


def _table(rows: List[Dict[str, Any]]) -> str:
    head = ["case", "implementation", "dtype", "state", "ms/step", "ns/param", "GB/s", "x torch fused",
            "x faster than ref", "x fp32 state", "state B/param", "1st step s", "opt MB"]
    lines = [head]
    for r in rows:
        sp, fs = r.get("speedup_vs_reference"), r.get("vs_fp32_state")
        lines.append([r["case"], r["impl"], r["dtype"], r.get("state", "-"), f"{r['ms']:.2f}", f"{r['ns_per_param']:.3f}",
                      f"{r['gb_per_s']:.1f}", f"{r['vs_torch_fused']:.2f}", "" if sp is None else f"{sp:.1f}",
                      "" if fs is None else f"{fs:.2f}", f"{r['state_bytes_per_param']:.2f}",
                      f"{r['first_step_s']:.2f}", f"{r['memory_mb']:.0f}"])
    widths = [max(len(str(l[i])) for l in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(l, widths)) for l in lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--sizes", type=lambda s: [int(float(x)) for x in s.split(",")], default=[1_000_000, 20_000_000],
                        help="comma-separated parameter counts (default 1e6,2e7), split into --tensors tensors")
    parser.add_argument("--tensors", type=int, default=50, help="tensors per size case (default 50)")
    parser.add_argument("--large", action="store_true", help="also 100M parameters (needs ~10 GB)")
    parser.add_argument("--no-small", action="store_true",
                        help="skip the many-small-tensors case (2000 tensors, 2M) and the overhead case (2000 tensors "
                             "of 10 elements)")
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES), help="fp16,bf16,fp32")
    parser.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS),
                        help="reference,foreach,fused,cpp (default all). reference: one update per tensor; foreach: "
                             "eager ops over flat buffers; fused: torch.compile (Inductor C++ on CPU, Triton on CUDA); "
                             "cpp: the hand-written C++ CPU kernel (CPU only; state modes fp32, split, bf16: skipped elsewhere). "
                             "implementation='auto' runs cpp on the CPU where it builds, else fused")
    parser.add_argument("--state-modes", type=lambda s: list(STATE_MODES) if s == "all" else s.split(","),
                        default=["fp32", "compact"],
                        help="halfadam state modes to time (state_mode=...): fp32,split,bf16,compact or all "
                             "(default fp32,compact); 'x fp32 state' is each row's time over the fp32-state one")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (the first compiles)")
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds; the median is reported")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for the run (default: torch's default, all cores)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of tables")
    parser.add_argument("--peers", action="store_true",
                        help="also time the optimizers a user would pick instead of halfadam, each only if its "
                             "package is installed: " + ", ".join(f"{p.source} ({p.package})" for p in PEERS.values()))
    return parser


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``argparse`` subparsers object; the handler is ``args.func(args)``."""
    p = subparsers.add_parser("bench", help="time one optimizer step against torch.optim.AdamW",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Run the benchmark for parsed ``args`` (see :func:`add_arguments`); returns the exit status."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("halfadam bench: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    for d in args.dtypes:
        if d not in DTYPES:
            print(f"halfadam bench: unknown dtype {d!r} (choose from {list(DTYPES)})", file=sys.stderr)
            return 2
    for i in args.impls:
        if i not in IMPLS:
            print(f"halfadam bench: unknown implementation {i!r} (choose from {list(IMPLS)})", file=sys.stderr)
            return 2
    for m in args.state_modes:
        if m not in STATE_MODES:
            print(f"halfadam bench: unknown state mode {m!r} (choose from {list(STATE_MODES)}, or all)", file=sys.stderr)
            return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.peer_names = []
    if getattr(args, "peers", False):
        log = lambda line: print(f"halfadam bench: {line}", file=sys.stderr)  # noqa: E731 - stdout may be JSON
        args.peer_names = select_peers([], add=True, bench=True, device=args.device, log=log)
    rows = measure(args)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``halfadam bench`` as a standalone program: ``python -m halfadam.bench [options]``."""
    parser = add_arguments(argparse.ArgumentParser(prog="halfadam bench", description=__doc__.split("\n\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
