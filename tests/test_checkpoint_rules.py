"""Checkpoints of the engine's other update rules, halfadam.SGD (with and without momentum) and halfadam.Lion,
as they work for AdamW (tests/test_checkpoint.py, tests/test_state_modes.py, tests/test_dcp_checkpoints.py).

* ``state_dict``/``load_state_dict`` in every state mode: the loaded state is the saved one bit for bit, and
  the resumed run is the uninterrupted one bit for bit (the reference: the same run, never saved);
* across modes: a split master loads into fp32 exactly, fp32 <-> split continues bit for bit, a lossy mode
  stays within a bound of the uninterrupted run;
* torch interop: ``torch.optim.SGD``'s state dict loads and the run continues as torch's (a loaded buffer
  counts as one step taken: torch's own run is the reference), ``to_torch_state_dict`` continues in torch
  as in halfadam; Lion: lucidrains' layout (the Lion paper's update, transcribed here, is the reference) and
  optimi's;
* a checkpoint of another rule is a CheckpointError naming what differs, nothing changed;
* DCP (``halfadam.distributed.save_checkpoint``/``load_checkpoint``, one process, no process group) in every
  mode: the single-process load's result.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn as nn

import halfadam
from halfadam import encodings as E
from halfadam.checkpoint import CheckpointError

MODES = ("fp32", "split", "bf16", "compact", "tiny")
#: The optimizers under test: (id, class, keyword arguments, the rule's moment keys).
RULES = [("sgd-momentum", halfadam.SGD, dict(momentum=0.9, dampening=0.1, weight_decay=0.01), ("momentum_buffer",)),
         ("sgd-nesterov", halfadam.SGD, dict(momentum=0.8, nesterov=True, maximize=True), ("momentum_buffer",)),
         ("sgd-plain", halfadam.SGD, dict(weight_decay=0.05), ()),
         ("lion", halfadam.Lion, dict(betas=(0.9, 0.99), weight_decay=0.1), ("exp_avg",))]
IDS = [r[0] for r in RULES]
LR = {halfadam.SGD: 1e-2, halfadam.Lion: 1e-3, halfadam.AdamW: 1e-3}


def make(cls, kw, mode="fp32", dtype=torch.bfloat16, seed=0, **extra):
    """A small MLP: a weight of rows of 2 blocks and a short one, one of short rows, 1-D biases."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(300, 16), nn.Tanh(), nn.Linear(16, 140)).to(dtype)
    return model, cls(model.parameters(), lr=LR[cls], state_mode=mode, **kw, **extra)


def train(model, opt, steps, start=0):
    dtype = next(model.parameters()).dtype
    for t in range(start, start + steps):
        x = torch.randn(4, 300, generator=torch.Generator().manual_seed(t)).to(dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def bits(t):
    return t.view(torch.uint8) if t.dim() else t.reshape(1)


def state_snapshot(model, opt):
    """Every parameter and state tensor (copies), and the groups' plain values."""
    tensors = {f"p{i}": p.detach().clone() for i, p in enumerate(model.parameters())}
    for i, p in enumerate(model.parameters()):
        tensors.update({f"s{i}.{k}": v.clone() for k, v in opt.state.get(p, {}).items()})
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr_schedule", "weight_decay_schedule")}
              for g in opt.param_groups]
    return tensors, groups


def assert_same(a, b):
    (ta, ga), (tb, gb) = a, b
    assert ta.keys() == tb.keys() and ga == gb
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(bits(ta[k]), bits(tb[k])), k


# ------------------------------------------------------------------------------ state_dict, one mode
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, cls, kw, moments", RULES, ids=IDS)
def test_state_dict_round_trip_is_bit_for_bit(name, cls, kw, moments, mode):
    model, opt = make(cls, kw, mode)
    train(model, opt, 3)
    saved = roundtrip(opt.state_dict())  # torch.load(weights_only=True) reads it
    fmt = E.PRESETS[mode].for_rule(opt.rule.moments)
    entry = saved["state"][0]  # the first weight: the mode's keys, the rule's moments
    assert set(entry) == ({"step"} | set(E.element_keys(fmt, True)) | set(E.block_keys(fmt, True))
                          | ({"remainder_dtype"} if fmt.master != "fp32" else set()))
    assert [k for k in entry if k in E.MOMENT_KINDS] == list(moments)
    codes = fmt.exp_avg == torch.uint8 and bool(moments)  # 8-bit codes: labelled
    assert isinstance(entry["step"], dict) is codes
    assert set(saved["param_groups"][0]) >= {"global_step", *opt._required}

    model2, opt2 = make(cls, kw, mode, seed=1)
    train(model2, opt2, 1, start=7)  # state of other values, loaded into
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(saved)
    assert_same(state_snapshot(model2, opt2), state_snapshot(model, opt))
    train(model2, opt2, 2, start=3)
    train(model, opt, 2, start=3)  # the uninterrupted run
    assert_same(state_snapshot(model2, opt2), state_snapshot(model, opt))


