"""Split fp32 master for bf16 parameters: master (fp32) <-> (param bf16 = RNE(master), low int16).

Torch ops only (bit manipulation through .view(torch.int32)).

Bit-pattern view: M = bits(master) as int32, P = bits(param) as int16 (sign-extended), P32 = P << 16.
low = M - P32 (two's complement int32 arithmetic).  For RNE, with r = M & 0xFFFF:
    r <  0x8000          -> round down, low = r               in [0, 0x7FFF]
    r >  0x8000          -> round up,   low = r - 0x10000     in [-0x7FFF, -1]
    r == 0x8000 (a tie)  -> to even:  upper odd  -> round up,   low = -0x8000 (fits int16)
                                     upper even -> round down, low = +0x8000 (does NOT fit int16)
Pigeonhole: an even bf16 pattern is RNE of 65537 fp32 patterns (both ties), an int16 has 65536
values, so no RNE split can be exact for every fp32.  Rule chosen ("tie-down nudge"): the
round-down tie (low = +0x8000) is stored as +0x7FFF, i.e. the master moves by 1 fp32 ulp towards
the parameter (|rel. change| <= 2^-23); the parameter stays RNE(master) and every other fp32 value
(subnormals, +-0, +-inf, values that RNE to inf) is exact.  nan: param = nan, low = 0, decodes to
nan (payload not kept).

decode also applies a master-sync rule: if RNE(param<<16 + low) != param (the parameter was
written by someone else and the stale low bits do not belong to it), the master is the param.
"""
from __future__ import annotations

import torch

__all__ = ["encode", "decode", "rne_bf16_bits", "TIE_NUDGES"]

TIE_NUDGES = [0]  # count of tie-down nudges (a diagnostic)


def rne_bf16_bits(m32: torch.Tensor) -> torch.Tensor:
    """int32 tensor of bit patterns -> int32 tensor whose low 16 bits are RNE bf16 pattern (non-nan)."""
    lsb = (m32 >> 16) & 1
    return (m32 + 0x7FFF + lsb) >> 16  # arithmetic shift; low 16 bits are the pattern


def encode(master: torch.Tensor, param_out: torch.Tensor | None = None, low_out: torch.Tensor | None = None,
           ties_out: list | None = None):
    """fp32 master -> (bf16 param, int16 low). Writes in place into param_out/low_out if given.

    ties_out: if a list is given, the flat indices (int64) of the round-down ties are appended to it
    (an exact variant can keep them as a sparse escape list; ~2^-17 of the elements per step)."""
    assert master.dtype == torch.float32
    m = master.view(torch.int32)
    isnan = torch.isnan(master)
    p32 = rne_bf16_bits(m) << 16  # int32: param's bits in the upper half (wraps correctly)
    low = m - p32
    tie_down = low == 0x8000
    n = int(tie_down.sum())
    if ties_out is not None:
        ties_out.append(tie_down.reshape(-1).nonzero().reshape(-1))
    if n:
        TIE_NUDGES[0] += n
        low = torch.where(tie_down, torch.full_like(low, 0x7FFF), low)
    low = torch.where(isnan, torch.zeros_like(low), low).to(torch.int16)
    p16 = (p32 >> 16).to(torch.int16).view(torch.bfloat16)
    p16 = torch.where(isnan, torch.full_like(p16, float("nan")), p16)
    if param_out is not None:
        param_out.copy_(p16)
        p16 = param_out
    if low_out is not None:
        low_out.copy_(low)
        low = low_out
    return p16, low


def decode(param: torch.Tensor, low: torch.Tensor, sync: bool = True) -> torch.Tensor:
    """(bf16 param, int16 low) -> fp32 master. With sync: stale low bits (RNE(master) != param) are dropped."""
    assert param.dtype == torch.bfloat16 and low.dtype == torch.int16
    p32 = param.view(torch.int16).to(torch.int32) << 16
    m = p32 + low.to(torch.int32)
    master = m.view(torch.float32)
    pf = param.float()
    if sync:
        stale = (rne_bf16_bits(m) << 16) != p32
        stale |= torch.isnan(master)
        master = torch.where(stale, pf, master)
    return torch.where(torch.isnan(pf), pf, master)


def decode_exact(param: torch.Tensor, low: torch.Tensor, tie_idx: torch.Tensor) -> torch.Tensor:
    """decode() plus the sparse escape list of round-down ties (master = param + 0x8000 there): exact."""
    master = decode(param, low).clone()
    if tie_idx.numel():
        p32 = param.reshape(-1)[tie_idx].view(torch.int16).to(torch.int32) << 16
        master.view(-1)[tie_idx] = (p32 + 0x8000).view(torch.float32)
    return master


# ----------------------------------------------------------------------------------------- checks
def _bits(x):
    return x.view(torch.int32)


