"""Checkpoints written by older releases keep loading: tests/data/state_2026-12-01/ holds optimizer
state that halfadam 763dbb7 (2026-12-01) wrote in the split, bf16 and compact modes (its 8-bit codes:
a dynamic-tree exp_avg and 24-octave log2 exp_avg_sq over a float32 ``*_absmax`` per block);
tests/data/state_2026-12-06/ the compact and tiny state that 1aa0217 (2026-12-06) wrote (exp_avg_sq
over 27 binades in ``exp_avg_sq_scale``, labelled ``v1``), and tests/data/state_2026-12-07/ that of 8d467ef
(2026-12-07: 46 binades in ``exp_avg_sq_base``, ``v2``), and tests/data/state_2026-12-07b/ that of 673f2dc
(today's codes in ``exp_avg_sq_exponent``, labelled ``v3`` in bytes before the dict labels); each with the
float32 values that release
decoded from it (tests/data/make_state_*.py wrote them). Loaded today, each state is decoded by its
format's rules and encoded in today's: exact wherever today's encoding holds the value exactly, within
one code step of today's 8-bit codes otherwise."""

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


def _saved(mode, data=DATA):
    return torch.load(data / f"{mode}.pt", weights_only=True)


def _same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


def _rel(name):
    """The largest relative step of today's codes of moment ``name`` (its lowest tier's mantissa bits)."""
    return 2.0 ** -E._TIERS[name][0][0]


def _within_a_code(new, old, name):
    """Today's 8-bit value of an old float32 value: one of the two code values around it (a relative
    error below :func:`_rel`), or below the block's range (its subnormals: an absolute error below the
    block's unit times that); nan and inf as they were."""
    assert torch.equal(new.isnan(), old.isnan()) and torch.equal(new.isinf(), old.isinf()), name
    finite = old.isfinite()
    err = (new[finite] - old[finite]).abs()
    blocks = old.where(finite, 0.0).abs().reshape(-1, 128).amax(1, keepdim=True)
    unit = torch.exp2(torch.floor(torch.log2(blocks)) - E._SPAN[name])  # the block's 2**(base - 127)
    unit = unit.expand(-1, 128).reshape(old.shape)[finite]
    assert (err <= torch.maximum(old[finite].abs(), unit) * _rel(name) * (1 + 1e-6)).all(), name


def _loads_as_saved(opt, model, saved):
    for name, p in model.named_parameters():
        st, old = opt.state[p], saved["decoded"][name]
        assert not any(k in st for k in E.LEGACY_BLOCK_KEYS) and int(st["step"]) == 5
        new = E.decode_state(E.format_of(st), p.detach(), st)
        if "master_weight" in old:
            assert _same(new["master_weight"], old["master_weight"]), name  # masters exactly
        for key in ("exp_avg", "exp_avg_sq"):
            if st[key].dtype == torch.uint8:
                _within_a_code(new[key], old[key], key)
            else:
                assert _same(new[key], old[key]), (name, key)  # float32 and bf16: exactly


@pytest.mark.parametrize("mode", ["split", "bf16", "compact"])
@pytest.mark.parametrize("into", ["same", "fp32"])
def test_old_state_dict_loads(mode, into):
    saved = _saved(mode)
    model = Model(saved["params"])
    opt = halfadam.AdamW(model.parameters(), lr=1e-3, state_mode=mode if into == "same" else "fp32",
                         implementation="foreach")
    opt.load_state_dict(saved["state_dict"])
    _loads_as_saved(opt, model, saved)
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
    _loads_as_saved(opt, model, saved)


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