@pytest.mark.parametrize("name, cls, kw, moments", RULES, ids=IDS)
def test_halfadam_checkpoint_files(tmp_path, name, cls, kw, moments):
    """halfadam.checkpoint.save_checkpoint/load_checkpoint (one file, checksummed) in a packed mode."""
    from halfadam.checkpoint import load_checkpoint, save_checkpoint

    model, opt = make(cls, kw, "compact")
    train(model, opt, 3)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=3)
    model2, opt2 = make(cls, kw, "compact", seed=1)
    assert load_checkpoint(tmp_path / "c.pt", model=model2, optimizer=opt2)["step"] == 3
    assert_same(state_snapshot(model2, opt2), state_snapshot(model, opt))


# ------------------------------------------------------------------------------ across state modes
#: Whether a mode stores the state exactly (else its moments, or the tiny master, round).
EXACT = {"fp32": True, "split": True, "bf16": False, "compact": False, "tiny": False}
#: Bounds after 3 more steps, loaded into another mode where one of the two is lossy: SGD, max |master -
#: uninterrupted master| (measured 5e-5 at most); Lion, whose steps are +-lr whatever a moment's size, the
#: share of elements whose master moved otherwise (by more than lr / 10; measured 0.5% at most, where a
#: zero moment in place of the loaded one moves 16% otherwise).
SGD_BOUND, LION_SHARE = 2.5e-4, 0.025


@pytest.mark.parametrize("saved_mode, load_mode", [("compact", "fp32"), ("fp32", "compact"), ("fp32", "split"),
                                                   ("split", "fp32"), ("tiny", "bf16"), ("bf16", "tiny")])
@pytest.mark.parametrize("name, cls, kw, moments", RULES, ids=IDS)
def test_loads_across_state_modes(name, cls, kw, moments, saved_mode, load_mode):
    model, opt = make(cls, kw, saved_mode)
    train(model, opt, 3)
    saved = roundtrip(opt.state_dict())
    masters = [opt.master_weight(p) for p in model.parameters()]
    model2, opt2 = make(cls, kw, load_mode, seed=1)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(saved)
    for i, (p, q) in enumerate(zip(model.parameters(), model2.parameters())):
        if "split8" not in (E.PRESETS[saved_mode].master, E.PRESETS[load_mode].master) or p.dim() == 1:
            # an fp32 or a 16-bit split master holds the other exactly (the 8-bit one rounds)
            assert torch.equal(bits(opt2.master_weight(q)), bits(masters[i]))
        opt2.sync_master_weights()  # a split master loaded into fp32 stays a remainder until then (any order of loads)
        fmt = E.for_param(E.PRESETS[load_mode].for_rule(opt2.rule.moments), q, True)
        assert set(opt2.state[q]) == {"step"} | set(E.element_keys(fmt, True)) | set(E.block_keys(fmt, True))
        if saved_mode in ("fp32", "split") and load_mode in ("fp32", "split"):  # float32 moments, as saved
            for key in moments:
                assert torch.equal(opt2.state[q][key], opt.state[p][key])
        if load_mode == "fp32" and moments:  # the saved codes, decoded
            src = E.for_param(E.PRESETS[saved_mode].for_rule(opt.rule.moments), p, True)
            decoded = E.decode_state(src, p, opt.state[p], moments)
            assert torch.equal(opt2.state[q][moments[0]], decoded[moments[0]])
    train(model, opt, 3, start=3)
    train(model2, opt2, 3, start=3)
    diffs = [(opt2.master_weight(q) - opt.master_weight(p)).abs()
             for p, q in zip(model.parameters(), model2.parameters())]
    if EXACT[saved_mode] and EXACT[load_mode]:  # fp32 <-> split: the same run, bit for bit
        for p, q in zip(model.parameters(), model2.parameters()):
            assert torch.equal(p, q) and torch.equal(bits(opt2.master_weight(q)), bits(opt.master_weight(p)))
    elif cls is halfadam.Lion:
        moved = sum((d > LR[cls] / 10).sum().item() for d in diffs) / sum(d.numel() for d in diffs)
        assert moved <= LION_SHARE, moved
    else:
        assert max(d.max().item() for d in diffs) <= SGD_BOUND


