"""Checkpoints written by an older release keep loading: tests/data/state_2026-12-01/ holds optimizer
state that halfadam 763dbb7 (2026-12-01) wrote in the split, bf16 and compact modes (its 8-bit codes:
a dynamic-tree exp_avg and 24-octave log2 exp_avg_sq over a float32 ``*_absmax`` per block), with the
float32 values that release decoded from it (tests/data/make_state_2026_12_01.py wrote them). Loaded
today, each state is decoded by its format's rules and encoded in today's: exact wherever today's
encoding holds the value exactly, within one code step of today's 8-bit codes otherwise."""

import math
from pathlib import Path

import pytest
import torch

import halfadam
from halfadam import encodings as E
from halfadam.distributed import load_checkpoint

DATA = Path(__file__).parent / "data" / "state_2026-12-01"


class Model(torch.nn.Module):  # the shapes and dtypes of make_state_2026_12_01.Model, values from the file
    def __init__(self, params):
        super().__init__()
        for name, value in params.items():
            setattr(self, name, torch.nn.Parameter(value.clone()))


def _saved(mode):
    return torch.load(DATA / f"{mode}.pt", weights_only=True)


def _same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


def _within_a_code(new, old, name):
    """Today's 8-bit value of an old float32 value: one of the two code values around it (at least 2
    mantissa bits: a relative error below 1/4), or below the block's range (its subnormals: an
    absolute error below the block's unit / 4); nan and inf as they were."""
    assert torch.equal(new.isnan(), old.isnan()) and torch.equal(new.isinf(), old.isinf()), name
    finite = old.isfinite()
    err = (new[finite] - old[finite]).abs()
    blocks = old.where(finite, 0.0).abs().reshape(-1, 128).amax(1, keepdim=True)
    unit = torch.exp2(torch.floor(torch.log2(blocks)) - E._SPAN[name])  # the block's 2**(base - 127)
    unit = unit.expand(-1, 128).reshape(old.shape)[finite]
    assert (err <= torch.maximum(old[finite].abs() / 4, unit / 4) * (1 + 1e-6)).all(), name


@pytest.mark.parametrize("mode", ["split", "bf16", "compact"])
@pytest.mark.parametrize("into", ["same", "fp32"])
def test_old_state_dict_loads(mode, into):
    saved = _saved(mode)
    model = Model(saved["params"])
    opt = halfadam.AdamW(model.parameters(), lr=1e-3, state_mode=mode if into == "same" else "fp32",
                         implementation="foreach")
    opt.load_state_dict(saved["state_dict"])
    for name, p in model.named_parameters():
        st, old = opt.state[p], saved["decoded"][name]
        assert not any(k in st for k in E.LEGACY_BLOCK_KEYS)
        new = E.decode_state(E.format_of(st), p.detach(), st)
        assert int(st["step"]) == 5
        if "master_weight" in old:
            assert _same(new["master_weight"], old["master_weight"]), name  # masters exactly
        for key in ("exp_avg", "exp_avg_sq"):
            if st[key].dtype == torch.uint8:
                _within_a_code(new[key], old[key], key)
            else:
                assert _same(new[key], old[key]), (name, key)  # float32 and bf16: exactly
    if mode == "compact" and into == "same":
        assert opt.state[model.w1]["exp_avg_scale"].shape == (8, 2)
    for p in model.parameters():  # and it steps on
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(p.isfinite().all() for n, p in model.named_parameters() if n != "nonfinite")


@pytest.mark.parametrize("into", ["compact", "fp32"])
def test_old_dcp_checkpoint_loads(into):
    saved = _saved("compact")
    model = Model({k: torch.zeros_like(v) for k, v in saved["params"].items()})
    opt = halfadam.AdamW(model.parameters(), lr=1e-3, state_mode=into)
    load_checkpoint(str(DATA / "compact.dcp"), model, opt)
    for name, p in model.named_parameters():
        assert _same(p.detach().float(), saved["params"][name].float()), name
        st, old = opt.state[p], saved["decoded"][name]
        new = E.decode_state(E.format_of(st), p.detach(), st)
        if "master_weight" in old:
            assert _same(new["master_weight"], old["master_weight"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            if st[key].dtype == torch.uint8:
                _within_a_code(new[key], old[key], key)
            else:
                assert _same(new[key], old[key]), (name, key)


def test_old_codes_decode_as_that_release_did():
    """The kept decoder of the 2026-12-01 codes gives that release's values bit for bit."""
    saved = _saved("compact")
    for name, value in saved["params"].items():
        st = saved["state_dict"]["state"][list(saved["params"]).index(name)]
        st = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
        fmt = E.format_of(st)
        assert fmt.legacy == ("exp_avg_absmax" in st)
        got = E.decode_state(fmt, value, st)
        for key, want in saved["decoded"][name].items():
            assert torch.equal(got[key].view(torch.int32), want.view(torch.int32)), (name, key)
    assert "codes of 2026-12-01" in E.format_of({**st, "exp_avg": torch.zeros(1, dtype=torch.uint8),
                                                  "exp_avg_absmax": torch.zeros(1)}).describe()
