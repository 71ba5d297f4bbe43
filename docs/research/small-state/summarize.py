"""The findings table from results/*.jsonl (markdown on stdout).

  python3 docs/research/small-state/summarize.py
"""
import json
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
BYTES = {"fp32": "12 (fp32 param: 16)", "compact": "4.03", "tiny": "3.02", "flashoptim": "3.125"}


def rows(name):
    p = HERE / "results" / name
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def main():
    digits, cos, char = defaultdict(dict), {}, {}
    for r in rows("digits-300.jsonl"):
        digits[r["mode"]][r["seed"]] = r
    for r in rows("digits-3000-cosine.jsonl"):
        cos[r["mode"]] = r
    for r in rows("char-lm-800.jsonl"):
        char[r["mode"]] = r
    probes = {r["mode"]: r for r in rows("probes.jsonl")}
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    print("| mode | B/param (>=2-D) | digits val vs fp32, seeds 0-4 (%) | digits dist (mean) | cosine 3000 val % / dist "
          "| char-LM val % / dist | small-update dist / never moved / moved vs fp32 | decay norm | elem 1e-2/1e-3/1e-4 "
          "| elem-scatter 1e-2/1e-3/1e-4 |")
    print("|---" * 10 + "|")
    for mode in digits:
        d = digits[mode]
        vals = [d[s]["val_vs_fp32_pct"] for s in sorted(d)]
        dists = [d[s]["dist"] for s in sorted(d)]
        ok = all(v is not None for v in vals)
        b = BYTES.get(mode) or fmt(next(iter(d.values()))["B_per_param_2d"], ".3f")
        dig = (f"{min(vals):+.2f}..{max(vals):+.2f} (n={len(vals)})" if ok else "diverged")
        dd = fmt(sum(dists) / len(dists), ".2e") if ok else "-"
        c = cos.get(mode)
        cc = f"{c['val_vs_fp32_pct']:+.2f} / {c['dist']:.2e}" if c and c["dist"] is not None else "-"
        ch = char.get(mode)
        chs = f"{ch['val_vs_fp32_pct']:+.3f} / {ch['dist']:.2e}" if ch and ch["dist"] is not None else "-"
        p = probes.get(mode, {})
        sm = (f"{p['small_dist_rel_move']:.3f} / {p['small_never_moved']:.0%} / {p['small_moved_vs_fp32']:.3f}"
              if p else "-")
        dec = fmt(p.get("decay_norm_ratio"), ".4f")
        el = "/".join(fmt(p.get(f"elem_{s}"), ".2f") for s in ("0.01", "0.001", "0.0001")) if p else "-"
        es = "/".join(fmt(p.get(f"elem_scatter_{s}"), ".2f") for s in ("0.01", "0.001", "0.0001")) if p else "-"
        print(f"| {mode} | {b} | {dig} | {dd} | {cc} | {chs} | {sm} | {dec} | {el} | {es} |")


if __name__ == "__main__":
    main()