# ------------------------------------------------------------------------------ torch.optim.SGD
SGD_CASES = [dict(momentum=0.9, dampening=0.3, weight_decay=0.01), dict(momentum=0.9, nesterov=True),
             dict(momentum=0.8, maximize=True, weight_decay=0.02), dict(weight_decay=0.05)]


def _fp32_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((16, 40), (300,), (7, 5, 3))]


def _grads(params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]


def _run(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("kw", SGD_CASES, ids=str)
def test_torch_sgd_state_dict_loads_and_continues_as_torch(kw):
    """A loaded momentum_buffer is carried on (one step taken), not replaced by the first step's b <- g:
    with dampening 0.3 the two differ by 30%."""
    params = _fp32_params()
    torch_opt = torch.optim.SGD(params, lr=0.01, **kw)
    _run(torch_opt, params, _grads(params, 3, seed=1))
    saved = roundtrip(torch_opt.state_dict())
    ours = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = halfadam.SGD(ours, lr=0.5, momentum=0.9 if kw.get("momentum") else 0)  # other values: replaced
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fp32 parameters: no master to rebuild, no warning
        opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"], group["maximize"]) == (
        0.01, kw.get("momentum", 0), kw.get("nesterov", False), kw.get("maximize", False))
    if kw.get("momentum"):
        assert group["global_step"] == 1 and all(opt.state[q]["step"].item() == 1 for q in ours)
        for p, q in zip(params, ours):
            assert torch.equal(opt.state[q]["momentum_buffer"], torch_opt.state[p]["momentum_buffer"])
    else:
        assert saved["state"] == {} and not opt.state and group["global_step"] == 0
    more = _grads(params, 3, seed=2)
    _run(torch_opt, params, more)
    _run(opt, ours, more)
    for p, q in zip(params, ours):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw", SGD_CASES, ids=str)
def test_to_torch_sgd_continues_in_torch_as_in_halfadam(kw):
    params = _fp32_params()
    opt = halfadam.SGD(params, lr=[0.02, 0.01, 0.005, 0.004, 0.003], **kw)
    _run(opt, params, _grads(params, 3, seed=1))
    exported = roundtrip(opt.to_torch_state_dict())
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.SGD(theirs, lr=1.0)
    reference = torch_opt.state_dict()["param_groups"][0]
    assert set(exported["param_groups"][0]) == set(reference)  # torch's keys, no halfadam one
    assert exported["param_groups"][0]["lr"] == 0.004  # the next step's
    assert all(set(st) == {"momentum_buffer"} for st in exported["state"].values())  # torch's layout: no step
    assert len(exported["state"]) == (3 if kw.get("momentum") else 0)
    torch_opt.load_state_dict(exported)
    for group in opt.param_groups:  # a constant lr from here on, as torch's
        group["lr_schedule"], group["lr"] = None, 0.004
    more = _grads(params, 3, seed=2)
    _run(opt, params, more)
    _run(torch_opt, theirs, more)
    for p, q in zip(params, theirs):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


def test_torch_sgd_state_into_bf16_rebuilds_masters_with_a_warning():
    model, _ = make(halfadam.SGD, {}, dtype=torch.bfloat16)
    torch_opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    train(model, torch_opt, 2)
    model2, opt2 = make(halfadam.SGD, dict(momentum=0.9), dtype=torch.bfloat16, seed=1)
    model2.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match=r"master weights rebuilt .*\[0, 1, 2, 3\] \(a torch.optim.SGD checkpoint"):
        opt2.load_state_dict(torch_opt.state_dict())
    for p, q in zip(model.parameters(), model2.parameters()):
        st = opt2.state[q]
        assert torch.equal(st["master_weight"], q.float()) and st["step"].item() == 1
        assert st["momentum_buffer"].dtype == torch.float32
        assert torch.equal(st["momentum_buffer"], torch_opt.state[p]["momentum_buffer"].float())


def test_an_older_torch_none_buffer_is_no_state():
    """torch.optim.SGD before 2.2 kept ``momentum_buffer: None`` at momentum 0; at momentum > 0 a None
    buffer is one not made yet: the next step makes it, b <- g, as torch does."""
    ours = _fp32_params()
    opt = halfadam.SGD(ours, lr=0.5, momentum=0.9)
    _run(opt, ours, _grads(ours, 1, seed=3))  # a state, which the load drops
    params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    torch_opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    saved = {"state": {i: {"momentum_buffer": None} for i in range(3)},
             "param_groups": [dict(torch_opt.state_dict()["param_groups"][0])]}
    with pytest.warns(UserWarning, match="have no state in the checkpoint"):
        opt.load_state_dict(saved)
    assert not opt.state and opt.param_groups[0]["lr"] == 0.01
    grads = _grads(params, 2, seed=4)
    _run(opt, ours, grads)
    _run(torch_opt, params, grads)
    for p, q in zip(params, ours):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------ Lion: lucidrains, optimi
