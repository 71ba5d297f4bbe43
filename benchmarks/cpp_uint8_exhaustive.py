"""The C++ kernel's 8-bit moment encoder and decoder against the specification on every float32 input that matters.

Over a block's base exponent (``encodings._block_base``: set by the block's largest magnitude) a
value's code depends only on its own bits and on its element's 16 random bits: the tiers are
translations in the exponent, and below ``unit * 2**-19`` (``unit = 2**(base - 127)``) every value
takes the same code whatever the random bits. So, for each base given, this feeds every float32
magnitude from there up to the end of the block's top binade (exp_avg: both signs; exp_avg_sq: the
positive ones, and every 97th one negated), in blocks whose first element fixes the base, to
``halfadam_cpu.encode_uint8`` (the kernel's block encoder, at its widest lane width unless
``--lanes``) and to ``encodings._encode_moment_`` (torch), and counts the codes and scales that
differ; then decodes the codes with both. Each value meets one position's random bits (those of its
place in the run, at ``--step``): exhaustive in the values, a sample of the random bits (the unit
tests put values exactly at the random bits' rounding boundaries).

    python benchmarks/cpp_uint8_exhaustive.py [--bases 1,100] [--names exp_avg,exp_avg_sq] [--lanes 16]

On one core of the machine this was written on: 20-40 s per base for exp_avg_sq, about 2 minutes for
exp_avg (both signs), 240-570 million values each.
"""

from __future__ import annotations

import argparse
import time

import torch

from halfadam import encodings as E
from halfadam.kernels import cpp as cpu_kernel

CHUNK = 127 << 15  # values per call: 32768 blocks of 127 (and the block's first element)


def _blocks(values: torch.Tensor, top: float) -> torch.Tensor:
    """``values`` in blocks of 128 whose first element is ``top`` (the block's base), zero-padded."""
    rows = -(-values.numel() // 127)
    x = torch.zeros(rows, 128)
    x[:, 0] = top
    flat = torch.zeros(rows * 127)
    flat[:values.numel()] = values
    x[:, 1:] = flat.view(rows, 127)
    return x.view(-1)


def differing(kernel, name: str, x: torch.Tensor, step: int) -> int:
    """Codes, scales and decoded values (as bits; any nan as nan) that differ for blocks ``x`` (at
    positions from 0, the kernel's helper's)."""
    stored = {name: torch.zeros(x.numel(), dtype=torch.uint8), f"{name}_scale": torch.zeros(x.numel() // 128, dtype=torch.uint8)}
    E._encode_moment_(torch.uint8, name, x.clone(), stored, E._random_bits(torch.arange(x.numel()), torch.tensor(step)))
    codes, scale = torch.zeros(x.numel(), dtype=torch.uint8), torch.zeros(x.numel() // 128, dtype=torch.uint8)
    kernel.encode_uint8(x, codes, scale, name == "exp_avg", step)
    bad = int((codes != stored[name]).sum()) + int((scale != stored[f"{name}_scale"]).sum())
    got = kernel.decode_uint8(codes, scale, name == "exp_avg")
    want = E._decode_moment(torch.uint8, name, {name: codes, f"{name}_scale": scale})
    nan = got.isnan()
    bad += int((nan != want.isnan()).sum()) + int((got.view(torch.int32)[~nan] != want.view(torch.int32)[~nan]).sum())
    return bad


def check(kernel, name: str, base: int, step: int) -> None:
    start = time.perf_counter()
    span = E._SPAN[name]
    top = 1.5 * 2.0 ** (base + span - 127)
    low = int(torch.tensor(2.0 ** (base - 127 - 19)).view(torch.int32))
    high = min((base + span + 1) << 23, 0x7F800000)  # the end of the top binade (exclusive), or float32's largest
    bits = torch.arange(low, high, dtype=torch.int64)
    bad, count = 0, 0
    for part in bits.split(CHUNK):
        values = part.to(torch.int32).view(torch.float32)
        if name == "exp_avg":
            values = torch.cat([values, -values])
        else:
            values = values.clone()
            values[::97] = -values[::97]
        bad += differing(kernel, name, _blocks(values, top), step)
        count += values.numel()
    print(f"{name} base {base}: {count} float32 values (from {2.0 ** (base - 146):.3g} to the top binade's end), "
          f"{bad} codes, scales or decoded values differ ({time.perf_counter() - start:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bases", default="1,100", help="comma-separated block base exponents (1 .. 254 - span)")
    ap.add_argument("--names", default="exp_avg,exp_avg_sq")
    ap.add_argument("--step", type=int, default=9, help="the step whose random bits are drawn")
    ap.add_argument("--lanes", type=int, default=0, help="the kernel's lane width (0: the widest compiled in)")
    args = ap.parse_args()
    kernel = cpu_kernel.load()
    if kernel is None:
        raise SystemExit(f"the C++ kernel is unavailable: {cpu_kernel.unavailable_reason()}")
    kernel.set_lanes(args.lanes)
    for name in args.names.split(","):
        for base in (int(b) for b in args.bases.split(",")):
            check(kernel, name, base, args.step)


if __name__ == "__main__":
    main()
