"""The prototype optimizer (AdamW around halfadam.functional.adam_update_ with encoded state), the
FlashOptim peer (its Triton kernels on CPU under TRITON_INTERPRET=1, fo_cpu.py) and the mode names.

Modes: fp32 (torch.optim.AdamW, fp32 params), compact (halfadam.AdamW state_mode="compact"),
flashoptim (flashoptim.FlashAdamW, master_weight_bits=24), P:<master>:<m>:<v> (codecs_.py).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by halfadam)
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import codecs_ as C  # noqa: E402  (named codecs_ so as not to shadow the stdlib codecs)
import halfadam  # noqa: E402
from halfadam.cli.modes import MODES, Mode  # noqa: E402
from halfadam.functional import adam_update_  # noqa: E402


class ProtoAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 master="M16", m="m8", v="V8", seed=0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.fmt = (master, m, v)
        self.gen = torch.Generator().manual_seed(1000 + seed)

    def master_weight(self, p):
        st = self.state[p]
        if "corr" in st:
            return C.master8_decode(p, st["corr"])
        return st.get("w", p).detach()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._step(p, group, b1, b2)

    def _step(self, p, group, b1, b2):
        st, g = self.state[p], p.grad.float()
        master, mc, vc = self.fmt if p.dim() >= 2 else ("M32", "m32", "V32")
        if not st:
            st["step"] = 0
            z = torch.zeros_like(p, dtype=torch.float32)
            if master in ("M16", "M32"):
                st["w"] = p.detach().float().clone()
            else:
                st["corr"] = torch.zeros_like(p, dtype=torch.int8)
            st["m"], st["v"] = self._enc(mc, "exp_avg", z, 0), self._enc(vc, "exp_avg_sq", z, 0)
            if vc == "Vfac":
                g2 = g.reshape(p.shape[0], -1)
                st["v"] = (torch.zeros(g2.shape[0]), torch.zeros(g2.shape[1]))
        st["step"] += 1
        t = st["step"]
        w = self.master_weight(p).float().clone()
        m = self._dec(mc, "exp_avg", st["m"], p.shape)
        kw = dict(step=t, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"])
        if vc == "Vfac":
            r, c = st["v"]
            g2 = (g * g).reshape(p.shape[0], -1) + 1e-30
            r.mul_(b2).add_(g2.mean(dim=1), alpha=1 - b2)
            c.mul_(b2).add_(g2.mean(dim=0), alpha=1 - b2)
            vhat = (torch.outer(r, c) / r.mean()).reshape(p.shape)
            w.mul_(1 - group["lr"] * group["weight_decay"])
            m.add_((g - m) * (1 - b1))
            denom = (vhat.sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
            w.sub_(m / denom * (group["lr"] / (1 - b1 ** t)))
        else:
            v = self._dec(vc, "exp_avg_sq", st["v"], p.shape)
            adam_update_(w, g, m, v, **kw)
            st["v"] = self._enc(vc, "exp_avg_sq", v, t)
        st["m"] = self._enc(mc, "exp_avg", m, t)
        if master in ("M16", "M32"):
            st["w"] = w
            p.copy_(w)
        else:
            q, corr = C.master8_encode(w, master == "M8sr", self.gen)
            p.copy_(q)
            st["corr"] = corr

    def _enc(self, spec, name, x, t):
        if spec == "Vfac":
            return None  # the row / column EMAs are kept in st["v"] by _step
        if spec in ("m32", "V32"):
            return x.clone()
        if spec in ("m8", "V8"):
            return C.compact8_encode(name, x, t)
        if spec in C.TAPER:
            return C.taper_encode(x, spec, signed=name == "exp_avg", gen=self.gen)
        if spec == "m4":
            return C.log4_encode(x, signed=True, step_octaves=1.0, levels=7, up_at_bottom=False, gen=self.gen)
        if spec.startswith("V4log"):
            return C.log4_encode(x, signed=False, step_octaves=float(spec[5:] or 1), levels=15, up_at_bottom=True,
                                 gen=self.gen)
        raise ValueError(spec)

    def _dec(self, spec, name, st, shape):
        if spec in ("m32", "V32"):
            return st.clone()
        if spec in ("m8", "V8"):
            return C.compact8_decode(name, st, shape)
        if spec in C.TAPER:
            return C.taper_decode(*st, shape, spec)
        if spec == "m4":
            return C.log4_decode(*st, shape, step_octaves=1.0, levels=7)
        if spec.startswith("V4log"):
            return C.log4_decode(*st, shape, step_octaves=float(spec[5:] or 1), levels=15)
        raise ValueError(spec)


def flashoptim_adamw(params, *, lr, weight_decay, **kw):
    import fo_cpu  # noqa: F401  (patches flashoptim to run its kernels in Triton's interpreter)
    import flashoptim
    return flashoptim.FlashAdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8,
                                 master_weight_bits=24, **kw)


def flashoptim_master(opt, p):
    import flashoptim
    st = opt.state[p]
    return flashoptim.reconstruct_fp32_param(p.detach(), st["error_bits"]) if "error_bits" in st else p.detach().float()


LAST_OPT: list = [None]
SEED: list = [0]


@dataclass(frozen=True)
class ProtoMode(Mode):
    fmt: tuple = ("M16", "m8", "V8")

    def make_optimizer(self, param_groups, *, lr, weight_decay):
        if self.fmt == ("flashoptim",):
            opt = flashoptim_adamw(param_groups, lr=lr, weight_decay=weight_decay)
        else:
            opt = ProtoAdamW(param_groups, lr=lr, weight_decay=weight_decay, master=self.fmt[0], m=self.fmt[1],
                             v=self.fmt[2], seed=SEED[0])
        LAST_OPT[0] = opt
        return opt

    def make_scaler(self, device):
        return None


@dataclass(frozen=True)
class CompactMode(Mode):
    def make_optimizer(self, param_groups, *, lr, weight_decay):
        opt = halfadam.AdamW(param_groups, lr=lr, weight_decay=weight_decay, state_mode=self.name,
                             implementation="reference")
        LAST_OPT[0] = opt
        return opt


def get_mode(name: str) -> Mode:
    if name == "fp32":
        return MODES["fp32"]
    if name in ("compact", "tiny"):  # halfadam's own state modes
        return CompactMode(name, torch.bfloat16, "halfadam", None, f"halfadam {name}")
    if name == "flashoptim":
        return ProtoMode(name, torch.bfloat16, "peer", None, "FlashAdamW 24-bit master", fmt=("flashoptim",))
    _, master, m, v = name.split(":")
    return ProtoMode(name, torch.bfloat16, "proto", None, name, fmt=(master, m, v))


def make_optimizer(name, params, *, lr, weight_decay, seed=0):
    """The optimizer of mode ``name`` over ``params`` (the probes' entry point)."""
    SEED[0] = seed
    if name == "fp32":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return get_mode(name).make_optimizer(params, lr=lr, weight_decay=weight_decay)


def master_of(opt, p):
    if isinstance(opt, ProtoAdamW):
        return opt.master_weight(p).float()
    if isinstance(opt, halfadam.AdamW):
        return opt.master_weight(p).float()
    if isinstance(opt, torch.optim.AdamW):
        return p.detach().float()
    return flashoptim_master(opt, p).float()
