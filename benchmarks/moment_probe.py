"""The probe grid of issue 36: does a small element still move beside a large one in its block?

A (64, 128) bfloat16 parameter: 64 rows, each one block of 128 (blocks lie within rows,
``halfadam.encodings.has_rows`` / ``block_shape``). In every row one element gets a gradient
``spike`` at step 1 only, another a steady ``s`` for ``--hold`` (100) steps and then 0; every other
gradient is exactly 0 (no noise). The columns of the two elements vary with the row (the spike at
``7 r mod 128``, the small element 64 columns further). Weights start at ``N(0, 0.02)`` rounded to
bfloat16, the same in every run. ``--steps`` (130) AdamW steps with lr 1e-3, betas (0.9, 0.999),
eps 1e-8, weight decay 0.01 (decoupled).

The reference is ``torch.optim.AdamW`` (``foreach=False``) on a float32 copy of the weights. For
each state mode (``halfadam.AdamW(state_mode=...)``: fp32, bf16, compact, tiny) a cell is the mean
over the 64 rows of ``|w_end - w_0|`` of the small element (its fp32 master,
``opt.master_weight``) divided by the reference's ``|w_end - w_0|`` of it, for ``s`` in 1e-1 ..
1e-6 and ``spike`` in 1, 10, 100, 1e3. Cells outside [0.95, 1.05] are marked ``*``.

All 24 cells run at once, as 24 parameters of one optimizer per mode: each parameter's random bits
are a hash of the element's position in its own parameter and the step, so every cell takes the
same bits as a (64, 128) parameter stepped alone (``--check`` verifies that bit for bit on one cell).

    python benchmarks/moment_probe.py [--quick] [--check] [--implementation auto]

``--quick``: 2 values of ``s``, 2 of ``spike``, 8 rows, 30 steps (hold 20): a smoke run in seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

import halfadam  # noqa: E402

S_VALUES = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)
SPIKES = (1.0, 10.0, 100.0, 1e3)
MODES = ("fp32", "bf16", "compact", "tiny")
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
COLS = 128
LOW, HIGH = 0.95, 1.05


def columns(rows: int):
    """Per row, the spike's column and the small element's."""
    r = torch.arange(rows)
    spike = (7 * r) % COLS
    return spike, (spike + 64) % COLS


def initial(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, COLS, generator=g) * 0.02).to(torch.bfloat16)


def gradient(step: int, rows: int, s: float, spike: float, hold: int) -> torch.Tensor:
    """The gradient of one cell at ``step`` (1-based), float32."""
    g = torch.zeros(rows, COLS)
    r = torch.arange(rows)
    cs, cm = columns(rows)
    if step == 1:
        g[r, cs] = spike
    if step <= hold:
        g[r, cm] = s
    return g


def run_mode(mode: str, cells, rows: int, steps: int, hold: int, implementation: str) -> list:
    """Step one optimizer over one parameter per cell; the small elements' movement per cell and row
    (float64, ``(rows,)`` each). ``mode="torch"``: torch.optim.AdamW on float32 copies."""
    w0 = initial(rows)
    if mode == "torch":
        params = [torch.nn.Parameter(w0.float()) for _ in cells]
        opt = torch.optim.AdamW(params, foreach=False, **HYPER)
    else:
        params = [torch.nn.Parameter(w0.clone()) for _ in cells]
        opt = halfadam.AdamW(params, state_mode=mode, implementation=implementation, **HYPER)
    for step in range(1, steps + 1):
        for p, (s, spike) in zip(params, cells):
            p.grad = gradient(step, rows, s, spike, hold).to(p.dtype)
        opt.step()
    r = torch.arange(rows)
    _, cm = columns(rows)
    out = []
    for p in params:
        w = p.detach() if mode == "torch" else opt.master_weight(p).detach()
        out.append((w[r, cm].double() - w0[r, cm].double()).abs())
    return out, params, opt


def check_one_cell(mode: str, cell, cells, rows: int, steps: int, hold: int, implementation: str) -> bool:
    """Whether the cell's parameter, stepped beside the others, is bitwise one stepped alone."""
    _, together, opt_t = run_mode(mode, cells, rows, steps, hold, implementation)
    _, alone, opt_a = run_mode(mode, [cell], rows, steps, hold, implementation)
    i = list(cells).index(cell)
    same = torch.equal(together[i].detach().view(torch.int16), alone[0].detach().view(torch.int16))
    ma, mb = opt_t.master_weight(together[i]), opt_a.master_weight(alone[0])
    return same and torch.equal(ma.view(torch.int32), mb.view(torch.int32))


