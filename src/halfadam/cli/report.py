"""Reporting for ``halfadam train``: the lines that open a run, the comparison of every mode with float32,
the results table, ``metrics.json`` and the loss plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .config import TrainConfig
from .models import relative_distance
from .optimizers import ALGORITHMS

__all__ = ["compare_with_fp32", "format_table", "memory_lines", "optimizer_line", "plot_losses", "plot_title",
           "print_header", "table_title", "write_metrics"]


def print_header(cfg: TrainConfig, device: torch.device, world: int, data_line: str, model_line: str, n_params: int,
                 skipped: list[str], fresh: list[str]) -> None:
    """Print what the run trains and how: task, device, data, model, processes, steps and modes, the peers
    skipped (``skipped``, one line each) and the modes ``--resume`` starts from scratch (``fresh``)."""
    compute = "float32 compute, weights stored per mode" if device.type == "cpu" else "compute in the parameter dtype"
    print(f"halfadam train: {cfg.task} on {device} ({compute})")
    print(f"  data:  {data_line}")
    print(f"  model: {model_line}, {n_params:,} parameters")
    sched = "constant" if cfg.lr_schedule == "constant" else f"cosine, {cfg.warmup_steps} warm-up steps"
    if world > 1:
        backend = torch.distributed.get_backend()
        how = "DDP" if cfg.dist == "ddp" else "FSDP2: parameters, gradients and optimizer state sharded"
        if cfg.offload:
            how += f", offloaded to the host (CPUOffloadPolicy, pin_memory={device.type == 'cuda'})"
        print(f"  data-parallel: {world} processes ({how}, {backend}), {cfg.batch_size // world} per process "
              f"per step")
    elif cfg.offload:
        print(f"  --offload {cfg.offload} in one process: FSDP2 on a one-rank process group, parameters, gradients "
              f"and optimizer state on the host (CPUOffloadPolicy, pin_memory={device.type == 'cuda'})")
    elif cfg.dist == "fsdp":
        print("  --dist fsdp in one process: nothing is sharded (start N processes with --nproc N or torchrun); "
              "checkpoints are DCP directories all the same")
    momentum = f", momentum {cfg.momentum:g}" if cfg.momentum is not None else ""
    print(f"  train: {cfg.steps} steps x {cfg.batch_size}, {ALGORITHMS[cfg.optimizer].title} lr {cfg.lr:g} ({sched})"
          f"{momentum}, weight decay {cfg.weight_decay:g}, seed {cfg.seed}; modes: {', '.join(cfg.modes)}", flush=True)
    for line in skipped:
        print(f"  {line}", flush=True)
    if fresh:
        print(f"  resume: from {cfg.resume}; no checkpoint yet, so from scratch: {', '.join(fresh)}", flush=True)


def compare_with_fp32(results: dict[str, dict], weights: dict[str, tuple]) -> None:
    """Add to every mode's metrics in ``results`` its distance to the fp32 mode's final weights (of its final
    weights and, where it has them, its master weights) and its final validation loss relative to fp32's.

    ``weights``: per mode, ``(final weights, master weights or None)`` as :func:`~halfadam.cli.loop.train_mode`
    returns them. Without an fp32 mode, or for a diverged mode, the weight distance and the relative loss are
    ``None`` and the master weights' distance is left out.
    """
    ref = weights.get("fp32")
    for name, metrics in results.items():
        final, masters = weights[name]
        ok = metrics["diverged_at_step"] is None
        metrics["weight_distance_to_fp32"] = relative_distance(final, ref[0]) if ref and ok else None
        if masters is not None and ref:
            metrics["master_weight_distance_to_fp32"] = relative_distance(masters, ref[0])
        if "fp32" in results and ok:
            ref_val = results["fp32"]["final_val_loss"]
            metrics["val_loss_vs_fp32_percent"] = 100 * (metrics["final_val_loss"] - ref_val) / ref_val
        else:
            metrics["val_loss_vs_fp32_percent"] = None


#: Line style per mode, so every plot reads the same way: colour, line style and (on the validation points)
#: marker differ between modes; fp32 is a wide grey band under the others.
_STYLE = {
    "fp32": dict(color="black", ls="-", lw=4.0, alpha=0.3, zorder=1),
    "fp16-naive": dict(color="tab:red", ls="--", marker="x"),
    "bf16-naive": dict(color="tab:orange", ls="--", marker="x"),
    "fp16-halfadam": dict(color="tab:blue", ls="-", marker="o"),
    "bf16-halfadam": dict(color="tab:green", ls=":", marker="s"),
    "bf16-halfadam-compact": dict(color="tab:cyan", ls="-.", marker="^"),
    "bf16-halfadam-tiny": dict(color="tab:purple", ls=(0, (6, 1.5, 1, 1.5, 1, 1.5)), marker="D"),
    # --peers (halfadam.cli.peers)
    "bf16-optimi-kahan": dict(color="indigo", ls="-.", marker="v"),
    "bf16-torchao-sr": dict(color="tab:brown", ls="-.", marker="v"),
    "bf16-torchao-8bit": dict(color="tab:pink", ls="-.", marker="v"),
    "bf16-bnb-8bit": dict(color="tab:olive", ls="-.", marker="v"),
}


def _style(name: str, markers: bool = False) -> dict:
    style = {"lw": 1.6, "zorder": 2, "marker": "o", **_STYLE.get(name, {})}
    if markers:
        style["ms"] = 4
    else:
        style.pop("marker")
    return style


def _num(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a" if value is None else str(value)
    return format(value, fmt)


def optimizer_line(cfg: TrainConfig) -> str:
    """The rule and its hyperparameters: ``SGD (lr 0.02, momentum 0.9, weight decay 0.0001)``."""
    momentum = f", momentum {cfg.momentum:g}" if cfg.momentum is not None else ""
    return f"{ALGORITHMS[cfg.optimizer].title} (lr {cfg.lr:g}{momentum}, weight decay {cfg.weight_decay:g})"


def table_title(cfg: TrainConfig) -> str:
    """The line above the table: the rule and which optimizer the fp32, naive and halfadam modes ran."""
    a = ALGORITHMS[cfg.optimizer]
    note = f" ({a.reference_note})" if a.reference_note else ""
    return f"optimizer: {optimizer_line(cfg)}; fp32: {a.reference}{note}; naive: {a.naive}; halfadam: {a.halfadam}"


def plot_title(cfg: TrainConfig, model_line: str) -> str:
    """The loss plot's title: the task, the rule and the model."""
    return f"halfadam train: {cfg.task}, {optimizer_line(cfg)}\n{model_line}"


