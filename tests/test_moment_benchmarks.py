"""benchmarks/moment_probe.py and benchmarks/moment_bias.py (issue 36 item 4), run with --quick."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args], capture_output=True,
                            text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert all(len(line) <= 100 for line in out.splitlines()), out
    return out


def _rows(out: str, first: str) -> dict:
    """The table whose header line starts with ``first``: {(mode, key): [cells]}."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    rows = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        if set(line) <= {"-"} or not line.split()[0] in ("fp32", "bf16", "compact", "tiny"):
            continue
        cells = line.split()
        rows.setdefault(cells[0], []).append(cells[1:])
    return rows


def test_moment_probe_quick():
    out = _run("moment_probe.py", "--implementation", "foreach", "--check")
    header = next(line for line in out.splitlines() if line.startswith("mode"))
    assert header.split() == ["mode", "s", "spike=1", "spike=1e2"]
    rows = _rows(out, "mode")
    assert list(rows) == ["fp32", "bf16", "compact", "tiny"]
    assert all([r[0] for r in rows[m]] == ["1e-2", "1e-4"] for m in rows)  # the quick grid's s
    assert all(len(r) == 3 for m in rows for r in rows[m])
    assert all(cell == "1.000" for r in rows["fp32"] for cell in r[1:])  # fp32 state: torch AdamW's movement
    for r in rows["compact"]:  # a cell is a ratio, marked outside [0.95, 1.05]
        for cell in r[1:]:
            value = float(cell.rstrip("*"))
            assert cell.endswith("*") == (not 0.95 <= value <= 1.05)
    assert "cells outside [0.95, 1.05]: fp32 0 of 4, bf16 0 of 4" in out
    assert out.count("is bitwise the cell stepped alone") == 3  # bf16, compact, tiny


def test_moment_bias_quick():
    out = _run("moment_bias.py", "--implementation", "foreach")
    main = _rows(out, "mode        samples")
    assert list(main) == ["fp32", "bf16", "compact", "tiny"]
    assert all(len(main[m]) == 1 and len(main[m][0]) == 9 for m in main)
    fp32 = main["fp32"][0]
    assert fp32[1:8] == ["+0.000%"] * 4 + ["+0.000%", "0.00%", "+0.000%"]  # the shadow is fp32's own state
    assert int(main["compact"][0][0].replace(",", "")) > 0
    assert float(main["compact"][0][6].rstrip("%")) > 0  # noise in the 8-bit v
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mode") and "0-8" in line)
    assert lines[start].split() == ["mode", "0-8", "8-19", "19-29", ">=29"]
    bins = {}
    for line in lines[start + 2:start + 2 + 3 * 4]:  # share, bias, v part per mode
        mode, what, cells = line[:8].strip(), line[9:17].strip(), line[17:].split()
        assert len(cells) == 4
        bins[mode, what] = cells
    assert sorted({m for m, _ in bins}) == ["bf16", "compact", "fp32", "tiny"]
    assert all(cell in ("+0.000%", "-") for what in ("bias", "v part") for cell in bins["fp32", what])
    shares = [float(c.rstrip("%")) for c in bins["compact", "share"]]
    assert abs(sum(shares) - 100) < 0.01