def _within_a_code_in_rows(new, old, name):
    """:func:`_within_a_code` for a [rows, length] tensor in today's blocks: each row cut into blocks of
    128, its last one shorter (the scale of each is its own elements')."""
    rows, length = old.shape
    padded = -(-length // 128) * 128
    pad = lambda t: torch.nn.functional.pad(t, (0, padded - length)).reshape(-1)  # noqa: E731
    finite = old.isfinite()
    assert finite.all()
    err = (pad(new) - pad(old)).abs()
    blocks = pad(old).abs().reshape(-1, 128).amax(1, keepdim=True)
    unit = torch.exp2(torch.floor(torch.log2(blocks)) - E._SPAN[name]).expand(-1, 128).reshape(-1)
    assert (err <= torch.maximum(pad(old).abs(), unit) * _rel(name) * (1 + 1e-6)).all(), name


@pytest.mark.parametrize("layout", ["float32 fields", "flat blocks"])
def test_rows_with_short_blocks_load_from_older_layouts(layout):
    """A [5, 200] weight (rows of a block of 128 and one of 72): 763dbb7 (2026-12-01) kept float32 fields
    for it; releases before it kept its per-block state in blocks of 128 over the flattened parameter
    (1-D per-block keys). Both load into compact, converted to today's blocks: the master exactly, each
    moment within a code of the value the checkpoint holds."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(5, 200, generator=g) * 0.05).bfloat16())
    master = p.detach().float() * (1 + (torch.rand(5, 200, generator=g) - 0.5) * 2 ** -12)  # rounds to p
    m = torch.randn(5, 200, generator=g) * torch.logspace(-6, 0, 1000).view(5, 200)
    values = {"master_weight": master, "exp_avg": m, "exp_avg_sq": m * m * 2 + 1e-12}
    opt = halfadam.AdamW([p], lr=1e-3, state_mode="compact" if layout == "flat blocks" else "fp32",
                         implementation="foreach")
    p.grad = torch.zeros_like(p)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0] = E.unlabelled(sd["state"][0], "")  # as written before 8-bit codes were labelled
    if layout == "float32 fields":
        sd["state"][0].update({k: v.clone() for k, v in values.items()})
        held = values
    else:  # the flat layout, encoded by its rule (its 1-D keys select it in the decoder)
        fmt = E.PRESETS["compact"]
        old = {k: v.clone() for k, v in sd["state"][0].items() if isinstance(v, torch.Tensor) and k != "step"}
        old.update({k: torch.zeros(8, dtype=torch.uint8) for k in E.block_keys(fmt, True)})
        E.encode_state_(fmt, p.detach(), old, values, 5.0)
        sd["state"][0].update(old)
        held = E.decode_state(fmt, p.detach(), old)
        assert torch.equal(held["master_weight"], master)
    sd["state"][0]["step"] = torch.tensor(5.0)
    twin = torch.nn.Parameter(p.detach().clone())
    opt2 = halfadam.AdamW([twin], lr=1e-3, state_mode="compact", implementation="foreach")
    opt2.load_state_dict(sd)
    st = opt2.state[twin]
    assert st["exp_avg_scale"].shape == (5, 2) and st["master_tie"].shape == (5, 2)
    new = E.decode_state(E.PRESETS["compact"], twin.detach(), st)
    assert torch.equal(new["master_weight"], master)
    for key in ("exp_avg", "exp_avg_sq"):
        _within_a_code_in_rows(new[key], held[key], key)



#: The compact and tiny checkpoints of releases with tapered codes: their directory, their label's version,
#: their exp_avg_sq's per-block key and its codes (:attr:`halfadam.encodings.StateFormat.codes`).
TAPERED = {"1aa0217": ("state_2026-12-06", 1, "exp_avg_sq_scale", "2026-12-02"),
           "8d467ef": ("state_2026-12-07", 2, "exp_avg_sq_base", "2026-12-07"),
           "673f2dc": ("state_2026-12-07b", 3, "exp_avg_sq_exponent", "2026-12-07b")}  # today's codes, a bytes label
tapered = pytest.mark.parametrize("release", list(TAPERED))


@tapered
@pytest.mark.parametrize("mode", ["compact", "tiny"])
@pytest.mark.parametrize("into", ["same", "fp32"])
def test_state_dict_of_tapered_codes_loads(release, mode, into):
    """A state_dict of 1aa0217 (labelled v1, exp_avg_sq in ``exp_avg_sq_scale``), of 8d467ef (v2,
    ``exp_avg_sq_base``) or of 673f2dc (v3 in bytes, ``exp_avg_sq_exponent``) loads, by name of its keys decoded by its release's codes, re-encoded in today's;
    and it steps on."""
    folder, label, key, _ = TAPERED[release]
    saved = _saved(mode, DATA.parent / folder)
    first = saved["state_dict"]["state"][0]
    assert first["step"].startswith(b"halfadam 8-bit codes v%d" % label) and key in first
    model = Model(saved["params"])
    opt = halfadam.AdamW(model.parameters(), lr=1e-3, state_mode=mode if into == "same" else "fp32",
                         implementation="foreach")
    opt.load_state_dict(saved["state_dict"])
    _loads_as_saved(opt, model, saved)
    if into == "same":
        assert opt.state[model.w1]["exp_avg_sq_exponent"].shape == (8, 2)
        assert opt.state_dict()["state"][0]["step"][E.CODES_KEY] == 3  # saved again: today's label, v3
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(p.isfinite().all() for n, p in model.named_parameters() if n != "nonfinite")


@tapered
@pytest.mark.parametrize("mode", ["compact", "tiny"])
def test_dcp_checkpoint_of_tapered_codes_loads(release, mode):
    folder = DATA.parent / TAPERED[release][0]
    saved = _saved(mode, folder)
    model = Model({k: torch.zeros_like(v) for k, v in saved["params"].items()})
    opt = halfadam.AdamW(model.parameters(), lr=1e-3, state_mode=mode)
    load_checkpoint(str(folder / f"{mode}.dcp"), model, opt)
    for name, p in model.named_parameters():
        assert _same(p.detach().float(), saved["params"][name].float()), name
    _loads_as_saved(opt, model, saved)


@tapered
@pytest.mark.parametrize("mode", ["compact", "tiny"])
def test_tapered_codes_decode_as_their_release_did(release, mode):
    """The kept tiers of each release's exp_avg_sq codes give that release's values bit for bit."""
    folder, _, key, codes = TAPERED[release]
    saved = _saved(mode, DATA.parent / folder)
    for i, (name, value) in enumerate(saved["params"].items()):
        st = E.unlabelled(saved["state_dict"]["state"][i], name)
        st = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
        fmt = E.format_of(st)
        assert fmt.codes == (codes if key in st else E.CODES)
        got = E.decode_state(fmt, value, st)
        for k, want in saved["decoded"][name].items():
            assert torch.equal(got[k].view(torch.int32), want.view(torch.int32)), (name, k)
    if codes != E.CODES:
        assert f"codes of {codes}" in E.PRESETS["compact"].__class__("split", torch.uint8, torch.uint8,
                                                                    codes).describe()
