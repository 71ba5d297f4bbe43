"""Encodings for Adam's moments (exp_avg m, exp_avg_sq v): encode(fp32) -> state, decode(state) -> fp32.

Every codec: ``enc = make_codec(spec)``; ``st = enc.encode(x)`` (a dict of tensors); ``enc.decode(st, shape)``;
``enc.bytes_per_elem`` (incl. one fp32 scale per block).

Specs (B = block size, elements are blocked over the flattened tensor, last block zero-padded):
  fp32, bf16
  lin8s-B      signed linear absmax, int8 in [-127, 127]               (exp_avg)
  dyn8s-B      signed dynamic tree map (Dettmers 2022 / bitsandbytes)   (exp_avg)
  lin8u-B      unsigned linear absmax, uint8 0..255                     (exp_avg_sq)
  dyn8u-B      unsigned dynamic tree map (bitsandbytes signed=False)    (exp_avg_sq)
  sqrt8-B      linear absmax on sqrt(v), uint8; decode squares          (exp_avg_sq)
  log8-B[-R]   log2 domain: code 0 = 0, codes 1..255 = absmax * 2^(-R*(255-c)/254), R octaves (default 32)
               values below the range go to the smallest code (never to 0 unless exactly 0)
  suffix "-sr": stochastic rounding (lin/sqrt/log), e.g. sqrt8-128-sr
  suffix "-srv": (log8) stochastic rounding unbiased in value (plain -sr on log8 is unbiased in log2)
  suffix "-nz": (lin8u/sqrt8/dyn8u) a nonzero value never encodes to 0 (smallest nonzero code instead)
  suffix "-up": round up (ceil; for dyn8: the smallest code >= x): the decoded v is never below the true v,
                so the Adam denominator is never underestimated (no blow-up where v would round to 0)
"""
from __future__ import annotations


import torch

__all__ = ["make_codec", "dynamic_map"]


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' create_dynamic_map (dynamic tree quantization), 256 sorted values in [-1, 1] or [0, 1]."""
    data = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float64)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float64)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


class _Plain:
    def __init__(self, dtype, sr=False):
        self.dtype, self.sr = dtype, sr
        self.bytes_per_elem = torch.tensor([], dtype=dtype).element_size()

    def encode(self, x):
        if self.sr:  # bf16 stochastic rounding: add 16 random low bits, truncate (finite x)
            bits = x.contiguous().view(torch.int32)
            r = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32)
            t = ((bits + r) >> 16).to(torch.int16).view(torch.bfloat16)
            return {"q": t}
        return {"q": x.to(self.dtype, copy=True)}

    def decode(self, st, shape):
        return st["q"].float().reshape(shape)


class _Block:
    """Block-wise 8-bit with one fp32 scale (block absmax, of x or of sqrt(x)) per block."""

    def __init__(self, kind: str, block: int, sr: bool, octaves: float = 32.0, up: bool = False):
        self.kind, self.block, self.sr, self.octaves, self.up = kind, block, sr, octaves, up
        self.bytes_per_elem = 1 + 4 / block
        if kind in ("dyn8s", "dyn8u"):
            self.code = dynamic_map(signed=kind == "dyn8s")
            self.mid = (self.code[1:] + self.code[:-1]) / 2

    def _blocks(self, x):
        flat = x.reshape(-1)
        n = flat.numel()
        pad = (-n) % self.block
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.block), n

    def _round(self, y):
        if self.sr:
            return torch.floor(y + torch.rand_like(y))
        if self.up:
            return torch.ceil(y)
        return torch.round(y)

    def encode(self, x):
        k = self.kind
        if k == "sqrt8":
            x = x.clamp_min(0).sqrt()
        b, n = self._blocks(x)
        absmax = b.abs().amax(dim=1, keepdim=True)
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        y = b / safe
        if k == "lin8s":
            q = self._round(y * 127).clamp(-127, 127).to(torch.int8)
        elif k in ("lin8u", "sqrt8"):
            q = self._round(y.clamp_min(0) * 255).clamp(0, 255).to(torch.uint8)
        elif k == "log8":
            # c = 255 + 254 * log2(y) / R, clamp to [1, 255]; exact zeros -> 0
            yl = torch.log2(y.clamp_min(1e-45))
            cf = 255 + 254 * yl / self.octaves
            if self.sr == "value":  # stochastic rounding unbiased in value (not in log2)
                lo = torch.floor(cf).clamp(1, 254)
                vlo = torch.exp2((lo - 255) * (self.octaves / 254))
                vhi = torch.exp2((lo - 254) * (self.octaves / 254))
                p = ((y - vlo) / (vhi - vlo)).clamp(0, 1)
                c = lo + (torch.rand_like(y) < p).float()
            else:
                c = self._round(cf).clamp(1, 255)
            q = torch.where(y > 0, c, torch.zeros_like(c)).to(torch.uint8)
        else:  # dynamic tree: nearest code value
            if self.sr:  # stochastic: between the two neighbouring codes, unbiased
                lo = (torch.searchsorted(self.code, y.contiguous(), right=True) - 1).clamp(0, 254)
                c_lo, c_hi = self.code[lo], self.code[lo + 1]
                p = ((y - c_lo) / (c_hi - c_lo)).clamp(0, 1)
                q = (lo + (torch.rand_like(y) < p).long()).to(torch.uint8)
            elif self.up:  # smallest code >= y
                q = torch.searchsorted(self.code, y.contiguous(), right=False).clamp(max=255).to(torch.uint8)
            else:
                q = torch.bucketize(y, self.mid).to(torch.uint8)
        if getattr(self, "nz", False) and k in ("lin8u", "sqrt8", "dyn8u"):
            first = 1 if k != "dyn8u" else int((self.code == 0).sum())  # index of the smallest nonzero code
            q = torch.where((b > 0) & (q < first), torch.full_like(q, first), q)
        return {"q": q.reshape(-1)[:n].clone(), "absmax": absmax.reshape(-1), "n": n}  # no padding stored

    def decode(self, st, shape):
        k = self.kind
        q, absmax = st["q"], st["absmax"].unsqueeze(1)
        pad = (-q.numel()) % self.block
        if pad:
            q = torch.cat([q, q.new_zeros(pad)])
        q = q.view(-1, self.block)
        if k == "lin8s":
            y = q.float() / 127
        elif k in ("lin8u", "sqrt8"):
            y = q.float() / 255
        elif k == "log8":
            qf = q.float()
            y = torch.where(q > 0, torch.exp2((qf - 255) * (self.octaves / 254)), torch.zeros_like(qf))
        else:
            y = self.code[q.long()]
        x = y * absmax
        if k == "sqrt8":
            x = x * x
        return x.reshape(-1)[: st["n"]].reshape(shape)


