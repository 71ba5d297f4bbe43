"""Reporting for ``halfadam train``: the lines that open a run, the comparison of every mode with float32,
the results table, ``metrics.json`` and the loss plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .config import TrainConfig
from .models import relative_distance

__all__ = ["compare_with_fp32", "format_table", "plot_losses", "print_header", "write_metrics"]


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
        print(f"  data-parallel: {world} processes ({how}, {backend}), {cfg.batch_size // world} per process "
              f"per step")
    elif cfg.dist == "fsdp":
        print("  --dist fsdp in one process: nothing is sharded (start N processes with --nproc N or torchrun); "
              "checkpoints are DCP directories all the same")
    print(f"  train: {cfg.steps} steps x {cfg.batch_size}, AdamW lr {cfg.lr:g} ({sched}), "
          f"weight decay {cfg.weight_decay:g}, seed {cfg.seed}; modes: {', '.join(cfg.modes)}", flush=True)
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


#: Line style per mode, so every plot reads the same way; fp32 is a wide grey band under the others.
_STYLE = {
    "fp32": dict(color="black", ls="-", lw=4.0, alpha=0.3, zorder=1),
    "fp16-naive": dict(color="tab:red", ls="--"),
    "bf16-naive": dict(color="tab:orange", ls="--"),
    "fp16-halfadam": dict(color="tab:blue", ls="-"),
    "bf16-halfadam": dict(color="tab:green", ls=":"),
    "bf16-halfadam-compact": dict(color="tab:cyan", ls="-."),
    "bf16-halfadam-tiny": dict(color="tab:gray", ls=(0, (3, 1, 1, 1))),
    # --peers (halfadam.cli.peers)
    "bf16-optimi-kahan": dict(color="tab:purple", ls="-."),
    "bf16-torchao-sr": dict(color="tab:brown", ls="-."),
    "bf16-torchao-8bit": dict(color="tab:pink", ls="-."),
    "bf16-bnb-8bit": dict(color="tab:olive", ls="-."),
}


def _style(name: str, markers: bool = False) -> dict:
    style = {"lw": 1.4, "zorder": 2, **_STYLE.get(name, {})}
    if markers:
        style.update(marker="o", ms=3)
    return style


def _num(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a" if value is None else str(value)
    return format(value, fmt)


def format_table(results: dict[str, dict]) -> str:
    """A plain-text table with one row per mode, followed by a legend of the columns."""
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

    out = [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]
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


def plot_losses(results: dict[str, dict], path: Path, title: str = "") -> Path:
    """Plot train loss (smoothed), validation loss, and validation loss relative to fp32 per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_ref = "fp32" in results
    fig, axes = plt.subplots(1, 3 if has_ref else 2, figsize=(16 if has_ref else 11, 4.8))
    ax_train, ax_val = axes[0], axes[1]
    curves: dict = {}
    for name, m in results.items():
        label = name if m["diverged_at_step"] is None else f"{name} (nan after step {m['diverged_at_step']})"
        steps = range(1, len(m["train_loss"]) + 1)
        window = max(1, len(m["train_loss"]) // 30)
        m_smooth = _smooth(m["train_loss"], window)
        ax_train.plot(steps, m_smooth, label=label, **_style(name))
        ax_val.plot(m["val_steps"], m["val_loss"], label=label, **_style(name, markers=True))
        curves.setdefault(ax_train, []).extend(m_smooth)
        curves.setdefault(ax_val, []).extend(m["val_loss"])
    for ax, values in curves.items():  # a diverged mode must not squash the others
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            lo, hi = min(finite), max(finite)
            pad = 0.05 * (hi - lo or 1.0)
            ax.set_ylim(lo - pad, hi + pad)
    ax_train.set(title="train loss (moving average)", xlabel="step", ylabel="cross-entropy")
    ax_val.set(title="validation loss", xlabel="step", ylabel="cross-entropy")
    if has_ref:
        ax_rel = axes[2]
        ref = dict(zip(results["fp32"]["val_steps"], results["fp32"]["val_loss"]))
        for name, m in results.items():
            pts = [(s, 100 * (v - ref[s]) / ref[s]) for s, v in zip(m["val_steps"], m["val_loss"])
                   if s in ref and math.isfinite(v)]
            if pts:
                ax_rel.plot(*zip(*pts), label=name, **_style(name, markers=True))
        ax_rel.axhline(0, color="grey", lw=0.8)
        ax_rel.set(title="validation loss vs fp32 (%)", xlabel="step", ylabel="% above fp32")
    for ax in axes:
        ax.grid(alpha=0.3)
    ax_val.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
