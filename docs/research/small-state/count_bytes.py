"""Exact state bytes per parameter of the prototype formats on benchmarks/state_bytes.py's architectures
(per element and per block of 128 of a row, a short last block counted as one; Vfac: one fp32 per row
and per column of the (rows, rest) matrix; 1-D parameters keep 12 B fp32 state; each parameter's
4-byte step included). Columns: all parameters, and >= 2-D parameters only (without steps).

  python3 docs/research/small-state/count_bytes.py
"""
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "benchmarks"))
sys.path.insert(0, str(HERE.parents[2] / "src"))
sys.path.insert(0, str(HERE))
import state_bytes as SB  # noqa: E402  (benchmarks/state_bytes.py: the architectures' shapes)
import codecs_ as C  # noqa: E402

FORMATS = [("M16", "m8", "V8"), ("M8sr", "m8", "V8"), ("M16", "m4", "V8"), ("M16", "m8", "V4log1"),
           ("M8sr", "m8", "V4log1"), ("M8sr", "m8", "Vfac"), ("M8sr", "m4", "V4log1"), ("M8sr", "m4", "Vfac")]


def main():
    print("| architecture | library compact | " + " | ".join(":".join(f) for f in FORMATS) + " |")
    print("|---" * (len(FORMATS) + 2) + "|")
    for arch, shapes_fn in SB.ARCHITECTURES.items():
        shapes = shapes_fn()
        n = sum(math.prod(s) for s in shapes)
        s2 = [s for s in shapes if len(s) >= 2]
        n2 = sum(math.prod(s) for s in s2)
        cells = [f"{SB.state_bytes(shapes, 'compact')[0]:.3f}"]
        for f in FORMATS:
            allb = sum(C.state_bytes(s, *f) + 4 for s in shapes) / n
            b2 = sum(C.state_bytes(s, *f) for s in s2) / n2
            cells.append(f"{allb:.3f} / {b2:.3f}")
        print(f"| {arch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