def make_codec(spec: str):
    if spec == "fp32":
        return _Plain(torch.float32)
    if spec == "bf16":
        return _Plain(torch.bfloat16)
    if spec == "bf16-sr":
        return _Plain(torch.bfloat16, sr=True)
    parts = spec.split("-")
    flags = set()
    while parts[-1] in ("sr", "srv", "up", "nz"):
        flags.add(parts.pop())
    sr = "value" if "srv" in flags else ("sr" in flags)
    up = "up" in flags
    kind, block = parts[0], int(parts[1])
    octaves = float(parts[2]) if len(parts) > 2 else 32.0
    assert kind in ("lin8s", "dyn8s", "lin8u", "dyn8u", "sqrt8", "log8"), spec
    codec = _Block(kind, block, sr, octaves, up)
    codec.nz = "nz" in flags
    return codec


def selftest():
    """Round-trip errors on synthetic moments: m ~ N(0,1)*lognormal scale, v = lognormal over ~8 decades."""
    torch.manual_seed(0)
    n = 1 << 20
    rowscale = torch.exp(torch.randn(n // 256, 1) * 1.0).expand(-1, 256).reshape(-1)
    g = torch.randn(n) * rowscale * torch.exp(torch.randn(n) * 1.5)
    v = g * g * 1e-6
    m = torch.randn(n) * v.sqrt() * 0.3
    print(f"{'codec':14s} {'B/elem':>7s}  v: zero-frac  median|rel err sqrt(v)|  p99    max    "
          "| m: median|rel err|")
    for spec in ["bf16", "lin8u-128", "dyn8u-128", "dyn8u-2048", "sqrt8-128", "sqrt8-2048", "log8-128",
                 "log8-128-24", "log8-128-40", "lin8s-128", "dyn8s-128"]:
        c = make_codec(spec)
        x = m if spec.startswith(("lin8s", "dyn8s")) else v
        d = c.decode(c.encode(x), x.shape)
        if x is v:
            rel = ((d.sqrt() - v.sqrt()).abs() / v.sqrt())
            zf = float((d == 0).float().mean())
            print(f"{spec:14s} {c.bytes_per_elem:7.4f}     {zf:.4f}       {float(rel.median()):.2e}          "
                  f"{float(rel.quantile(0.99) if n <= 1<<24 else 0):.2e} {float(rel.max()):.2e}")
        else:
            rel = ((d - m).abs() / m.abs())
            print(f"{spec:14s} {c.bytes_per_elem:7.4f}  {'':46s}| {float(rel.median()):.2e}")


if __name__ == "__main__" and "drift" not in __import__("sys").argv:
    torch.set_num_threads(1)
    selftest()


def ema_drift(specs=("bf16", "bf16-sr", "dyn8u-128", "dyn8u-128-sr", "sqrt8-128", "sqrt8-128-sr", "log8-128",
                     "log8-128-16", "log8-128-srv", "log8-128-16-srv")):
    """Why the second moment needs unbiased (stochastic) rounding: v <- Q(0.999 v + 0.001 g^2) re-quantized
    every step.  A block of 128 elements: one element holds the block max (g^2 = 1 every step, v -> 1),
    the others have v0 = 1e-2 and g = 0 for 1000 steps (true v = 1e-2 * 0.999^1000 = 3.68e-3), then
    g^2 = 1e-4 for 2000 steps (true v -> ~1e-4).  Printed: mean decoded v of the small elements / true."""
    torch.manual_seed(0)
    n = 128 * 64
    big = torch.zeros(n, dtype=torch.bool)
    big[::128] = True
    print(f"{'codec':16s} {'after decay 1000 steps':>24s} {'after 2000 steps of g^2=1e-4':>30s}")
    for spec in specs:
        c = make_codec(spec)
        v_true = torch.where(big, torch.ones(n), torch.full((n,), 1e-2))
        st = c.encode(v_true)
        res = []
        for t in range(3000):
            g2 = torch.where(big, torch.ones(n), torch.full((n,), 0.0 if t < 1000 else 1e-4))
            v = c.decode(st, (n,))
            v = v * 0.999 + 0.001 * g2
            v_true = v_true * 0.999 + 0.001 * g2
            st = c.encode(v)
            if t in (999, 2999):
                res.append(float(c.decode(st, (n,))[~big].mean() / v_true[~big].mean()))
        print(f"{spec:16s} {res[0]:24.3f} {res[1]:30.3f}")


if __name__ == "__main__" and "drift" in __import__("sys").argv:
    torch.set_num_threads(1)
    ema_drift()