def check(n: int = 10_000_000, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    parts = {}
    # uniformly random bit patterns (all classes: normals, subnormals, inf, nan)
    parts["random bits"] = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    # realistic weights
    parts["N(0,0.02) weights"] = _bits(torch.randn(n // 4, generator=g) * 0.02).clone()
    # exact ties: low 16 bits == 0x8000, both parities of the upper half
    up = torch.randint(-2**15, 2**15, (n // 4,), generator=g, dtype=torch.int32)
    parts["ties"] = (up << 16) | 0x8000
    # subnormals and zeros
    sub = torch.randint(0, 0x007FFFFF + 1, (n // 8,), generator=g, dtype=torch.int32)
    parts["subnormals"] = torch.cat([sub, sub | torch.tensor(-2**31, dtype=torch.int32)])
    # specials and values around bf16 overflow (RNE -> inf)
    edge = torch.arange(0x7F7F0000, 0x7F810000, dtype=torch.int64).to(torch.int32)
    parts["near overflow/inf/nan"] = torch.cat([edge, edge | torch.tensor(-2**31, dtype=torch.int32),
                                               torch.tensor([0, -2**31, 0x7F800000, -8388608, 0x7FC00000, 1, -2**31 + 1],
                                                            dtype=torch.int32)])
    total_bad = 0
    for name, bits in parts.items():
        x = bits.view(torch.float32)
        TIE_NUDGES[0] = 0
        p, low = encode(x)
        y = decode(p, low)
        nan = torch.isnan(x)
        same = (_bits(y) == bits) | (nan & torch.isnan(y))
        nudged = (bits - (_bits(p.float()))) == 0x8000  # the tie-down case
        nudge_ok = nudged & (_bits(y) == bits - 1)
        # parameter is torch's RNE conversion
        ref = x.to(torch.bfloat16)
        p_ok = (p.view(torch.int16) == ref.view(torch.int16)) | (nan & torch.isnan(p))
        bad = int((~(same | nudge_ok)).sum())
        total_bad += bad
        overflow_inf = int((torch.isinf(p) & torch.isfinite(x)).sum())
        print(f"{name:24s} n={len(x):>9,}  exact={int(same.sum()):>9,}  tie-down nudged (1 fp32 ulp)={int(nudged.sum()):>7,}"
              f"  other errors={bad}  param==torch RNE: {bool(p_ok.all())}  finite->inf params={overflow_inf}"
              f" (decoded finite: {bool(torch.isfinite(y[torch.isinf(p) & torch.isfinite(x)]).all())})")
    assert total_bad == 0
    # relative size of the nudge
    t = parts["ties"].view(torch.float32)
    p, low = encode(t)
    y = decode(p, low)
    fin = torch.isfinite(t) & (t != 0)
    rel = ((y.double() - t.double()).abs() / t.double().abs())[fin]
    print(f"ties: max relative error of decoded master {float(rel.max()):.3e} (2^-23 = {2**-23:.3e})")

    # stale low bits: the user writes a new value into the bf16 param
    print("\nstale low bits: param overwritten with a new bf16 value, low bits kept")
    w = torch.randn(n // 4, generator=g) * 0.02
    p, low = encode(w)
    for label, newp in {
        "random new values N(0,0.02)": (torch.randn(n // 4, generator=g) * 0.02).to(torch.bfloat16),
        "param*0.5 (new binade)": (p.float() * 0.5).to(torch.bfloat16),
        "zeros (+0)": torch.zeros_like(p),
        "-0": torch.full_like(p, -0.0),
        "+inf": torch.full_like(p, float("inf")),
        "max finite bf16": torch.full_like(p, 3.3895313892515355e38),
        "1.0 (binade boundary)": torch.ones_like(p),
        "random bit patterns": torch.randint(-2**15, 2**15, p.shape, generator=g, dtype=torch.int16).view(torch.bfloat16),
    }.items():
        for sync in (False, True):
            m = decode(newp, low, sync=sync)
            pf = newp.float()
            fin = torch.isfinite(pf)
            ulp = _ulp_bf16(newp)
            d = (m.double() - pf.double()).abs()
            ok = fin & torch.isfinite(m)
            ratio = (d[ok] / ulp[ok]).max() if ok.any() else torch.tensor(0.0)
            nonfinite = int((fin & ~torch.isfinite(m)).sum())
            rne_ok = bool(((m.to(torch.bfloat16).view(torch.int16) == newp.view(torch.int16)) | torch.isnan(pf)).all())
            kept = float(((m != pf) & fin).double().mean())
            print(f"  {label:30s} sync={sync!s:5}: max |master-param|/ulp(param)={float(ratio):.4f}  "
                  f"finite param -> nan/inf master: {nonfinite:>8,}  RNE(master)==param: {rne_ok}  "
                  f"fraction keeping stale low bits: {kept:.3f}")


def _ulp_bf16(p: torch.Tensor) -> torch.Tensor:
    """ulp of a bf16 value (distance to the next larger-magnitude bf16), as float64."""
    b = p.view(torch.int16).to(torch.int32)
    nxt = (b + 1).to(torch.int16).view(torch.bfloat16)
    return (nxt.double() - p.double()).abs()


if __name__ == "__main__":
    torch.set_num_threads(1)
    check()
