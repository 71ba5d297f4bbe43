"""Host memory per parameter under FSDP2's CPU offload, measured from the process (issue 35, item 4).

A model of ~21M parameters (20 ``nn.Linear(1024, 1024, bias=False)`` layers, each its own FSDP2 unit,
``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))`` on one gloo rank) is trained for
``--steps`` steps by each configuration, each in its own subprocess so that its resident memory is clean:

- ``halfadam <mode>``: ``halfadam.AdamW(state_mode=<mode>)`` (the C++ kernel) on bfloat16 parameters
  (bfloat16 gradients), for every state mode;
- ``deepspeed fp32``: ``DeepSpeedCPUAdam`` on float32 host parameters and gradients (ZeRO-Offload's fp32
  master and moments), the compute in bfloat16 through ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``; DeepSpeed steps the host shards' local tensors (its C++ op takes plain tensors);
- ``torch fp32``: ``torch.optim.AdamW`` on float32 host parameters (what torchao's offload keeps by
  default), the same mixed-precision policy.

Figures (bytes per parameter of the model):

- ``state``: the optimizer's state tensors (every storage counted once, 0-d step counters and halfadam's
  flat scratch buffers included), read from ``optimizer.state``;
- ``p+g``: the host shards of the parameters and of their gradients, read from the tensors;
- ``USS``: the growth of the process's unique set size (``Private_Clean + Private_Dirty`` of
  ``/proc/self/smaps_rollup``) from before the model is built to after the last ``step()`` (gradients
  still held, before ``zero_grad``), after ``gc.collect()`` and glibc's ``malloc_trim(0)``: parameters,
  gradients, state, and whatever FSDP2 and the process keep between steps (its staging buffers, if it
  keeps any; Python objects);
- ``no trim``: the same after the step before the last, without any ``malloc_trim`` since the model was
  built (what a training loop that never trims holds: glibc keeps freed chunks under its mmap threshold,
  which rises to 32 MB after the first large free; ``MALLOC_MMAP_THRESHOLD_=131072`` keeps it low);
- ``RSS``: the growth of the resident set (shared pages too), at the same point; the target column
  compares the larger of USS and RSS;
- ``peak``: the growth of the peak resident set (``VmHWM``) over the steps before the last (the first
  allocates the state; under glibc's default mmap threshold the heap's freed chunks it cannot reuse count
  too: run with ``MALLOC_MMAP_THRESHOLD_=131072`` to see the bytes live at once);
- ``bwd`` / ``step``: the growth of the peak resident set in the last step's forward and backward
  (FSDP2's unsharded parameters and gradients, its reduce-scatter buffers, the activations) and in its
  ``optimizer.step()`` (the optimizer's temporaries), each from before the model, measured after
  ``malloc_trim`` and a reset of ``VmHWM`` so that only bytes live at once count.

Before the starting point each subprocess runs the whole path once on a 2-layer model of the same width
(imports, gloo, FSDP2, the C++ kernels and their threads, DeepSpeed's op), so libraries and thread stacks
are not counted.

Run: ``PYTHONPATH=src python benchmarks/offload_host_memory.py`` (about 3 minutes on 2 cores; DeepSpeed's
rows only where ``deepspeed`` imports, its CPU Adam built on first use).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import subprocess
import sys

MODES = ("fp32", "split", "bf16", "compact", "tiny")
CONFIGS = [f"halfadam-{m}" for m in MODES] + ["deepspeed-fp32", "torch-fp32"]
#: Targets of issue 35 (B/param of host memory under offload, measured); DeepSpeed's ideal: 16.
TARGETS = {"halfadam-tiny": 7.0, "halfadam-compact": 8.0, "deepspeed-fp32": 16.0}
WIDTH = 1024


# ------------------------------------------------------------------------------------------- measuring
def _proc(path: str, keys: tuple) -> dict:
    out = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                out[name] = int(rest.split()[0]) * 1024
    return out


def memory() -> dict:
    """This process's USS, RSS and peak RSS (VmHWM) in bytes."""
    smaps = _proc("/proc/self/smaps_rollup", ("Rss", "Private_Clean", "Private_Dirty"))
    status = _proc("/proc/self/status", ("VmHWM",))
    return dict(uss=smaps["Private_Clean"] + smaps["Private_Dirty"], rss=smaps["Rss"], hwm=status["VmHWM"])


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


