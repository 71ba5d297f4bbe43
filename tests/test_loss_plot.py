"""The loss plot (``halfadam.cli.report.plot_losses``, ``loss.png``) and the script that regenerates
``docs/loss.png`` (``tools/make_loss_plot.py``), on synthetic results shaped as ``halfadam train``'s."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import struct
from pathlib import Path

import matplotlib
import matplotlib.figure
import pytest
from matplotlib.lines import Line2D
from matplotlib.text import Text

from halfadam.cli.report import plot_losses, write_metrics

ROOT = Path(__file__).resolve().parents[1]
VAL_STEPS = list(range(0, 801, 80))
#: Final validation loss gap to fp32 (%) per mode, as in a default char-lm run: halfadam's within
#: hundredths of a percent, naive bf16 5% above, naive fp16 NaN after one step.
GAPS = {"fp32": 0.0, "fp16-naive": None, "bf16-naive": 5.0, "fp16-halfadam": -0.004, "bf16-halfadam": -0.012,
        "bf16-halfadam-compact": -0.06, "bf16-halfadam-tiny": 0.07}
HALFADAM = [n for n in GAPS if "halfadam" in n]
#: The docs site's content column (mkdocs material) is 690-800 px; text must be 11 px there at least.
PAGE_PX = 690


def _mode(name: str, gap: float | None) -> dict:
    """One mode's entry as ``halfadam train`` passes it (after ``compare_with_fp32``): its gap grows
    linearly over the run to ``gap`` %."""
    ref = [1.93 + 2.7 * math.exp(-s / 60) for s in VAL_STEPS]
    optimizer = "halfadam.AdamW" if "halfadam" in name else "torch.optim.AdamW"
    if gap is None:  # NaN from the first step on
        return {"optimizer": optimizer, "diverged_at_step": 1, "train_loss": [math.nan], "val_steps": [0, 1],
                "val_loss": [ref[0], math.nan], "final_val_loss": math.nan, "val_loss_vs_fp32_percent": None}
    val = [v * (1 + gap / 100 * s / VAL_STEPS[-1]) for s, v in zip(VAL_STEPS, ref)]
    train = [2.0 + 2.6 * math.exp(-i / 60) * (1 + gap / 100 * i / 800) + 0.01 * (i % 7) for i in range(800)]
    return {"optimizer": optimizer, "diverged_at_step": None, "train_loss": train, "val_steps": VAL_STEPS,
            "val_loss": val, "final_val_loss": val[-1], "val_loss_vs_fp32_percent": gap}


def _results(gaps: dict = GAPS) -> dict:
    return {name: _mode(name, gap) for name, gap in gaps.items()}


def _expected_gap(name: str, results: dict) -> list[float]:
    ref = results["fp32"]["val_loss"]
    return [100 * (v - r) / r for v, r in zip(results[name]["val_loss"], ref)]


@pytest.fixture
def saved(monkeypatch):
    """The figures ``plot_losses`` saves, kept (``Figure.savefig`` wrapped) for the test to read."""
    figures = []
    original = matplotlib.figure.Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return figures


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _draws(ax, values: list[float]) -> bool:
    """Whether ``ax`` has a line through ``values`` (its y data, in order)."""
    return any(len(line.get_ydata()) == len(values)
               and all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) for a, b in zip(line.get_ydata(), values))
               for line in ax.get_lines())


def test_the_gap_panel_is_on_halfadams_scale(tmp_path, saved):
    """1600 px wide (8 in at 200 dpi: text 11 px or more at the docs' width), every mode in the legend
    with its own colour and line style, and a panel that draws every halfadam mode's gap to fp32 on a
    y-range set by those gaps (+-0.07% here), not by naive bf16's 5%: the old plot's third panel ran from
    -0.3% to 5.3%, its 16-inch figure 1760 px wide with 6 px text at 690 px."""
    results = _results()
    path = plot_losses(results, tmp_path / "loss.png", title="halfadam train: char-lm, CharGPT")
    assert _png_size(path)[0] == 1600
    (fig,) = saved
    inches = fig.get_size_inches()[0]
    small = [(t.get_text(), t.get_fontsize()) for t in fig.findobj(Text) if t.get_visible() and t.get_text()
             and t.get_fontsize() / 72 * PAGE_PX / inches < 11]
    assert not small, f"text under 11 px at {PAGE_PX} px: {small}"

    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    entries = {t.get_text().split(" (")[0]: h for lg in legends for t, h in zip(lg.get_texts(), lg.legend_handles)}
    assert set(entries) == set(GAPS)
    looks = {(matplotlib.colors.to_hex(h.get_color()), str(h.get_linestyle())) for h in entries.values()
             if isinstance(h, Line2D)}
    assert len(looks) == len(GAPS), "two modes look the same"

    curves = {name: _expected_gap(name, results) for name in HALFADAM}
    panels = [ax for ax in fig.axes if all(_draws(ax, c) for c in curves.values())]
    assert panels, "no panel draws the halfadam modes' gaps to fp32"
    lo_gap, hi_gap = min(min(c) for c in curves.values()), max(max(c) for c in curves.values())
    spans = []
    for ax in panels:
        lo, hi = ax.get_ylim()
        spans.append(hi - lo)
        if lo <= lo_gap and hi_gap <= hi and hi - lo <= 2 * (hi_gap - lo_gap):
            break
    else:
        pytest.fail(f"the halfadam gaps ({lo_gap:+.3f}% to {hi_gap:+.3f}%) only show on y-ranges {spans} wide")
    assert any(_draws(ax, _expected_gap("bf16-naive", results)) for ax in fig.axes), "naive bf16 is on no panel"


def test_a_peer_off_halfadams_scale_is_named(tmp_path, saved):
    """A peer far from fp32 does not stretch the gap panel: it is clipped and named in a note."""
    results = _results({**GAPS, "bf16-bnb-8bit": 1.5})
    results["bf16-bnb-8bit"]["optimizer"] = "bitsandbytes.optim.AdamW8bit"
    plot_losses(results, tmp_path / "loss.png")
    zoom = [ax for ax in saved[0].axes if "own scale" in ax.get_title()][0]
    assert zoom.get_ylim()[1] < 0.2
    assert any("off this scale: bf16-bnb-8bit" in t.get_text() for t in zoom.texts)


def test_without_fp32_one_panel(tmp_path, saved):
    """Without an fp32 mode there is no gap to draw: the train loss alone, as wide."""
    results = _results({"bf16-naive": 5.0, "bf16-halfadam-tiny": 0.07})
    assert _png_size(plot_losses(results, tmp_path / "loss.png"))[0] == 1600
    assert len(saved[0].axes) == 1


def test_make_loss_plot_from_a_run(tmp_path):
    """tools/make_loss_plot.py --from DIR reads a run's metrics.json (NaN written as null) and writes the plot."""
    summary = {"halfadam_version": "0", "torch_version": "2", "wall_time_s": 175.0,
               "config": {"task": "char-lm", "steps": 800, "batch_size": 16, "seed": 0},
               "model": {"description": "CharGPT: 2 pre-LN blocks"}, "modes": _results()}
    write_metrics(summary, tmp_path / "metrics.json")
    spec = importlib.util.spec_from_file_location("make_loss_plot", ROOT / "tools" / "make_loss_plot.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert script.main(["--from", str(tmp_path), "--png", str(tmp_path / "plot.png")]) == 0
    assert _png_size(tmp_path / "plot.png")[0] == 1600
    text = out.getvalue()
    assert "fp16-naive" in text and "val loss     nan" in text and "bf16-halfadam-tiny" in text and "+0.070%" in text
