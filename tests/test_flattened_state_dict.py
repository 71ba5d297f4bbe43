"""``torch.distributed.checkpoint.state_dict`` with ``flatten_optimizer_state_dict=True`` (what torchtitan's
checkpointer asks for) in every state mode: DCP save, load into a fresh model and optimizer, and the run
continues bitwise as the uninterrupted one; in one process (no FSDP2) and on two gloo ranks under FSDP2.

torch's flattening takes state values that are tensors, numbers or dicts only, so halfadam's
``state_dict`` labels (a split master's ``remainder_dtype``, the 8-bit codes' ``step``) are dicts of
numbers; the label still makes ``torch.optim.AdamW.load_state_dict`` refuse 8-bit codes (``tests/test_foreign_state.py``).
The expected values are the uninterrupted run's, in the same process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import halfadam
import halfadam.distributed as hd
from conftest import needs_gloo
from halfadam import encodings as E
from halfadam.state_dict import REMAINDER_DTYPE

dcp = pytest.importorskip("torch.distributed.checkpoint")
sd_fns = pytest.importorskip("torch.distributed.checkpoint.state_dict")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MODES = ("fp32", "split", "bf16", "compact", "tiny")
FLAT = dict(flatten_optimizer_state_dict=True)


def make(mode, seed=0, wrap=lambda m: m):
    torch.manual_seed(seed)
    model = wrap(nn.Sequential(nn.Linear(256, 8), nn.Tanh(), nn.Linear(8, 128)).to(torch.bfloat16))
    return model, halfadam.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, state_mode=mode)


def train(model, opt, steps, start=0, rows=slice(None)):
    for t in range(start, start + steps):
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)[rows]
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def weights(model):
    return [full(p.detach()).clone() for p in model.parameters()]


def save_flattened(path, model, opt):
    """The model and the flattened optimizer state dict (torch's functions), saved with DCP."""
    osd = sd_fns.get_optimizer_state_dict(model, opt, options=sd_fns.StateDictOptions(**FLAT))
    assert "state" not in osd and all("." in k for k in osd)  # flattened: one key per value
    dcp.save({"model": sd_fns.get_model_state_dict(model), "optim": osd}, checkpoint_id=str(path))


def load_flattened(path, model, opt):
    """:func:`save_flattened`'s checkpoint loaded into ``model`` and ``opt`` (torch's functions)."""
    options = sd_fns.StateDictOptions(**FLAT)
    target = {"model": sd_fns.get_model_state_dict(model),
              "optim": sd_fns.get_optimizer_state_dict(model, opt, options=options)}
    dcp.load(target, checkpoint_id=str(path))
    sd_fns.set_model_state_dict(model, target["model"])
    sd_fns.set_optimizer_state_dict(model, opt, target["optim"], options=options)


def resumed(mode, path, wrap=lambda m: m, rows=slice(None)):
    """Train 3 steps, save the flattened optimizer state dict with DCP, load it into a fresh model and
    optimizer, train 2 more; returns the weights of the resumed and of the uninterrupted run."""
    model, opt = make(mode, wrap=wrap)
    train(model, opt, 3, rows=rows)
    save_flattened(path, model, opt)
    model2, opt2 = make(mode, seed=1, wrap=wrap)
    load_flattened(path, model2, opt2)
    train(model, opt, 2, start=3, rows=rows)
    train(model2, opt2, 2, start=3, rows=rows)
    return weights(model2), weights(model)


def bitwise(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("mode", MODES)
def test_flattened_round_trip_continues_bitwise(tmp_path, mode):
    got, expected = resumed(mode, tmp_path / "ckpt")
    assert bitwise(got, expected)


@pytest.mark.parametrize("mode", ["split", "compact"])
def test_labels_are_numbers_in_a_dict(mode):
    model, opt = make(mode)
    train(model, opt, 1)
    entry = opt.state_dict()["state"][0]
    assert entry[REMAINDER_DTYPE] == {"bfloat16": 1}
    if mode == "compact":
        assert entry["step"] == {"halfadam_8bit_codes": 3, "halfadam_step": torch.tensor(1.0)}
        assert E.LABELLED_STEP not in entry  # the live state's keys: torch's unflattening keeps only those
    else:
        assert torch.equal(entry["step"], torch.tensor(1.0))


def test_flattened_keys_name_the_codes():
    model, opt = make("compact")
    train(model, opt, 1)
    osd = sd_fns.get_optimizer_state_dict(model, opt, options=sd_fns.StateDictOptions(**FLAT))
    assert osd["state.0.weight.step.halfadam_8bit_codes"] == 3
    assert torch.equal(osd["state.0.weight.step.halfadam_step"], torch.tensor(1.0))
    assert osd["state.0.weight.remainder_dtype.bfloat16"] == 1
    assert osd["state.0.weight.exp_avg"].dtype == torch.uint8


def test_older_labels_still_load():
    """A state dict of release 673f2dc and before (bytes label, ``remainder_dtype`` a str) loads bitwise."""
    model, opt = make("compact")
    train(model, opt, 2)
    sd = opt.state_dict()
    labelled = {pid: st for pid, st in sd["state"].items() if isinstance(st["step"], dict)}  # the weights
    assert len(labelled) == 2
    old = {**sd, "state": {**sd["state"], **{
        pid: {**st, "step": E.OLDER_CODES_LABELS[0], E.LABELLED_STEP: st["step"][E.LABELLED_STEP], REMAINDER_DTYPE: "bfloat16"}
        for pid, st in labelled.items()}}}
    model2, opt2 = make("compact")
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(old)
    train(model, opt, 1, start=2)
    train(model2, opt2, 1, start=2)
    assert bitwise(weights(model2), weights(model))


def test_halfadam_checkpoint_helpers_refuse_flattening_by_name_and_change_nothing(tmp_path):
    """checkpoint_id, save_checkpoint and load_checkpoint lay out the nested state dict."""
    model, opt = make("compact")
    train(model, opt, 1)
    hd.save_checkpoint(tmp_path / "ckpt", model, opt)
    before = weights(model), {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    options = sd_fns.StateDictOptions(**FLAT)
    with pytest.raises(ValueError, match="flatten_optimizer_state_dict"):
        hd.get_optimizer_state_dict(model, opt, options=options, checkpoint_id=tmp_path / "ckpt")
    with pytest.raises(ValueError, match="flatten_optimizer_state_dict"):
        hd.load_checkpoint(tmp_path / "ckpt", model, opt, options=options)
    with pytest.raises(ValueError, match="flatten_optimizer_state_dict"):
        hd.save_checkpoint(tmp_path / "other", model, opt, options=options)
    assert not (tmp_path / "other").exists()
    assert bitwise(weights(model), before[0])
    assert all(torch.equal(v, before[1][k]) for k, v in opt.state[model[0].weight].items())


# ------------------------------------------------------------------------------ FSDP2, two gloo ranks
def _fsdp(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _worker(rank, world, out_dir):
    out = Path(out_dir)
    path = out / "ckpt"
    path_list = [str(path)]
    torch.distributed.broadcast_object_list(path_list)
    results = {}
    for mode in MODES:
        rows = slice(rank * 2, rank * 2 + 2)  # each rank its half of the batch
        got, expected = resumed(mode, Path(path_list[0]) / mode, wrap=_fsdp, rows=rows)
        results[mode] = bitwise(got, expected)
    torch.save(results, out / f"rank{rank}.pt")


@needs_gloo
@pytest.mark.distributed
def test_fsdp2_flattened_round_trip_continues_bitwise(tmp_path):
    hd.launch(_worker, 2, str(tmp_path), timeout_s=60)
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == {mode: True for mode in MODES}


def test_halfadam_helpers_name_a_flattened_checkpoint(tmp_path):
    model, opt = make("compact")
    train(model, opt, 2)
    save_flattened(tmp_path / "ckpt", model, opt)
    model2, opt2 = make("compact", seed=1)
    with pytest.raises(halfadam.checkpoint.CheckpointError, match="flattened .*flatten_optimizer_state_dict=True"):
        hd.load_checkpoint(tmp_path / "ckpt", model2, opt2)
    with pytest.raises(halfadam.checkpoint.CheckpointError, match="flattened"):
        hd.get_optimizer_state_dict(model2, opt2, checkpoint_id=tmp_path / "ckpt")
    assert not opt2.state


def test_a_fresh_optimizer_whose_state_dcp_did_not_make(tmp_path):
    """With gradients present DCP's get_optimizer_state_dict skips its own initialisation, and its flattened
    set rebuilds no entry: the load names the empty entry and init_state; after init_state it resumes bitwise."""
    model, opt = make("tiny")
    train(model, opt, 3)
    save_flattened(tmp_path / "ckpt", model, opt)
    train(model, opt, 2, start=3)
    for init in (False, True):
        model2, opt2 = make("tiny", seed=1)
        model2(torch.zeros(1, 256, dtype=torch.bfloat16)).float().sum().backward()  # a dry run: .grad set
        if not init:
            with pytest.raises(halfadam.checkpoint.CheckpointError, match=r"state entry is empty.*init_state"):
                load_flattened(tmp_path / "ckpt", model2, opt2)
            continue
        hd.init_state(opt2)
        load_flattened(tmp_path / "ckpt", model2, opt2)
        train(model2, opt2, 2, start=3)
        assert bitwise(weights(model2), weights(model))