# ------------------------------------------------------------------------------------------- one config
def build(config: str, layers: int):
    """The FSDP2-offloaded model, its optimizer, and the list of tensors the optimizer steps."""
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    fp32 = not config.startswith("halfadam")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    model.to(torch.float32 if fp32 else torch.bfloat16)
    kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=False))
    if fp32:  # the fp32 master on the host, the compute in bf16 (as ZeRO-Offload and torchao's bf16 training)
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    params = list(model.parameters())
    if config.startswith("halfadam"):
        import halfadam

        opt = halfadam.AdamW(params, lr=1e-3, weight_decay=0.01, implementation="cpp",
                             state_mode=config.split("-", 1)[1])
        return model, opt, None
    if config == "torch-fp32":
        return model, torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01), None
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    # DeepSpeed's C++ op takes plain tensors (ZeRO-Offload hands it flat fp32 partitions): it steps the
    # shards' local tensors, their storage shared with the DTensor parameters; gradients linked per step.
    local = [_local(p).detach() for p in params]
    opt = DeepSpeedCPUAdam(local, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw_mode=True)
    return model, opt, list(zip(params, local))


def train(model, opt, link, steps: int, hooks=None):
    """``steps`` steps; ``hooks`` (a dict of callables) is called in the last one at "start", "backward"
    (after it) and "step" (after ``opt.step()``, gradients still held), and after the step before it at
    "previous" (before anything was trimmed)."""
    import torch

    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        call = (hooks or {}).get if step == steps - 1 else {}.get
        (call("start") or _nothing)()
        x = torch.randn(8, WIDTH, generator=g).to(torch.bfloat16)  # the compute is bf16 in every configuration
        model(x).float().square().mean().backward()
        (call("backward") or _nothing)()
        if link is not None:
            for p, loc in link:
                loc.grad = _local(p.grad)
        opt.step()
        (call("step") or _nothing)()
        if step == steps - 2:
            ((hooks or {}).get("previous") or _nothing)()
        opt.zero_grad(set_to_none=True)
        if link is not None:
            for _, loc in link:
                loc.grad = None


def _nothing():
    pass


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def run_one(config: str, steps: int, layers: int) -> dict:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        from halfadam.bench import _memory_bytes

        # warm-up: the same path on a 2-layer model, so libraries, threads and caches are not counted
        model, opt, link = build(config, 2)
        train(model, opt, link, 2)
        del model, opt, link
        _trim()
        before = memory()
        _reset_peak()
        before_hwm = memory()["hwm"]

        model, opt, link = build(config, layers)
        numel = sum(p.numel() for p in model.parameters())
        seen = {}

        def previous():  # what a loop that never trims holds: the step before the last, gradients held
            gc.collect()
            seen["untrimmed"] = memory()

        def start():  # the last step's peaks: from its live bytes (freed memory returned first)
            seen["hwm_first"] = memory()["hwm"]  # the steps before: the first allocates the state
            _trim()
            _reset_peak()

        def backward():
            seen["hwm_backward"] = memory()["hwm"]
            _trim()
            _reset_peak()

        def step():
            seen["hwm_step"] = memory()["hwm"]
            seen["state"] = _memory_bytes(opt, scratch=True)
            seen["params"] = _tensor_bytes(model.parameters())
            seen["grads"] = _tensor_bytes(p.grad for p in model.parameters())
            _trim()
            seen["after"] = memory()

        train(model, opt, link, steps, dict(previous=previous, start=start, backward=backward, step=step))
        per = lambda b: b / numel  # noqa: E731
        return dict(config=config, numel=numel, steps=steps, threads=torch.get_num_threads(),
                    param_dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
                    state=per(seen["state"]), params=per(seen["params"]), grads=per(seen["grads"]),
                    uss=per(seen["after"]["uss"] - before["uss"]),
                    rss=per(seen["after"]["rss"] - before["rss"]),
                    uss_untrimmed=per(seen["untrimmed"]["uss"] - before["uss"]),
                    peak=per(seen["hwm_first"] - before_hwm) if "hwm_first" in seen else None,
                    peak_backward=per(seen["hwm_backward"] - before["rss"]),
                    peak_step=per(seen["hwm_step"] - before["rss"]))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- the table
