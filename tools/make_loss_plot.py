"""Regenerate ``docs/loss.png``, the loss plot of the docs and the front page.

Usage (from the repository root):

    python tools/make_loss_plot.py                 # runs `halfadam train` (all defaults) into runs/loss-plot
    python tools/make_loss_plot.py --from DIR      # plots the run in DIR (its metrics.json), trains nothing
    python tools/make_loss_plot.py -- --task digits   # what follows -- goes to `halfadam train`

The default run is the docs' char-lm run: 800 steps x 16 in seven modes, 3 to 5 minutes on 2 CPU
cores. The plot is :func:`halfadam.cli.report.plot_losses`, the same as ``halfadam train`` writes
to ``loss.png``. The script ends with what the docs quote about the run: the date, the machine, the
wall time and each mode's final validation loss and gap to fp32.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from halfadam.cli.report import plot_losses  # noqa: E402


def _nan(value):
    """metrics.json's ``null`` back to the NaN it was (in a mode's curves and figures), recursively."""
    if value is None:
        return float("nan")
    if isinstance(value, list):
        return [_nan(v) for v in value]
    return value


def read_run(out: Path) -> dict:
    """The summary that ``halfadam train`` wrote to ``out/metrics.json``, each mode's losses as floats
    (NaN where the JSON has ``null``)."""
    summary = json.loads((out / "metrics.json").read_text())
    for m in summary["modes"].values():
        for key in ("train_loss", "val_loss", "final_train_loss", "final_val_loss"):
            if key in m:
                m[key] = _nan(m[key])
    return summary


def train(out: Path, extra: list[str]) -> float:
    """Run ``halfadam train --out out`` (and ``extra``) from this checkout; return its wall time in s."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "halfadam", "train", "--out", str(out), *extra], env=env, check=True)
    return time.perf_counter() - started


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def describe(summary: dict) -> str:
    """What the docs quote about the run: its size, versions, wall time and every mode's final figures."""
    cfg = summary["config"]
    lines = [f"{cfg['task']}: {cfg['steps']} steps x {cfg['batch_size']}, seed {cfg['seed']}; "
             f"halfadam {summary.get('halfadam_version')}, torch {summary.get('torch_version')}; "
             f"training {summary['wall_time_s']:.0f} s"]
    for name, m in summary["modes"].items():
        delta = m.get("val_loss_vs_fp32_percent")
        val = "nan" if not math.isfinite(m["final_val_loss"]) else f"{m['final_val_loss']:.4f}"
        lines.append(f"  {name:24s} val loss {val:>7s}  vs fp32 " + ("n/a" if delta is None else f"{delta:+.3f}%"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, help="plot this run's metrics.json; train nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "loss-plot", help="where the run goes")
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "loss.png", help="the plot (docs/loss.png)")
    args = parser.parse_args(own)
    if args.source is None:
        wall = train(args.out, extra)
        print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {_machine()}: "
              f"halfadam train took {wall:.0f} s wall")
    elif extra:
        parser.error("arguments after -- go to halfadam train, which --from does not run")
    summary = read_run(args.source or args.out)
    title = f"halfadam train: {summary['config']['task']}, {summary['model']['description']}"
    print(describe(summary))
    print(f"wrote {plot_losses(summary['modes'], args.png, title=title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
