"""Compile the Triton kernel for an NVIDIA GPU without one: every variant the optimizer launches, down
to PTX and a cubin for ``--arch`` (default 90: H100/H200), and check the arithmetic the bitwise claim
rests on: IEEE divisions and square roots (``div.rn.f32``, ``sqrt.rn.f32``; no ``div.full``/``approx``),
and no fused multiply-add but the four per element of Adam's division by ``sqrt(1 - beta2**t)`` (two
Markstein correction steps, ``kernels/triton.py``'s ``_div_by_coefficient``; none with
``optimized_update``, which has no such division, nor in SGD's and Lion's variants, which divide nothing).
Adam's variants come first; then SGD's (with and without momentum) and Lion's (:func:`rule_variants`, their
lines named by the rule), whose counts per state mode are summarised before Adam's.

    python benchmarks/triton_compile_check.py [--arch 90]

Prints one line per variant and exits 1 if one fails to compile or breaks a check. Needs the triton
package (its bundled ptxas), not a GPU; ``tests/test_triton.py`` runs it. The compiler is told what
Triton's launcher tells it (every tensor argument 16-byte aligned) and takes the launch's options
(``num_warps``, no fp fusion).

Each line also gives the variant's speed, judged statically: the SASS instructions (counted in the
listing of triton's bundled ``nvdisasm``) a program executes per element, its loop (over the tiles of
its :data:`~halfadam.kernels.triton.CHUNK` elements) counted once per tile of a whole program, the
rest once (the setup, and the divisions' slow paths: never executed on ordinary values, but in the
listing), over the ``CHUNK / (num_warps * 32)`` elements of each thread; the bytes it moves per
element, and the H200 time per element each implies: bytes over :data:`HBM_BYTES_PER_S` against
instructions over :data:`LANE_INSTRUCTIONS_PER_S`. The larger bounds the step; ``issue/mem`` above 1
means compute-bound. A variant's name gives its parameter and gradient dtypes, ``master`` (0: none, a
float32 parameter; 1: fp32 master; 2: split master; 3: split8 master), the ``m``/``v`` moment encodings and its
switches (``l2``: Adam's L2 decay, ``scale``: a gradient scale, ``per-tensor``: per-tensor step
counts, ``state-in-table``: FSDP2 shards' own state, ``aligned``: 16-byte loads and stores, the
launches of nearly every model; ``rows``: a launch with rows that end in a short block, each block's
row found by a division). The closing summary gives the five state modes' counts for bf16
parameters with float32 gradients (GradScaler's) against a target per mode: the low-memory-state
issue's (2026-12-01; ``over`` marks a miss, which fails nothing here).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
from pathlib import Path
from typing import Tuple

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not for the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from halfadam.kernels import triton as kernel  # noqa: E402

_MOMENT = {0: "fp32", 1: "bf16", 2: "u8", 3: "none"}
#: each moment kind's pointer (an absent slot gets launch()'s dummy, the int32 scalars)
_POINTER = {0: "*fp32", 1: "*bf16", 2: "*u8", 3: "*i32"}
_DTYPES = {tl.float32: "fp32", tl.float16: "fp16", tl.bfloat16: "bf16"}
_SIZE = {tl.float32: 4, tl.float16: 2, tl.bfloat16: 2}

#: H200: HBM3e bandwidth, and lane-instructions issued per second (132 SMs x 4 schedulers x 32 lanes x
#: 1.98 GHz boost; one warp instruction per scheduler per cycle)
HBM_BYTES_PER_S = 4.8e12
LANE_INSTRUCTIONS_PER_S = 132 * 4 * 32 * 1.98e9


def bytes_per_element(const: dict) -> float:
    """Bytes one element's update reads and writes: parameter (read, write), gradient (read), master
    (fp32: 4 + 4; split: the remainder's two bytes, both ways, and a tie byte per block; split8: one byte,
    both ways), moments (fp32
    4 + 4, bf16 2 + 2, uint8 1 + 1 and a scale byte per block, both ways; an absent one none)."""
    block = kernel.BLOCK
    total = 2 * _SIZE[const["P_DTYPE"]] + _SIZE[const["G_DTYPE"]]
    total += {0: 0.0, 1: 8.0, 2: 4.0 + 2.0 / block, 3: 2.0}[const["MASTER"]]
    for kind in (const["M_KIND"], const["V_KIND"]):
        total += {0: 8.0, 1: 4.0, 2: 2.0 + 2.0 / block, 3: 0.0}[kind]  # (3: the slot absent)
    return total


def sass_listing(cubin: bytes) -> str:
    """``cubin``'s SASS listing (triton's bundled ``nvdisasm``)."""
    import subprocess
    import tempfile

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout


def sass_instructions(cubin: bytes) -> Tuple[int, int]:
    """Instructions in ``cubin``'s SASS listing (NOPs of the padding not counted): all of them, and those
    of its loop (the tiles' loop: the instructions from a backward branch's target to the branch; the
    trap after EXIT, a branch to itself, aside). Raises if there is more than one loop."""
    instructions, labels = [], {}
    for line in sass_listing(cubin).splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
        elif re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", line) and not re.search(r"\bNOP\b", line):
            instructions.append(line)
    loops = []
    for i, line in enumerate(instructions):
        target = re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i:
            loops.append(i + 1 - labels[target.group(1)])
    if len(loops) > 1:
        raise RuntimeError(f"{len(loops)} loops in the SASS; the count assumes at most one (the tiles')")
    return len(instructions), (loops[0] if loops else 0)


def signature(m_kind: int, v_kind: int) -> dict:
    sig = {"work_ptr": "*i64", "table_ptr": "*i64", "scalars_ptr": "*i32", "grad_scale_ptr": "*fp32",
           "found_inf_ptr": "*fp32", "master_ptr": "*fp32", "hi_ptr": "*i8", "lo_ptr": "*u8", "tie_ptr": "*u8",
           "m_ptr": _POINTER[m_kind], "v_ptr": _POINTER[v_kind], "m_scale_ptr": "*u8",
           "v_scale_ptr": "*u8"}
    for name in ("P_DTYPE", "G_DTYPE", "MASTER", "M_KIND", "V_KIND", "RULE", "L2", "OPTIMIZED", "NESTEROV",
                 "HAS_SCALE", "HAS_FOUND_INF", "SCALARS_STRIDE", "STATE_IN_TABLE", "ALIGNED", "ROWS", "CVT", "NB",
                 "BLOCK_", "CHUNK_"):
        sig[name] = "constexpr"
    return sig


def attributes(sig: dict) -> dict:
    """What Triton's launcher tells the compiler about the arguments: every tensor (a pointer) is 16-byte
    aligned (torch allocates so; the launcher specializes on it)."""
    names = list(kernel._step_kernel.arg_names)
    return {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items() if v.startswith("*")}


def compile_variant(const: dict, arch: int = 90, module=kernel):
    """The compiled kernel of one variant (``const``: its constexprs but the launch shape's and CVT; without
    ``RULE``/``NESTEROV``, Adam's), for ``sm_{arch}``; ``module``: kernels/triton.py, or a changed copy of it
    (``codes_floor.py``)."""
    const = dict(dict(RULE=0, NESTEROV=False), **const, CVT=True, NB=module.BLOCKS_PER_TILE, BLOCK_=module.BLOCK,
                 CHUNK_=module.CHUNK)
    sig = signature(const["M_KIND"], const["V_KIND"])
    src = ASTSource(fn=module._step_kernel, signature=sig, constexprs=const, attrs=attributes(sig))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"enable_fp_fusion": False, "num_warps": module.NUM_WARPS})


def per_element(cubin: bytes) -> float:
    """The SASS instructions a program executes per element (see the module docstring): its loop once per
    tile of a whole program, the rest once, over each thread's elements."""
    total, loop = sass_instructions(cubin)
    tiles = kernel.CHUNK // kernel.TILE
    return (total - loop + tiles * loop) / (kernel.CHUNK / (kernel.NUM_WARPS * 32))


def variants():
    """Every parameter dtype with its masters and moment encodings, and each switch once; the launches with
    short blocks (``ROWS``) of every format with per-block keys for bf16 parameters, fp16 and float32
    ones in compact, and FSDP2 shards in compact (Adam's: 67); then the other rules' (:func:`rule_variants`)."""
    plain = dict(G_DTYPE=tl.float32, L2=False, OPTIMIZED=False, HAS_SCALE=False, HAS_FOUND_INF=False, SCALARS_STRIDE=0,
                 STATE_IN_TABLE=False, ALIGNED=True, ROWS=False)
    for pdt, master, mk, vk in itertools.product((tl.bfloat16, tl.float16, tl.float32), (0, 1, 2), (0, 1, 2), (0, 1, 2)):
        if (pdt == tl.float32) != (master == 0):
            continue  # float32 parameters have no master; half ones in buckets always have one
        yield dict(plain, P_DTYPE=pdt, MASTER=master, M_KIND=mk, V_KIND=vk)
    for mk, vk in itertools.product((0, 1, 2), (0, 1, 2)):  # split8 masters: bfloat16 parameters only
        yield dict(plain, P_DTYPE=tl.bfloat16, MASTER=3, M_KIND=mk, V_KIND=vk)
    base = dict(plain, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, MASTER=2, M_KIND=2, V_KIND=2)
    yield dict(base, L2=True, OPTIMIZED=True, HAS_SCALE=True, HAS_FOUND_INF=True, SCALARS_STRIDE=10)
    yield dict(base, MASTER=1, M_KIND=1, V_KIND=1, HAS_SCALE=True, STATE_IN_TABLE=True)
    for master, kinds in ((1, 0), (2, 2), (3, 2)):  # a launch with a tensor of a size or address not a multiple of 8 / 16 B
        yield dict(plain, P_DTYPE=tl.bfloat16, MASTER=master, M_KIND=kinds, V_KIND=kinds, ALIGNED=False)
    rows = dict(plain, ALIGNED=False, ROWS=True)  # (never aligned: rows start anywhere)
    for pdt, master, kinds in ((tl.bfloat16, 2, 0), (tl.bfloat16, 2, 1), (tl.bfloat16, 2, 2), (tl.bfloat16, 1, 2),
                               (tl.bfloat16, 3, 2),
                               (tl.float16, 2, 2), (tl.float32, 0, 2)):
        yield dict(rows, P_DTYPE=pdt, MASTER=master, M_KIND=kinds, V_KIND=kinds)
    yield dict(rows, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, MASTER=2, M_KIND=2, V_KIND=2, STATE_IN_TABLE=True)
    yield from rule_variants()


#: The other update rules (kernels/triton.py's RULE): 1 SGD (with momentum: its buffer in the exp_avg slot;
#: without: no moment), 2 Lion (its moment in the exp_avg slot); never an exp_avg_sq slot (kind 3: absent)
SGD, LION, NONE = 1, 2, 3
_RULE_NAMES = {1: "sgd", 2: "lion"}
_MASTERS = {1: "fp32", 2: "split", 3: "split8"}


def rule_variants():
    """SGD with momentum and Lion in each state mode for bf16 parameters (MODES' masters and exp_avg kinds);
    SGD without momentum over each master and float32 parameters; each rule's float16 and float32
    parameters, its switches once (SGD: weight decay, nesterov), FSDP2 shards, rows that end in a short block."""
    plain = dict(G_DTYPE=tl.float32, L2=False, OPTIMIZED=False, NESTEROV=False, HAS_SCALE=False, HAS_FOUND_INF=False,
                 SCALARS_STRIDE=0, STATE_IN_TABLE=False, ALIGNED=True, ROWS=False, V_KIND=NONE)
    for rule in (SGD, LION):
        for (master, mk, _), _budget in MODES.values():
            yield dict(plain, RULE=rule, P_DTYPE=tl.bfloat16, MASTER=master, M_KIND=mk)
    for master in (1, 2, 3):  # SGD without momentum: no moment at all
        yield dict(plain, RULE=SGD, P_DTYPE=tl.bfloat16, MASTER=master, M_KIND=NONE)
    yield dict(plain, RULE=SGD, P_DTYPE=tl.float32, MASTER=0, M_KIND=NONE)
    for rule in (SGD, LION):
        yield dict(plain, RULE=rule, P_DTYPE=tl.float16, MASTER=2, M_KIND=2)
        yield dict(plain, RULE=rule, P_DTYPE=tl.float32, MASTER=0, M_KIND=1)
    base = dict(plain, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, MASTER=2, M_KIND=2)
    yield dict(base, RULE=SGD, L2=True, NESTEROV=True, HAS_SCALE=True, HAS_FOUND_INF=True, SCALARS_STRIDE=10)
    yield dict(base, RULE=LION, MASTER=1, M_KIND=1, HAS_SCALE=True, STATE_IN_TABLE=True)
    rows = dict(plain, ALIGNED=False, ROWS=True)
    yield dict(rows, RULE=SGD, P_DTYPE=tl.bfloat16, MASTER=3, M_KIND=2)
    yield dict(rows, RULE=LION, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, MASTER=2, M_KIND=2, STATE_IN_TABLE=True)


#: The state modes' variants for bf16 parameters (float32 gradients, as GradScaler hands them over) and
#: their instruction budgets per element (the low-memory-state issue's targets, 2026-12-01)
MODES = {"fp32": ((1, 0, 0), 130), "split": ((2, 0, 0), 150), "bf16": ((2, 1, 1), 110), "compact": ((2, 2, 2), 110),
         "tiny": ((3, 2, 2), 110)}


def check(arch: int) -> int:
    failures = 0
    per_mode, per_rule_mode = {}, {}
    for const in variants():
        rule = const.get("RULE", 0)
        label = ""  # Adam's lines as they were; the other rules' named
        if rule == SGD:
            label = f"sgd {'momentum' if const['M_KIND'] != NONE else 'no-momentum'}"
            label += f"{' nesterov' if const['NESTEROV'] else ''}: "
        elif rule != 0:
            label = f"{_RULE_NAMES[rule]}: "
        name = (f"{label}{_DTYPES[const['P_DTYPE']]} grad={_DTYPES[const['G_DTYPE']]} master={const['MASTER']} "
                f"m={_MOMENT[const['M_KIND']]} "
                f"v={_MOMENT[const['V_KIND']]} l2={const['L2']} scale={const['HAS_SCALE']} "
                f"found_inf={const['HAS_FOUND_INF']} per-tensor={const['SCALARS_STRIDE'] > 0} "
                f"state-in-table={const['STATE_IN_TABLE']} aligned={const['ALIGNED']} rows={const['ROWS']}")
        try:
            out = compile_variant(const, arch)
        except Exception as exc:
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}")
            failures += 1
            continue
        ptx = out.asm["ptx"]
        approx = len(re.findall(r"\b(div\.full|div\.approx|sqrt\.approx|rsqrt)", ptx))
        fma = len(re.findall(r"\bfma\.\S*f32", ptx))
        # the only fused multiply-adds: the division by sqrt(1 - beta2**t)'s two Markstein steps, 4 per element
        # of a tile (kernels/triton.py: _div_by_coefficient)
        # (SGD and Lion divide nothing: none)
        fma_expected = 0 if const["OPTIMIZED"] or rule != 0 else 4 * kernel.TILE // (kernel.NUM_WARPS * 32)
        bad = approx or fma != fma_expected or not out.asm.get("cubin")
        failures += bool(bad)
        speed = ""
        if out.asm.get("cubin"):
            count = per_element(out.asm["cubin"])
            moved = bytes_per_element(const)
            mem_ns, issue_ns = moved / HBM_BYTES_PER_S * 1e9, count / LANE_INSTRUCTIONS_PER_S * 1e9
            speed = (f"; SASS {count:.0f} instr/element, {moved:.2f} B/element; H200 per 1M elements: "
                     f"memory {mem_ns * 1e3:.2f} us, issue {issue_ns * 1e3:.2f} us (issue/mem {issue_ns / mem_ns:.2f})")
            plain = const["ALIGNED"] and not (const["L2"] or const["HAS_SCALE"] or const["STATE_IN_TABLE"]
                                              or const["ROWS"])
            for mode, (kinds, budget) in MODES.items():
                if not (plain and const["P_DTYPE"] == tl.bfloat16):
                    continue
                if rule == 0 and (const["MASTER"], const["M_KIND"], const["V_KIND"]) == kinds:
                    per_mode[mode] = (count, budget, issue_ns / mem_ns)
                elif rule != 0 and const["MASTER"] == kinds[0] and const["M_KIND"] == kinds[1]:
                    per_rule_mode.setdefault(label[:-2], {})[mode] = count
                elif rule != 0 and const["MASTER"] == kinds[0] and const["M_KIND"] == NONE:  # (by its master)
                    per_rule_mode.setdefault(label[:-2], {})[_MASTERS[const["MASTER"]] + " master"] = count
        print(f"{'FAIL' if bad else 'ok  '} {name}: div.rn {ptx.count('div.rn.f32')}, sqrt.rn {ptx.count('sqrt.rn.f32')}, "
              f"approximate {approx}, fma {fma} (expected {fma_expected}), cubin {len(out.asm.get('cubin', b''))} B"
              f"{speed}")
    print(f"other rules, state modes, bf16 parameters, fp32 gradients, sm_{arch}: SASS instructions per element:")
    for rule, counts in per_rule_mode.items():
        print(f"- {rule:16s} " + ", ".join(f"{mode} {count:.0f}" for mode, count in counts.items()))
    print(f"state modes, bf16 parameters, fp32 gradients, sm_{arch}: SASS instructions per element (target), "
          f"issue/memory time on an H200:")
    for mode, (count, budget, ratio) in per_mode.items():
        print(f"  {mode:8s} {count:4.0f} (target {budget}{', over' if count > budget else ''}), {ratio:.2f}"
              f"{' compute-bound' if ratio > 1 else ''}")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (default 90)")
    failures = check(parser.parse_args(argv).arch)
    print(f"triton_compile_check: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