def _lion_paper_(p, g, m, lr, beta1, beta2, wd):
    """Chen et al. 2023, Algorithm 2, as lucidrains' lion-pytorch writes it."""
    p.mul_(1 - lr * wd)
    p.add_((m * beta1 + g * (1 - beta1)).sign_(), alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1 - beta2)


def _lion_reference(params, grads, moments, lr=1e-3, betas=(0.9, 0.99), wd=0.1):
    with torch.no_grad():
        for gs in grads:
            for p, g, m in zip(params, gs, moments):
                _lion_paper_(p, g, m, lr, *betas, wd)


@pytest.mark.parametrize("layout", ["lucidrains", "optimi"])
def test_lion_state_dict_of_the_others_loads_and_continues(layout):
    params = [p.detach() for p in _fp32_params()]
    moments = [torch.zeros_like(p) for p in params]
    _lion_reference(params, _grads(params, 3, seed=1), moments, betas=(0.95, 0.98))
    group = (dict(lr=1e-3, betas=(0.95, 0.98), weight_decay=0.1, params=[0, 1, 2]) if layout == "lucidrains" else
             dict(lr=1e-3, beta1=0.95, beta2=0.98, weight_decay=0.1, decouple_lr=False, max_lr=None, kahan_sum=False,
                  foreach=True, gradient_release=False, setup=True, params=[0, 1, 2]))
    state = {i: {"exp_avg": m.clone(), **({"kahan_comp": None} if layout == "optimi" else {})}
             for i, m in enumerate(moments)}
    ours = [torch.nn.Parameter(p.clone()) for p in params]
    opt = halfadam.Lion(ours, lr=0.5)
    opt.load_state_dict({"state": state, "param_groups": [group]})
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["weight_decay"], g["global_step"]) == (1e-3, (0.95, 0.98), 0.1, 1)
    assert not {"beta1", "decouple_lr", "kahan_sum", "setup"} & set(g)
    more = _grads(params, 3, seed=2)
    _lion_reference(params, more, moments, betas=(0.95, 0.98))
    _run(opt, ours, more)
    for p, q, m in zip(params, ours, moments):
        torch.testing.assert_close(q.detach(), p, rtol=0, atol=1e-6)
        torch.testing.assert_close(opt.state[q]["exp_avg"], m, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["fp32", "compact"])
def test_lion_to_torch_is_lucidrains_layout_and_continues(mode):
    """In compact the exported moments are the codes decoded: the next step is the same; later ones
    differ where halfadam's moment rounds to its 8-bit codes again."""
    params = _fp32_params()
    opt = halfadam.Lion(params, lr=1e-3, weight_decay=0.1, state_mode=mode)
    _run(opt, params, _grads(params, 3, seed=1))
    exported = roundtrip(opt.to_torch_state_dict())
    assert [set(g) for g in exported["param_groups"]] == [{"lr", "betas", "weight_decay", "params"}]
    assert all(set(st) == {"exp_avg"} and st["exp_avg"].dtype == torch.float32 for st in exported["state"].values())
    theirs = [p.detach().clone() for p in params]
    moments = [exported["state"][i]["exp_avg"].clone() for i in range(3)]
    more = _grads(params, 3 if mode == "fp32" else 1, seed=2)
    _lion_reference(theirs, more, moments)
    _run(opt, params, more)
    for p, q in zip(params, theirs):
        torch.testing.assert_close(q, p.detach(), rtol=0, atol=1e-6)


def test_optimi_decouple_lr_is_refused():
    params = _fp32_params()
    opt = halfadam.Lion(params)
    group = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, decouple_lr=True, max_lr=1e-3, params=[0, 1, 2])
    with pytest.raises(CheckpointError, match=r"param_groups\[0\]: .*decouple_lr=True"):
        opt.load_state_dict({"state": {}, "param_groups": [group]})
    assert opt.param_groups[0]["lr"] == 1e-4


# ------------------------------------------------------------------------------ another rule's checkpoint
def _checkpoint(cls, **kw):
    model, opt = make(cls, kw, "compact")
    train(model, opt, 2)
    return opt.state_dict()


