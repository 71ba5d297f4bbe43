"""fp16 parameters: fp16 is not the upper half of fp32, so the split trick does not apply.
Candidates for a 2-byte residual next to the fp16 parameter p = RNE_fp16(master):
  bf16 residual : r = bf16(master - p)              master' = p + r
  fp16 residual : r = fp16(master - p)              master' = p + r
  int16 ulp     : r = round((master - p) / ulp(p) * 2^16)  (|master - p| <= ulp/2 -> |r| <= 2^15), master' = p + r*ulp/2^16
Each is re-encoded every step (the state is all there is), on a synthetic Adam trajectory
(w ~ N(0, 0.02) plus LayerNorm-like weights ~1 and small biases ~1e-4; updates lr * N(0,1), lr=3e-4,
decoupled decay 1e-4) and compared with the true fp32 master.  Reports max relative error over
the trajectory, and the relative distance of the final masters.
"""
import torch


def ulp16(p):
    """spacing of fp16 around |p| (for p=0: the subnormal spacing 2^-24)."""
    a = p.abs().float()
    e = torch.floor(torch.log2(a.clamp_min(2.0**-14)))
    return torch.exp2(e - 10)


def enc(kind, m):
    p = m.to(torch.float16)
    d = m - p.float()
    if kind == "bf16":
        return p, d.to(torch.bfloat16)
    if kind == "fp16":
        return p, d.to(torch.float16)
    q = torch.round(d / ulp16(p) * 65536).clamp(-32768, 32767).to(torch.int16)
    return p, q


def dec(kind, p, r):
    if kind in ("bf16", "fp16"):
        return p.float() + r.float()
    return p.float() + r.float() * ulp16(p) / 65536


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    n = 200_000
    w0 = torch.cat([torch.randn(n) * 0.02, 1 + torch.randn(n // 10) * 0.05, torch.randn(n // 10) * 1e-4])
    steps, lr, wd = 500, 3e-4, 1e-4
    true = w0.clone()
    states = {k: enc(k, w0) for k in ("bf16", "fp16", "int16ulp")}
    maxrel = {k: 0.0 for k in states}
    maxulp32 = {k: 0.0 for k in states}
    for t in range(steps):
        u = lr * torch.randn_like(true)
        true.mul_(1 - lr * wd).sub_(u)
        for k, (p, r) in states.items():
            m = dec(k, p, r)
            m.mul_(1 - lr * wd).sub_(u)
            states[k] = enc(k, m)
            m2 = dec(k, *states[k])
            err = (m2.double() - true.double()).abs()
            rel = err / true.double().abs().clamp_min(1e-30)
            big = true.abs() > 1e-3
            maxrel[k] = max(maxrel[k], float(rel[big].max()))
            ulp32 = torch.exp2(torch.floor(torch.log2(true.abs().clamp_min(1e-38))) - 23).double()
            maxulp32[k] = max(maxulp32[k], float((err / ulp32).max()))
    for k, (p, r) in states.items():
        m = dec(k, p, r)
        dist = float((m.double() - true.double()).norm() / true.double().norm())
        print(f"fp16 param + {k:9s} residual: max rel err (|w|>1e-3, over {steps} steps) {maxrel[k]:.2e}; "
              f"max err in fp32 ulps {maxulp32[k]:.3g}; final rel dist {dist:.2e}")
    # for comparison: fp16 param alone (no master) and bf16 split (exact)
    p = w0.to(torch.float16)
    for t in range(0):
        pass


if __name__ == "__main__":
    main()
