"""State dicts of 8-bit codes (issue 33 item 1): torch.optim must not take the uint8 codes for moments.

A state_dict entry whose ``exp_avg``/``exp_avg_sq`` are uint8 codes (state modes 'compact' and 'tiny')
carries ``encodings.CODES_LABEL`` in ``step``, a dict with the step count under ``halfadam_step``: torch's
``Adam``/``AdamW.load_state_dict`` reads ``float(step)`` and raises; halfadam's loader takes the count
back (bit for bit), still loads entries saved before the label, and refuses a label it does not
know. Every expected value comes from an uninterrupted run or from the optimizer as it was.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import halfadam
from conftest import needs_gloo
from halfadam import encodings as E
from halfadam.checkpoint import CheckpointError

CODES = ["compact", "tiny"]


def make(mode, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 8), nn.Tanh(), nn.Linear(8, 128)).to(torch.bfloat16)
    return model, halfadam.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, state_mode=mode)


def train(model, opt, steps, start=0):
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + t)
        opt.zero_grad()
        model(torch.randn(4, 256, generator=g).to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()


def saved(obj):
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def state_bits(opt):
    """Every parameter's state tensors (copies; a ZeroRedundancyOptimizer's loaded 'remainder_dtype' aside)."""
    return [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
            for g in opt.param_groups for p in g["params"]]


def same_state(a, b):
    return all(x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)
               for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module", params=CODES)
def run(request):
    """``(mode, model state_dict and optimizer state_dict after 3 steps (saved), model after 5)``."""
    model, opt = make(request.param)
    train(model, opt, 3)
    msd, osd = saved(model.state_dict()), saved(opt.state_dict())
    train(model, opt, 2, start=3)
    return request.param, msd, osd, model, state_bits(opt)


def resumed(mode, msd, osd):
    model, opt = make(mode, seed=1)  # other weights: everything comes from the dicts
    model.load_state_dict(msd)
    opt.load_state_dict(copy.deepcopy(osd))
    train(model, opt, 2, start=3)
    return model, opt


def test_a_packed_state_dict_is_labelled(run):
    mode, _, osd, _, _ = run
    entry = osd["state"][0]  # the first weight: 8-bit codes
    assert entry["exp_avg"].dtype == torch.uint8 and entry["step"][E.CODES_KEY] == 3
    assert torch.equal(entry["step"][E.LABELLED_STEP], torch.tensor(3.0)) and E.LABELLED_STEP not in entry
    assert isinstance(osd["state"][1]["step"], torch.Tensor)  # its bias: float32 moments, no label


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_torch_refuses_a_packed_state_dict(run, cls):
    """Without the label torch loads it and steps with codes as moments (238 for -1.125)."""
    mode, msd, osd, _, _ = run
    model, _ = make(mode, seed=1)
    with pytest.raises(TypeError, match=r"float\(\) argument must be a string or a real number, not 'dict'"):
        cls(model.parameters(), lr=1e-2).load_state_dict(copy.deepcopy(osd))


def test_halfadam_resumes_its_labelled_dict_bit_for_bit(run):
    mode, msd, osd, model, state = run
    model2, opt2 = resumed(mode, msd, osd)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert same_state(state, state_bits(opt2))
    assert all(E.LABELLED_STEP not in st and isinstance(st["step"], torch.Tensor) for st in opt2.state.values())


def test_a_dict_labelled_in_bytes_still_loads(run):
    """Releases up to 673f2dc labelled with bytes in ``step``, the count beside it."""
    mode, msd, osd, model, state = run
    old = copy.deepcopy(osd)
    for pid, st in old["state"].items():
        if isinstance(st["step"], dict):
            old["state"][pid] = {**st, "step": E.OLDER_CODES_LABELS[0], E.LABELLED_STEP: st["step"][E.LABELLED_STEP]}
    model2, opt2 = resumed(mode, msd, old)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert same_state(state, state_bits(opt2))


def test_a_dict_saved_before_the_label_still_loads(run):
    mode, msd, osd, model, state = run
    old = copy.deepcopy(osd)
    old["state"] = {pid: E.unlabelled(st, "") for pid, st in old["state"].items()}  # as written before labels
    assert all(isinstance(st["step"], torch.Tensor) and E.LABELLED_STEP not in st for st in old["state"].values())
    model2, opt2 = resumed(mode, msd, old)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert same_state(state, state_bits(opt2))


@pytest.mark.parametrize("change, match", [
    (dict(step={"halfadam_8bit_codes": 4, "halfadam_step": torch.tensor(3.0)}),
     r"is labelled \{'halfadam_8bit_codes': 4, .*which this version of halfadam does not read"),
    (dict(step=b"halfadam 8-bit codes v3: something new"), r"is labelled b'halfadam 8-bit codes v3: something new', "
                                                           r"which this version of halfadam does not read"),
    (dict(step="another library's state"), r"is labelled \"another library's state\", which this version"),
    (dict(step=torch.tensor(3.0), halfadam_step=torch.tensor(3.0)), r"has a 'halfadam_step' but no label in 'step'"),
    (dict(step={"halfadam_8bit_codes": 3}), r"is labelled as 8-bit codes but has no 'halfadam_step'"),
])
def test_another_label_is_refused_naming_the_parameter_and_changes_nothing(run, change, match):
    mode, msd, osd, _, _ = run
    model, opt = make(mode, seed=1)
    train(model, opt, 1)
    before, groups = state_bits(opt), copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                                     for g in opt.param_groups])
    bad = copy.deepcopy(osd)
    bad["state"][0].update(change)
    with pytest.raises(CheckpointError, match=r"parameter 0 \(param_groups\[0\]\['params'\]\[0\].*: its state " + match):
        opt.load_state_dict(bad)
    assert same_state(before, state_bits(opt))
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def test_a_label_over_moments_that_are_not_codes_is_refused():
    model, opt = make("fp32")
    train(model, opt, 1)
    sd = opt.state_dict()
    sd["state"][0] = {**sd["state"][0], "step": {**E.CODES_LABEL, E.LABELLED_STEP: sd["state"][0]["step"]}}
    with pytest.raises(CheckpointError, match=r"parameter 0 .*neither exp_avg nor exp_avg_sq is uint8"):
        make("fp32", seed=1)[1].load_state_dict(sd)


@pytest.mark.parametrize("mode", ["fp32", "split", "bf16"])
def test_modes_without_codes_carry_no_label_and_torch_loads_them(mode):
    """Their moments are numbers (float32; bfloat16, which torch casts exactly): torch loads them as before."""
    model, opt = make(mode)
    train(model, opt, 2)
    sd = saved(opt.state_dict())
    assert all(isinstance(st["step"], torch.Tensor) and E.LABELLED_STEP not in st for st in sd["state"].values())
    torch.optim.AdamW(make(mode, seed=1)[0].parameters()).load_state_dict(sd)


@pytest.mark.parametrize("mode", CODES)
def test_to_torch_state_dict_has_no_label_and_steps_as_halfadam(mode):
    """torch.optim.AdamW on float32 copies of the masters, from the exported (decoded) moments, takes
    the step halfadam takes from the same moments: the masters agree to float32 rounding."""
    model, opt = make(mode)
    train(model, opt, 3)
    exported = saved(opt.to_torch_state_dict())
    assert all(isinstance(st["step"], torch.Tensor) and E.LABELLED_STEP not in st
               and st["exp_avg"].dtype == torch.float32 for st in exported["state"].values())
    params = [opt.master_weight(p).detach().clone().requires_grad_() for p in model.parameters()]
    torch_opt = torch.optim.AdamW(params)
    torch_opt.load_state_dict(exported)
    assert torch.equal(torch_opt.state[params[0]]["step"], torch.tensor(3.0))
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in model.parameters()]
    for p, q, gr in zip(model.parameters(), params, grads):
        p.grad, q.grad = gr, gr.float()
    opt.step()
    torch_opt.step()
    for p, q in zip(model.parameters(), params):  # a step of about lr = 1e-2
        if mode == "tiny" and p.dim() > 1:  # 8-bit remainders (2**-8 of a bf16 ulp), rounded stochastically
            ulp = torch.exp2(torch.floor(torch.log2(q.detach().abs())) - 7)
            assert ((opt.master_weight(p) - q.detach()).abs() <= ulp * 2 ** -7).all()  # two of their units
        else:  # split masters: float32's rounding
            torch.testing.assert_close(opt.master_weight(p), q.detach(), rtol=1e-6, atol=1e-8)


def test_master_state_dict_is_unchanged_by_the_label():
    model, opt = make("compact")
    train(model, opt, 2)
    out = opt.master_state_dict(model)
    assert all(v.dtype == torch.float32 for v in out.values())
    assert torch.equal(out["0.weight"], opt.master_weight(model[0].weight))


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo process group (ZeroRedundancyOptimizer needs one)."""
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def zero(seed, mode):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(256, 8), nn.Tanh(), nn.Linear(8, 128)).to(torch.bfloat16)
    return m, ZeroRedundancyOptimizer(m.parameters(), optimizer_class=halfadam.AdamW, lr=1e-2, weight_decay=0.1,
                                      state_mode=mode)