def table(rows: list) -> str:
    head = (f"{'configuration':<18}{'params':>6} {'state':>6} {'p+g':>6} {'USS':>6} {'no trim':>8} "
            f"{'RSS':>6} {'peak':>6} {'bwd':>6} {'step':>6}  target")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "failed" in r:
            lines.append(f"{r['config']:<18} failed: {r['failed'][:70]}")
            continue
        target = TARGETS.get(r["config"])
        held = max(r["uss"], r["rss"])
        verdict = "" if target is None else f"<= {target:g}: {'holds' if held <= target else 'misses'}"
        dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(r["param_dtype"], r["param_dtype"])
        lines.append(f"{r['config']:<18}{dtype:>6} {r['state']:6.2f} {r['params'] + r['grads']:6.2f} "
                     f"{r['uss']:6.2f} {r['uss_untrimmed']:8.2f} {r['rss']:6.2f} {r['peak']:6.2f} "
                     f"{r['peak_backward']:6.2f} {r['peak_step']:6.2f}  {verdict}")
    return "\n".join(lines)


LEGEND = """B/param of the model's parameters, one gloo rank, FSDP2 CPUOffloadPolicy(pin_memory=False):
  state    the optimizer's state tensors (scratch and step counters included), from optimizer.state
  p+g      the host shards of parameters and gradients, from the tensors
  USS      growth of the process's unique set size from before the model to after the last step
           (gradients held), after gc and malloc_trim: everything the process holds between steps
  no trim  the same a step earlier, nothing trimmed since the model was built
  RSS      growth of the resident set size (the same point; shared pages counted too)
  peak     growth of the peak resident set (VmHWM) over the steps before the last (the first allocates
           the state), from before the model (heap fragmentation too, unless MALLOC_MMAP_THRESHOLD_)
  bwd      the last step's peak RSS in forward and backward (unsharded params and grads, the
           reduce-scatter), from before the model, freed memory returned to the system before it
  step     the same for the last optimizer.step() (the optimizer's temporaries)"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {','.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=3, help="steps (at least 2; the figures are the last's)")
    parser.add_argument("--layers", type=int, default=20, help="1024x1024 layers (20: 20,971,520 parameters)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the subprocess: one configuration, JSON out
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step allocates the state; the last is measured)")
    if args.one:
        print(json.dumps(run_one(args.one, args.steps, args.layers)))
        return 0
    rows = []
    for config in args.configs.split(","):
        if config == "deepspeed-fp32":
            try:
                import importlib.util

                if importlib.util.find_spec("deepspeed") is None:
                    print("deepspeed-fp32 skipped: deepspeed is not installed (pip install deepspeed)",
                          file=sys.stderr)
                    continue
            except ImportError:
                continue
        proc = subprocess.run([sys.executable, __file__, "--one", config, "--steps", str(args.steps),
                               "--layers", str(args.layers)], capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            rows.append(dict(config=config, failed=tail))
            print(proc.stderr[-3000:], file=sys.stderr)
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{config}: done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        numel = next((r["numel"] for r in rows if "numel" in r), 0)
        print(f"{numel:,} parameters, {args.steps} steps\n{LEGEND}\n\n{table(rows)}")
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