def format_table(results: dict[str, dict], title: str | None = None) -> str:
    """A plain-text table with one row per mode, followed by a legend of the columns; ``title`` (the rule,
    :func:`table_title`), where given, on a line above it."""
    header = ["mode", "train loss", "val loss", "val vs fp32", "dist to fp32", "state B/param", "ms/step"]
    rows = []
    for name, m in results.items():
        if m["diverged_at_step"] is not None:
            val = f"nan@{m['diverged_at_step']}"
        else:
            val = _num(m["final_val_loss"], ".4f")
        delta = m.get("val_loss_vs_fp32_percent")
        rows.append([
            name,
            _num(m["final_train_loss"], ".4f"),
            val,
            "n/a" if delta is None else f"{delta:+.2f}%",
            _num(m.get("weight_distance_to_fp32"), ".2e"),
            _num(m["optimizer_state_bytes_per_param"], ".2f"),
            _num(m["mean_step_ms"], ".1f"),
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [*([title] if title else []), line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]
    for name, m in results.items():
        if m["diverged_at_step"] is not None:
            why = f" ({m['divergence_note']})" if m.get("divergence_note") else ""
            k = m["diverged_at_step"]
            out.append(f"{name}: loss not finite after {k} step{'s' * (k != 1)}, stopped{why}")
    out.append(
        "train loss: mean of the last 10 steps; val loss: fixed held-out set; dist: ||w - w_fp32|| / ||w_fp32||\n"
        "of the final weights; state: bytes of optimizer.state tensors per parameter element (what a tensor\n"
        "subclass stores, shared tensors once); ms/step: mean forward+backward+step time, leaving out the\n"
        "first step (state allocation, compilation)."
    )
    return "\n".join(out)


def memory_lines(results: dict[str, dict]) -> list[str]:
    """``--offload``: one line per mode with the host and device bytes per parameter its run added, measured
    (:class:`halfadam.cli.memory.MemoryProbe`); none without ``--offload``."""
    measured = {name: m["memory_measured"] for name, m in results.items() if m.get("memory_measured")}
    if not measured:
        return []
    width = max(len(name) for name in measured)
    lines = []
    for name, mem in measured.items():
        host = mem["host_bytes_per_param"]
        host_text = "n/a (no /proc/self/status)" if host is None else f"{host:.2f} B/param"
        if mem["device_bytes_per_param"] is None:
            device_text = "the host (CPU run)"
        else:
            device_text = f"{mem['device_bytes_per_param']:.2f} B/param (torch.cuda.max_memory_allocated)"
        procs = f", {mem['processes']} processes summed" if mem["processes"] > 1 else ""
        lines.append(f"{name:<{width}}  measured: host {host_text} (VmRSS added after {mem['after_steps']} "
                     f"step{'s' * (mem['after_steps'] != 1)}{procs}), device {device_text}")
    return lines


def _jsonable(value):
    """Replace non-finite floats (invalid JSON) with ``None``, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_metrics(summary: dict, path: Path) -> Path:
    """Write ``summary`` as strict JSON (NaN and infinity become ``null``) and return the path."""
    path.write_text(json.dumps(_jsonable(summary), indent=1, allow_nan=False) + "\n")
    return path


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (non-finite values pass through as gaps)."""
    out, acc, buf = [], 0.0, []
    for v in values:
        if not math.isfinite(v):
            out.append(float("nan"))
            continue
        buf.append(v)
        acc += v
        if len(buf) > window:
            acc -= buf.pop(0)
        out.append(acc / len(buf))
    return out


#: The loss plot: 8 x 7 inches at 200 dpi, so 1600 px wide. The docs show it at their content width (about
#: 700-800 px), where its 11-point text is 13-15 px tall; a high-DPI screen gets the full resolution.
PLOT_INCHES = (8.0, 7.0)
PLOT_DPI = 200
_FONTS = {"font.size": 11, "axes.titlesize": 12, "legend.fontsize": 11, "figure.titlesize": 12}


def _kind(name: str, m: dict) -> str:
    """``"fp32"`` (the reference), ``"halfadam"``, ``"naive"`` (the rule's optimizer on half parameters without
    a master: torch.optim.AdamW, torch.optim.SGD, the naive Lion) or ``"peer"``: from the mode's ``optimizer``
    entry, or from its name where that is missing."""
    optimizer = m.get("optimizer") or ""
    if name == "fp32":
        return "fp32"
    if optimizer in {a.halfadam for a in ALGORITHMS.values()} or (not optimizer and "halfadam" in name):
        return "halfadam"
    if optimizer in {a.naive for a in ALGORITHMS.values()} or (not optimizer and "naive" in name):
        return "naive"
    return "peer"


def _gaps(results: dict[str, dict]) -> dict[str, list[tuple[int, float]]]:
    """Per mode but fp32: its validation loss relative to fp32's, in %, at the steps where both are finite."""
    ref = {s: v for s, v in zip(results["fp32"]["val_steps"], results["fp32"]["val_loss"]) if math.isfinite(v) and v}
    return {name: [(s, 100 * (v - ref[s]) / ref[s]) for s, v in zip(m["val_steps"], m["val_loss"])
                   if s in ref and math.isfinite(v)]
            for name, m in results.items() if name != "fp32"}


def _label(name: str, m: dict, gaps: dict) -> str:
    """The legend's entry: the mode and how it ended (NaN after step k, or its final gap to fp32)."""
    if m["diverged_at_step"] is not None:
        return f"{name} (nan after step {m['diverged_at_step']})"
    if name == "fp32" and math.isfinite(m["final_val_loss"]):
        return f"fp32 (val loss {m['final_val_loss']:.3f})"
    delta = m.get("val_loss_vs_fp32_percent")
    if delta is None and gaps.get(name):
        delta = gaps[name][-1][1]
    return name if delta is None else f"{name} ({delta:+.2f}%)"


def _plot_train(ax, results: dict[str, dict]) -> None:
    """Every mode's train loss, a trailing moving average over 1/30 of the run; the y-range from the finite
    values only, so that a diverged mode does not squash the others."""
    finite = []
    for name, m in results.items():
        window = max(1, len(m["train_loss"]) // 30)
        smooth = _smooth(m["train_loss"], window)
        ax.plot(range(1, len(smooth) + 1), smooth, **_style(name))
        finite += [v for v in smooth if math.isfinite(v)]
    if finite:
        lo, hi = min(finite), max(finite)
        pad = 0.05 * (hi - lo or 1.0)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set(title="train loss (moving average)", xlabel="step", ylabel="cross-entropy")


def _plot_gaps(ax, gaps: dict, names: list[str]) -> None:
    """The validation loss gap to fp32 of the modes ``names``, over fp32 as the line at 0."""
    ax.axhline(0, **{**_style("fp32"), "zorder": 1})
    for name in names:
        if gaps[name]:
            ax.plot(*zip(*gaps[name]), **_style(name, markers=True))
    ax.set(xlabel="step", ylabel="% above fp32")


def _plot_zoom(ax, results: dict[str, dict], gaps: dict, names: list[str]) -> None:
    """The gap panel of the modes that track fp32 (``names``: halfadam's and the peers'): its y-range set by
    halfadam's modes alone (by all of ``names`` without them), so a naive mode's percents cannot hide
    halfadam's hundredths; a peer off that scale is clipped and named in a note."""
    _plot_gaps(ax, gaps, names)
    own = [n for n in names if _kind(n, results[n]) == "halfadam"] or names
    values = [g for n in own for _, g in gaps[n]]
    if values:
        lo, hi = min(0.0, *values), max(0.0, *values)
        pad = max(0.12 * (hi - lo), 0.005)
        ax.set_ylim(lo - pad, hi + pad)
        off = [f"{n} ({min(g for _, g in gaps[n]):+.2f}% to {max(g for _, g in gaps[n]):+.2f}%)" for n in names
               if any(not lo - pad <= g <= hi + pad for _, g in gaps[n])]
        if off:
            ax.text(0.01, 0.03, "off this scale: " + ", ".join(off), transform=ax.transAxes, fontsize=10,
                    va="bottom", bbox=dict(facecolor="white", alpha=0.8, lw=0))
    ax.set_title("halfadam vs fp32: validation loss gap, on its own scale")


def plot_losses(results: dict[str, dict], path: Path, title: str = "") -> Path:
    """Plot every mode's train loss (moving average) and, with an fp32 mode, every mode's validation loss
    relative to fp32's, then that gap once more for halfadam's modes (and the peers) at a scale set by
    halfadam's modes, where hundredths of a percent show; one legend below, with each mode's final gap.

    The figure is :data:`PLOT_INCHES` at :data:`PLOT_DPI` (1600 px wide), for a page about 800 px wide.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    gaps = _gaps(results) if "fp32" in results else {}
    zoom = [n for n in gaps if _kind(n, results[n]) in ("halfadam", "peer")]
    layout = [["train", "all"], ["zoom", "zoom"]] if zoom else [["train", "all"]] if gaps else [["train"]]
    height = PLOT_INCHES[1] if zoom else PLOT_INCHES[1] * 0.6
    with plt.rc_context(_FONTS):
        fig, axes = plt.subplot_mosaic(layout, figsize=(PLOT_INCHES[0], height), layout="constrained")
        _plot_train(axes["train"], results)
        if gaps:
            _plot_gaps(axes["all"], gaps, list(gaps))
            axes["all"].set_title("validation loss vs fp32 (%)")
        if zoom:
            _plot_zoom(axes["zoom"], results, gaps, zoom)
        for ax in axes.values():
            ax.grid(alpha=0.3)
        handles = [Line2D([], [], **_style(name, markers=name != "fp32")) for name in results]
        fig.legend(handles, [_label(name, m, gaps) for name, m in results.items()], loc="outside lower center",
                   ncol=2, frameon=False, handlelength=4)
        if title:
            fig.suptitle(title)
        fig.savefig(path, dpi=PLOT_DPI)
        plt.close(fig)
    return path