def zero_run(mode):
    """A ZeRO run: 3 steps, its consolidated optimizer and model state dicts (copies), then 2 steps more."""
    model, opt = zero(0, mode)
    train(model, opt, 3)
    opt.consolidate_state_dict(to=0)
    osd, msd = saved(opt.state_dict()), saved(model.state_dict())
    train(model, opt, 2, start=3)
    return model, opt, osd, msd


@needs_gloo
@pytest.mark.parametrize("mode", CODES)
def test_zero_redundancy_optimizer_resumes_bit_for_bit_and_torch_refuses_its_dict(one_rank, mode):
    """ZeroRedundancyOptimizer.load_state_dict puts each entry into the local optimizer's state as it
    is (label included): halfadam takes its step count back at the next step."""
    model, opt, osd, msd = zero_run(mode)
    assert osd["state"][0]["step"][E.CODES_KEY] == 3
    with pytest.raises(TypeError, match="not 'dict'"):
        torch.optim.AdamW(zero(1, mode)[0].parameters()).load_state_dict(copy.deepcopy(osd))
    model2, opt2 = zero(1, mode)
    model2.load_state_dict(msd)
    opt2.load_state_dict(copy.deepcopy(osd))
    train(model2, opt2, 2, start=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert same_state(state_bits(opt.optim), state_bits(opt2.optim))
    bad = copy.deepcopy(osd)
    bad["state"][0]["step"] = b"halfadam 8-bit codes v3"
    model3, opt3 = zero(1, mode)
    opt3.load_state_dict(bad)  # torch's: as it is
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\]: its state is labelled "
                                         r"b'halfadam 8-bit codes v3'"):
        train(model3, opt3, 1)


