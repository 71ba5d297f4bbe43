"""Writes tests/data/<DIR>/: optimizer checkpoints in the 8-bit encodings of the halfadam release on the
path, kept as test data so that later releases are tested against files an old one wrote
(``tests/test_state_formats.py``). Each directory was written by one release and is never rewritten:

- state_2026-12-06: commit 1aa0217 (``exp_avg_sq`` over 27 binades in ``exp_avg_sq_scale``, labelled
  ``halfadam 8-bit codes v1``);
- state_2026-12-07: commit 8d467ef (``exp_avg_sq`` over 46 binades in ``exp_avg_sq_base``, labelled v2);
- state_2026-12-07b: commit 673f2dc (the codes of 2026-12-07b in ``exp_avg_sq_exponent``, labelled v3 in bytes,
  the last release before the dict labels).

    git worktree add /tmp/old <commit> && PYTHONPATH=/tmp/old/src python tests/data/make_state.py <DIR>

Each ``<mode>.pt`` holds the model's parameters, ``optimizer.state_dict()`` and, per parameter, the
float32 values that release decoded from it (``decoded``); ``compact.dcp`` and ``tiny.dcp`` are the
same states as ``halfadam.distributed.save_checkpoint`` directories.
"""
import subprocess
import sys
from pathlib import Path

import torch

import halfadam
from halfadam import encodings
from halfadam.distributed import save_checkpoint

OUT = Path(__file__).with_name(sys.argv[1] if len(sys.argv) > 1 else "state")


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
