"""Writes tests/data/state_2026-12-06/: optimizer checkpoints in the 8-bit encodings of halfadam as of
commit 1aa0217 (2026-12-06: tapered-float codes over a uint8 base exponent per block, ``exp_avg_sq``
over 27 binades in ``exp_avg_sq_scale``, labelled ``halfadam 8-bit codes v1``), kept as test data so
that later releases are tested against files the old one wrote (``tests/test_state_formats.py``). Run
with that release only:

    git worktree add /tmp/old 1aa0217 && PYTHONPATH=/tmp/old/src python tests/data/make_state_2026_12_06.py

Each ``<mode>.pt`` holds the model's parameters, ``optimizer.state_dict()`` and, per parameter, the
float32 values that release decoded from it (``decoded``); ``compact.dcp`` and ``tiny.dcp`` are the
same states as ``halfadam.distributed.save_checkpoint`` directories.
"""
import subprocess
from pathlib import Path

import torch

import halfadam
from halfadam import encodings
from halfadam.distributed import save_checkpoint

OUT = Path(__file__).with_name("state_2026-12-06")


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter((torch.randn(8, 256, generator=g) * 0.05).bfloat16())
        self.w2 = torch.nn.Parameter((torch.randn(4, 128, generator=g) * 0.05).half())
        self.w3 = torch.nn.Parameter(torch.randn(6, 128, generator=g) * 0.05)
        self.b = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
        self.nonfinite = torch.nn.Parameter((torch.randn(2, 128, generator=g) * 0.05).bfloat16())


def run(mode: str):
    torch.manual_seed(0)
    model = Model()
    opt = halfadam.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, state_mode=mode, implementation="reference")
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        for name, p in model.named_parameters():
            grad = torch.randn(p.shape, generator=g) * torch.logspace(-6, 0, p.numel()).view(p.shape)
            if name == "nonfinite" and step == 4:
                grad[0, 3], grad[1, 5] = float("inf"), float("nan")
            p.grad = grad.to(p.dtype)
        opt.step()
    decoded = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        decoded[name] = encodings.decode_state(encodings.format_of(st), p.detach(), st)
    return model, opt, decoded


def main():
    OUT.mkdir(exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(halfadam.__file__).parent).stdout.strip()
    for mode in ("compact", "tiny"):
        model, opt, decoded = run(mode)
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        torch.save({"commit": commit, "mode": mode, "params": params, "state_dict": opt.state_dict(),
                    "decoded": decoded}, OUT / f"{mode}.pt")
        save_checkpoint(str(OUT / f"{mode}.dcp"), model, opt)
    print("wrote", OUT, "at", commit)


if __name__ == "__main__":
    main()
