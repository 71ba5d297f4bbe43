"""The C++ kernel's 8-bit moment encoders against the specification on every float32 input that matters.

A block's code depends only on ``y = x / absmax`` (and, for ``exp_avg_sq``, the element's position
and the step). Blocks whose first element is 1.0 have ``y = x``, so this feeds every float32 ``y`` in
[2**-30, 1] of both signs to the ``exp_avg`` encoder (below 2**-30 every ``y`` is the code of 0.0),
and every ``y`` in [2**-26, 1] to the ``exp_avg_sq`` one (every positive ``y`` below 2**-24, the
lowest level, takes code 1), through ``halfadam_cpu.encode_uint8`` (the kernel's block encoder) and
``encodings._encode_moment_`` (torch), and counts the codes that differ. Two cores: about 2 minutes.

    python benchmarks/cpp_uint8_exhaustive.py
"""

from __future__ import annotations

import time

import torch

from halfadam.kernels import cpp as cpu_kernel
from halfadam import encodings as E


def _blocks(values: torch.Tensor) -> torch.Tensor:
    n = values.numel()
    rows = -(-n // 127)
    x = torch.zeros(rows, 128)
    x[:, 0] = 1.0
    flat = torch.zeros(rows * 127)
    flat[:n] = values
    x[:, 1:] = flat.view(rows, 127)
    return x.view(-1)


def differing(kernel, tables, name: str, values: torch.Tensor, seed: int) -> int:
    x = _blocks(values)
    want = {name: torch.zeros(x.numel(), dtype=torch.uint8), f"{name}_absmax": torch.zeros(x.numel() // 128)}
    E._encode_moment_(torch.uint8, name, x, want, tables, torch.tensor(seed))
    codes, absmax = torch.zeros(x.numel(), dtype=torch.uint8), torch.zeros(x.numel() // 128)
    kernel.encode_uint8(x, codes, absmax, list(tables), name == "exp_avg", seed)
    return int((codes != want[name]).sum()) + int((absmax != want[f"{name}_absmax"]).sum())


def main() -> None:
    kernel = cpu_kernel.load()
    if kernel is None:
        raise SystemExit(f"the C++ kernel is unavailable: {cpu_kernel.unavailable_reason()}")
    tables = E.tables(E.PRESETS["compact"], torch.device("cpu"))
    for name, lowest, seed in (("exp_avg", 2.0 ** -30, 0), ("exp_avg_sq", 2.0 ** -26, 9)):
        start = time.perf_counter()
        first = int(torch.tensor(lowest).view(torch.int32))
        bits = torch.arange(first, 0x3F800001, dtype=torch.int64)
        bad = 0
        for part in bits.split(1 << 22):
            y = part.to(torch.int32).view(torch.float32)
            bad += differing(kernel, tables, name, y, seed)
            if name == "exp_avg":
                bad += differing(kernel, tables, name, -y, seed)
        print(f"{name}: {bits.numel()} float32 values{' (both signs)' if name == 'exp_avg' else ''}, "
              f"{bad} codes differ ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
