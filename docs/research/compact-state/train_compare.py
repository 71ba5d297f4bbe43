"""Train halfadam's main job (char-lm / digits) with compact-state AdamW variants and compare with fp32.

Uses the CLI's own data, model, batch plan and training loop (halfadam.cli.train.train_mode), so the
numbers compare with `halfadam train`'s table. Modes:
  fp32                 torch.optim.AdamW on fp32 params (reference; cached per task/steps)
  bf16-halfadam        halfadam.AdamW (default implementation) on bf16 params
  bf16-halfadam-ref    halfadam.AdamW(implementation="reference")
  C:<master>:<m>:<v>   this prototype: per-tensor loop around halfadam.functional.adam_update_ on bf16 params,
                       master in {fp32 (fp32 copy + sync_master_), split (bf16 param + int16 low bits)},
                       m / v codecs from moments.py (fp32, bf16, lin8s-128, dyn8u-2048, sqrt8-128, log8-128, ...)

Example:
  PYTHONPATH=src nice -n 10 python3 train_compare.py --task digits --modes fp32,C:split:fp32:fp32
Results are appended to results/<task>-<steps>.jsonl; final weights go to cache/.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import halfadam  # noqa: E402
from halfadam.cli import train as T  # noqa: E402
from halfadam.cli.models import relative_distance  # noqa: E402
from halfadam.cli.modes import MODES, Mode  # noqa: E402
from halfadam.functional import adam_update_, sync_master_  # noqa: E402

import moments  # noqa: E402
import split  # noqa: E402

HERE = Path(__file__).resolve().parent
LAST_OPT: list = [None]


class CompactAdamW(torch.optim.Optimizer):
    """AdamW (decoupled decay) for bf16 params with encoded state; math = halfadam.functional.adam_update_."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 master="split", m_spec="fp32", v_spec="fp32"):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master = master
        self.m_codec = moments.make_codec(m_spec)
        self.v_codec = moments.make_codec(v_spec)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    zeros = torch.zeros_like(p, dtype=torch.float32)
                    st["exp_avg"] = self.m_codec.encode(zeros)
                    st["exp_avg_sq"] = self.v_codec.encode(zeros)
                    if p.dtype == torch.float32:
                        pass
                    elif self.master == "fp32":
                        st["master_weight"] = p.detach().float().clone()
                    else:
                        assert p.dtype == torch.bfloat16
                        st["low"] = torch.zeros_like(p, dtype=torch.int16)
                        if self.master == "splitx":
                            st["tie_idx"] = torch.zeros(0, dtype=torch.int64)
                st["step"] += 1
                if p.dtype == torch.float32:
                    w = p
                elif self.master == "fp32":
                    w = st["master_weight"]
                    sync_master_(w, p)
                elif self.master == "splitx":
                    w = split.decode_exact(p, st["low"], st["tie_idx"])
                else:
                    w = split.decode(p, st["low"])
                m = self.m_codec.decode(st["exp_avg"], p.shape)
                v = self.v_codec.decode(st["exp_avg_sq"], p.shape)
                adam_update_(w, p.grad.float(), m, v, step=st["step"].item(), lr=group["lr"], beta1=b1,
                             beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"])
                st["exp_avg"] = self.m_codec.encode(m)
                st["exp_avg_sq"] = self.v_codec.encode(v)
                if p.dtype == torch.float32:
                    pass
                elif self.master == "fp32":
                    p.copy_(w)
                elif self.master == "splitx":
                    ties = []
                    split.encode(w, param_out=p, low_out=st["low"], ties_out=ties)
                    st["tie_idx"] = ties[0]
                else:
                    split.encode(w, param_out=p, low_out=st["low"])

    def master_weight(self, p):
        st = self.state[p]
        if "tie_idx" in st:
            return split.decode_exact(p, st["low"], st["tie_idx"])
        if "low" in st:
            return split.decode(p, st["low"])
        return st.get("master_weight", p)


@dataclass(frozen=True)
class CompactMode(Mode):
    master: str = "split"
    m_spec: str = "fp32"
    v_spec: str = "fp32"

    def make_optimizer(self, param_groups, *, lr, weight_decay):
        opt = CompactAdamW(param_groups, lr=lr, weight_decay=weight_decay, master=self.master,
                           m_spec=self.m_spec, v_spec=self.v_spec)
        LAST_OPT[0] = opt
        return opt

    def make_scaler(self, device):
        return None


@dataclass(frozen=True)
class RefHalfadamMode(Mode):
    def make_optimizer(self, param_groups, *, lr, weight_decay):
        opt = halfadam.AdamW(param_groups, lr=lr, weight_decay=weight_decay, implementation="reference")
        LAST_OPT[0] = opt
        return opt


def get_mode(name: str) -> Mode:
    if name in MODES:
        return MODES[name]
    if name == "bf16-halfadam-ref":
        return RefHalfadamMode(name, torch.bfloat16, "halfadam", None, "halfadam.AdamW reference impl")
    _, master, m, v = name.split(":")
    return CompactMode(name, torch.bfloat16, "compact", None, f"compact {master}/{m}/{v}", master, m, v)


def config(task: str, steps: int | None) -> T.TrainConfig:
    d = T.TASK_DEFAULTS[task]
    steps = steps or d["steps"]
    char = task == "char-lm"
    return T.TrainConfig(task=task, modes=[], steps=steps, batch_size=d["batch_size"], lr=d["lr"],
                         lr_schedule="constant", warmup_steps=0, weight_decay=0.0, seed=0, device="cpu",
                         out="/tmp/unused", eval_every=steps, text=None, seq_len=64 if char else None,
                         d_model=128 if char else None, layers=2 if char else None, heads=4 if char else None,
                         progress=False)


def safe(name):
    return name.replace(":", "_")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="char-lm", choices=T.TASKS)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--modes", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sr-seed", type=int, help="seed torch's global RNG (stochastic rounding draws) before each mode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = config(args.task, args.steps)
    tag = f"{cfg.task}-{cfg.steps}"
    (HERE / "cache").mkdir(exist_ok=True)
    (HERE / "results").mkdir(exist_ok=True)
    dataset, base_model, _, _ = T.build_task(cfg)
    plan = dataset.sample_plan(cfg.steps, cfg.batch_size, cfg.seed)
    device = torch.device("cpu")

    ref_path = HERE / "cache" / f"{tag}-fp32.pt"
    names = [n.strip() for n in args.modes.split(",") if n.strip()]
    if not ref_path.exists() and "fp32" not in names:
        names.insert(0, "fp32")
    for name in names:
        mode = get_mode(name)
        t0 = time.time()
        split.TIE_NUDGES[0] = 0
        LAST_OPT[0] = None
        if args.sr_seed is not None:
            torch.manual_seed(args.sr_seed)
        metrics, (final, masters) = T.train_mode(mode, base_model, dataset, plan, cfg, device)
        wall = time.time() - t0
        opt = LAST_OPT[0]
        if masters is None and isinstance(opt, CompactAdamW):
            grouped = [p for g in opt.param_groups for p in g["params"]]
            base = list(base_model.parameters())
            order = [i for i, p in enumerate(base) if p.dim() >= 2] + [i for i, p in enumerate(base) if p.dim() < 2]
            masters = [None] * len(base)
            for i, p in zip(order, grouped):
                masters[i] = opt.master_weight(p).detach().float().clone()
        torch.save({"final": final, "masters": masters, "val": metrics["final_val_loss"]},
                   HERE / "cache" / f"{tag}-{safe(name)}.pt")
        if name == "fp32":
            torch.save({"final": final, "val": metrics["final_val_loss"]}, ref_path)
        ref = torch.load(ref_path)
        val = metrics["final_val_loss"]
        ok = metrics["diverged_at_step"] is None and math.isfinite(val)
        row = {
            "mode": name,
            "task": cfg.task,
            "steps": cfg.steps,
            "state_B_per_param": metrics["optimizer_state_bytes_per_param"],
            "val": val,
            "val_vs_fp32_pct": 100 * (val - ref["val"]) / ref["val"] if ok else None,
            "dist": relative_distance(final, ref["final"]) if ok else None,
            "train_loss": metrics["final_train_loss"],
            "tie_nudges": split.TIE_NUDGES[0],
            "wall_s": wall,
            "ms_step": metrics["mean_step_ms"],
        }
        # bitwise comparisons with halfadam's own runs when those are cached
        for other in ("bf16-halfadam-ref", "bf16-halfadam"):
            op = HERE / "cache" / f"{tag}-{safe(other)}.pt"
            if op.exists() and name != other:
                o = torch.load(op)
                row[f"bitwise_eq_{other}"] = all(torch.equal(a, b) for a, b in zip(final, o["final"]))
                row[f"val_diff_{other}"] = val - o["val"]
                if masters is not None and o.get("masters") is not None:
                    row[f"masters_bitwise_eq_{other}"] = all(torch.equal(a, b) for a, b in zip(masters, o["masters"]))
        print(json.dumps(row), flush=True)
        with open(HERE / "results" / f"{tag}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