def _torch_adamw_state_dict():
    model, _ = make(halfadam.SGD, {})
    opt = torch.optim.AdamW(model.parameters())
    train(model, opt, 1)
    return opt.state_dict()


CROSS = [
    ("adamw-into-sgd", lambda: _checkpoint(halfadam.AdamW), halfadam.SGD, dict(momentum=0.9),
     r"param_groups\[0\] in the checkpoint has no \['momentum', 'dampening', 'nesterov', 'maximize'\].*"
     r"it holds \['betas', 'decay', 'eps', 'optimized_update'\] instead: it was written by another optimizer"),
    ("sgd-into-adamw", lambda: _checkpoint(halfadam.SGD, momentum=0.9), halfadam.AdamW, {},
     r"has no \['betas', 'eps', 'decay', 'optimized_update'\].*this AdamW.*"
     r"\['dampening', 'maximize', 'momentum', 'nesterov'\] instead"),
    ("lion-into-adamw", lambda: _checkpoint(halfadam.Lion), halfadam.AdamW, {},
     r"has no \['eps', 'decay', 'optimized_update'\]"),
    ("adamw-into-lion", lambda: _checkpoint(halfadam.AdamW), halfadam.Lion, {},
     r"parameter 0 .*holds \['exp_avg_sq'\], which this Lion does not keep \(its update rule 'lion' keeps "
     r"\['exp_avg'\]\): it was written by another optimizer"),
    ("sgd-momentum-into-plain", lambda: _checkpoint(halfadam.SGD, momentum=0.9), halfadam.SGD, {},
     r"param_groups\[0\]\['momentum'\] is 0.9, but this SGD was built with momentum 0"),
    ("sgd-plain-into-momentum", lambda: _checkpoint(halfadam.SGD), halfadam.SGD, dict(momentum=0.9),
     r"parameter 0 .*state key\(s\) \['momentum_buffer'\] missing"),
    ("torch-adamw-into-sgd", lambda: torch.optim.AdamW(make(halfadam.SGD, {})[0].parameters()).state_dict(),
     halfadam.SGD, {}, r"neither a halfadam group nor a torch.optim.SGD one \(keys \['amsgrad', 'betas'"),
    ("torch-adamw-into-lion", lambda: _torch_adamw_state_dict(), halfadam.Lion, {},
     r"parameter 0 .*holds \['exp_avg_sq'\], which this Lion does not keep"),
]


@pytest.mark.parametrize("name, source, cls, kw, match", CROSS, ids=[c[0] for c in CROSS])
def test_a_checkpoint_of_another_rule_is_refused_with_nothing_changed(name, source, cls, kw, match):
    saved = source()
    model, opt = make(cls, kw, "compact", seed=1)
    train(model, opt, 1)
    before = state_snapshot(model, opt)
    with pytest.raises(CheckpointError, match=match):
        opt.load_state_dict(saved)
    assert_same(state_snapshot(model, opt), before)


# ------------------------------------------------------------------------------ DCP
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("load_mode", MODES)
@pytest.mark.parametrize("name, cls, kw, moments", RULES, ids=IDS)
def test_dcp_checkpoint_loads_as_in_one_process(tmp_path, name, cls, kw, moments, load_mode):
    """halfadam.distributed.save_checkpoint in compact (and in the load's mode), load_checkpoint into
    ``load_mode``: the state and model of the single-process ``load_state_dict`` of the same state."""
    hd = pytest.importorskip("halfadam.distributed")
    for saved_mode in dict.fromkeys(("compact", load_mode)):
        model, opt = make(cls, kw, saved_mode)
        train(model, opt, 3)
        path = tmp_path / f"ckpt-{saved_mode}"
        hd.save_checkpoint(path, model, opt, extra={"step": 3})
        model2, opt2 = make(cls, kw, load_mode, seed=1)
        train(model2, opt2, 1, start=9)
        assert hd.load_checkpoint(path, model2, opt2) == {"step": 3}
        expected_model, expected_opt = make(cls, kw, load_mode, seed=2)
        expected_model.load_state_dict(model.state_dict())
        expected_opt.load_state_dict(opt.state_dict())
        assert_same(state_snapshot(model2, opt2), state_snapshot(expected_model, expected_opt))
        if saved_mode == load_mode:  # and the run goes on as the uninterrupted one
            train(model, opt, 2, start=3)
            train(model2, opt2, 2, start=3)
            assert_same(state_snapshot(model2, opt2), state_snapshot(model, opt))