def fmt_num(x: float) -> str:
    return f"{x:.0e}".replace("e+00", "").replace("e+0", "e").replace("e-0", "e-")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 x 2 cells, 8 rows, 30 steps")
    ap.add_argument("--check", action="store_true", help="verify one cell bitwise against a run of it alone")
    ap.add_argument("--implementation", default="auto", help="halfadam implementation (default auto)")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    s_values, spikes, rows, steps, hold = S_VALUES, SPIKES, 64, 130, 100
    if args.quick:
        s_values, spikes, rows, steps, hold = (1e-2, 1e-4), (1.0, 100.0), 8, 30, 20
    modes = [m for m in args.modes.split(",") if m]
    cells = [(s, sp) for s in s_values for sp in spikes]
    t0 = time.perf_counter()
    print(f"moment probe: ({rows}, {COLS}) bf16 per cell, spike at step 1, s for {hold} steps then 0, "
          f"{steps} steps")
    print(f"AdamW lr {HYPER['lr']:g}, betas {HYPER['betas']}, eps {HYPER['eps']:g}, weight decay "
          f"{HYPER['weight_decay']:g}; other gradients 0; {args.implementation}")
    print(f"cell: mean over {rows} rows of the small element's |movement| / torch AdamW fp32's; "
          f"*: outside {LOW}-{HIGH}")
    ref, _, _ = run_mode("torch", cells, rows, steps, hold, args.implementation)
    results = {m: run_mode(m, cells, rows, steps, hold, args.implementation)[0] for m in modes}
    header = f"{'mode':<8} {'s':>6} " + "".join(f"{'spike=' + fmt_num(sp):>12}" for sp in spikes)
    print()
    print(header)
    print("-" * len(header))
    outside = {}
    for m in modes:
        outside[m] = 0
        for s in s_values:
            line = f"{m:<8} {fmt_num(s):>6} "
            for sp in spikes:
                i = cells.index((s, sp))
                ratio = float((results[m][i] / ref[i]).mean())
                bad = not (LOW <= ratio <= HIGH)
                outside[m] += bad
                line += f"{ratio:>11.3f}{'*' if bad else ' '}"
            print(line.rstrip())
    print()
    print("cells outside [0.95, 1.05]: " + ", ".join(f"{m} {outside[m]} of {len(cells)}" for m in modes))
    print("the reference's movement of the small element (mean over rows, spike 1):")
    print("  " + "  ".join(f"s={fmt_num(s)} {float(ref[cells.index((s, spikes[0]))].mean()):.4f}" for s in s_values))
    if "fp32" in modes:
        dev = max(float((results["fp32"][i] / ref[i] - 1).abs().max()) for i in range(len(cells)))
        print(f"fp32 mode against torch AdamW: largest |ratio - 1| of any row {dev:.1e}")
    if args.check:
        cell = (1e-4, 100.0)  # the 0.14
        for m in [m for m in modes if m != "fp32"]:
            ok = check_one_cell(m, cell, cells, rows, steps, hold, args.implementation)
            print(f"check {m}: cell s={fmt_num(cell[0])}, spike={fmt_num(cell[1])} stepped beside the others "
                  f"{'is bitwise' if ok else 'DIFFERS from'} the cell stepped alone")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