@needs_gloo
@pytest.mark.parametrize("mode", ["fp32", "split", "bf16", "compact", "tiny"])
def test_zero_load_into_a_stepped_optimizer_resumes_bit_for_bit(one_rank, mode):
    """ZeroRedundancyOptimizer.load_state_dict replaces the local optimizer's state dicts: an optimizer that
    stepped before (its state in flat buckets) must step from the loaded values, not from its buckets'."""
    model, opt, osd, msd = zero_run(mode)
    model2, opt2 = zero(1, mode)
    train(model2, opt2, 2, start=7)  # stepped: its state lives in its buckets
    model2.load_state_dict(msd)
    opt2.load_state_dict(copy.deepcopy(osd))
    train(model2, opt2, 2, start=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert same_state(state_bits(opt.optim), state_bits(opt2.optim))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("mode", CODES)
def test_dcp_checkpoints_with_and_without_the_label_load_bit_for_bit(tmp_path, monkeypatch, mode):
    """halfadam.distributed.save_checkpoint writes the label (a dict: a number and the count); checkpoints
    written before it (``step`` a tensor) or with the bytes label of releases up to 673f2dc load too: the
    layout takes each field's kind from the checkpoint."""
    pytest.importorskip("torch.distributed.checkpoint")
    import halfadam.distributed as hd
    from halfadam import state_dict as SD

    model, opt = make(mode)
    train(model, opt, 3)
    hd.save_checkpoint(tmp_path / "new", model, opt)
    with monkeypatch.context() as m:  # as written before labels
        m.setattr(SD.encodings, "labelled", lambda entry: entry)
        hd.save_checkpoint(tmp_path / "old", model, opt)
    with monkeypatch.context() as m:  # as written up to 673f2dc: a bytes label, the count beside it
        m.setattr(SD.encodings, "labelled", lambda entry: {**entry, "step": E.OLDER_CODES_LABELS[0],
                                                           E.LABELLED_STEP: entry["step"]} if E.has_codes(entry) else entry)
        hd.save_checkpoint(tmp_path / "bytes", model, opt)
    expected = state_bits(opt)
    for name in ("new", "old", "bytes"):
        model2, opt2 = make(mode, seed=1)
        hd.load_checkpoint(tmp_path / name, model2, opt2)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters())), name
        assert same_state(expected, state_bits(opt2)), name
        for other in ("fp32", "compact" if mode == "tiny" else "tiny"):  # and into another mode, as in one process
            model3, opt3 = make(other, seed=1)
            hd.load_checkpoint(tmp_path / name, model3, opt3)
            model4, opt4 = make(other, seed=1)
            model4.load_state_dict(model.state_dict())
            opt4.load_state_dict(opt.state_dict())
            assert same_state(state_bits(opt4), state_bits(opt3)), (name, other)
