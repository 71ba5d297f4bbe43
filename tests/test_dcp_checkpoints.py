"""halfadam's DCP helpers: checksummed files, staged loads that change nothing unless they succeed,
schedules across state modes, a ``key=`` that matches nothing, DCP's BaseException as CheckpointError.

Single-process DCP (no process group) for most cases; one 2-rank FSDP2 launch (gloo) for a corrupt
shard of one rank. Every expected value comes from a path that does not go through DCP: the
optimizer's own ``state_dict``/``load_state_dict`` in one process, or the model and optimizer as they
were before the call.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import halfadam
import halfadam.distributed as hd
from conftest import needs_gloo
from halfadam.schedules import CosineWithWarmUpLR

dcp = pytest.importorskip("torch.distributed.checkpoint")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make(mode="compact", schedule=True, seed=0, **kw):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 8), nn.Tanh(), nn.Linear(8, 128)).to(torch.bfloat16)
    lr = CosineWithWarmUpLR(learning_rate=1e-2, warmup_steps=2, total_steps=20) if schedule else 1e-2
    return model, halfadam.AdamW(model.parameters(), lr=lr, weight_decay=0.1, state_mode=mode, **kw)


def train(model, opt, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 256, generator=g).to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()


def snapshot(model, opt):
    """Every parameter, buffer and state tensor, and the groups' plain values (copies)."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        out.update({f"state.{i}.{k}": v.clone() for k, v in opt.state.get(p, {}).items()})
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr_schedule", "weight_decay_schedule")}
              for g in opt.param_groups]
    return out, groups


def same(a, b):
    (ta, ga), (tb, gb) = a, b
    return ta.keys() == tb.keys() and ga == gb and all(
        ta[k].dtype == tb[k].dtype and torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8))
        if ta[k].dim() else torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture
def saved(tmp_path):
    """A compact run with a cosine schedule, 3 steps, saved by halfadam's helper with extra data."""
    model, opt = make("compact")
    train(model, opt)
    path = tmp_path / "ckpt"
    hd.save_checkpoint(path, model, opt, extra={"history": [1.0, 2.0], "rng": RNG})
    return path, model, opt


#: An RNG state saved as extra data (a uint8 tensor), and read back
RNG = torch.Generator().manual_seed(7).get_state()


def expected_load(source_model, source_opt, mode):
    """What loading ``source_opt``'s state into a fresh optimizer of ``mode`` gives in one process."""
    model, opt = make(mode, seed=1)
    model.load_state_dict(source_model.state_dict())
    opt.load_state_dict(source_opt.state_dict())
    return snapshot(model, opt)


# ------------------------------------------------------------------------------ what a load gives
@pytest.mark.parametrize("mode", ["compact", "fp32", "bf16", "tiny"])
def test_load_is_the_single_process_load_in_any_mode(saved, mode):
    path, source_model, source_opt = saved
    model, opt = make(mode, seed=1)
    extra = hd.load_checkpoint(path, model, opt)
    assert same(snapshot(model, opt), expected_load(source_model, source_opt, mode))
    assert extra["history"] == [1.0, 2.0] and torch.equal(extra["rng"], RNG) and extra["rng"].dtype == torch.uint8


def test_cross_mode_load_with_a_schedule_through_the_state_dict_functions(saved):
    """The functions a user composes with ``dcp.load`` (item 2 of the fourth reliability round): a compact
    checkpoint with a schedule into an fp32 optimizer with one. The layout optimizer carries the
    groups' keys, so DCP finds ``param_groups.0.lr_schedule``."""
    path, source_model, source_opt = saved
    model, opt = make("fp32", seed=1)
    sd = {"model": dcp.state_dict.get_model_state_dict(model),
          "optim": hd.get_optimizer_state_dict(model, opt, checkpoint_id=path)}
    dcp.load(sd, checkpoint_id=str(path))
    dcp.state_dict.set_model_state_dict(model, sd["model"])
    hd.set_optimizer_state_dict(model, opt, sd["optim"])
    assert same(snapshot(model, opt), expected_load(source_model, source_opt, "fp32"))
    assert isinstance(opt.param_groups[0]["lr_schedule"], CosineWithWarmUpLR)


def test_a_key_that_matches_nothing_is_named(saved):
    path, _, _ = saved
    model, opt = make("fp32", seed=1)
    before = snapshot(model, opt)
    for call in (lambda: hd.get_optimizer_state_dict(model, opt, checkpoint_id=path, key="optimizer"),
                 lambda: hd.load_checkpoint(path, model, opt, key="optimizer")):
        with pytest.raises(halfadam.CheckpointError, match=r"no optimizer state under key='optimizer': its "
                                                           r"top-level keys are \['extra', 'model', 'optim'\]"):
            call()
    assert same(snapshot(model, opt), before)


# ------------------------------------------------------------------------------ the manifest
def test_the_manifest_lists_every_file_in_sha256sum_format(saved):
    path, _, _ = saved
    lines = (path / "halfadam.sha256").read_text().splitlines()
    names = sorted(line.split("  ", 1)[1] for line in lines)
    assert names == sorted(f for f in os.listdir(path) if f != "halfadam.sha256")
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    if shutil.which("sha256sum"):
        check = subprocess.run(["sha256sum", "--quiet", "-c", "halfadam.sha256"], cwd=path, capture_output=True)
        assert check.returncode == 0, check


def _flip_bit(file: Path, at: float = 0.5, bit: int = 0) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 1 << bit
    file.write_bytes(bytes(data))


def _data_file(path: Path) -> Path:
    return next(path / f for f in sorted(os.listdir(path)) if f.endswith(".distcp"))


@pytest.mark.parametrize("damage", ["bit flip", "truncated", "missing", "metadata bit flip"])
def test_a_damaged_file_is_named_and_nothing_changes(saved, damage):
    """Every single-bit flip is caught before anything is read (DCP alone raised on 13 of 39 and loaded
    wrong values from 10), and so is a truncated or missing file; the live model and optimizer keep
    every byte; the error is a CheckpointError (an Exception) caused by DCP's CheckpointException (a
    BaseException)."""
    path, _, _ = saved
    victim = path / ".metadata" if damage == "metadata bit flip" else _data_file(path)
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:-100])
    elif damage == "missing":
        victim.unlink()
    else:
        _flip_bit(victim)
    model, opt = make("compact", seed=1)
    train(model, opt, 1, seed=1)
    before = snapshot(model, opt)
    with pytest.raises(Exception) as info:  # noqa: PT011 - the point: `except Exception` catches it
        hd.load_checkpoint(path, model, opt)
    assert isinstance(info.value, halfadam.CheckpointError), info.value
    assert str(victim) in str(info.value)
    assert ("missing" if damage == "missing" else "SHA-256 differs") in str(info.value)
    assert same(snapshot(model, opt), before)


def test_every_bit_of_a_byte_is_caught(saved):
    path, _, _ = saved
    file = _data_file(path)
    original = file.read_bytes()
    model, opt = make("compact", seed=1)
    for bit in range(8):
        _flip_bit(file, at=0.9, bit=bit)
        with pytest.raises(halfadam.CheckpointError, match="SHA-256 differs"):
            hd.load_checkpoint(path, model, opt)
        file.write_bytes(original)
    hd.load_checkpoint(path, model, opt)  # intact again: loads


def test_a_failed_read_without_a_manifest_changes_nothing(saved):
    """A checkpoint of plain ``dcp.save`` (no manifest) is read unchecked; truncated, DCP's read fails
    half-way, after other tensors were read: into staging tensors, so the live ones keep their bytes."""
    path, _, _ = saved
    (path / "halfadam.sha256").unlink()
    file = _data_file(path)
    file.write_bytes(file.read_bytes()[: len(file.read_bytes()) * 2 // 3])
    model, opt = make("compact", seed=1)
    train(model, opt, 1, seed=1)
    before = snapshot(model, opt)
    with pytest.raises(halfadam.CheckpointError, match="cannot load the checkpoint .*the checkpoint has no SHA-256 "
                                                       "manifest") as info:
        hd.load_checkpoint(path, model, opt)
    assert type(info.value.__cause__).__name__ == "CheckpointException"
    assert same(snapshot(model, opt), before)


def test_other_parameter_groups_are_refused_before_anything_is_read(saved):
    path, _, _ = saved
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(256, 8), nn.Tanh(), nn.Linear(8, 128)).to(torch.bfloat16)
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() == 1]
    opt = halfadam.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=1e-2,
                         state_mode="compact")
    before = snapshot(model, opt)
    with pytest.raises(halfadam.CheckpointError, match=r"has 1 parameter group\(s\) under 'optim', this optimizer 2"):
        hd.load_checkpoint(path, model, opt)
    assert same(snapshot(model, opt), before) and not opt.state


def test_an_optimizer_that_refuses_the_state_leaves_the_model_as_it_was(saved, monkeypatch):
    """Should the optimizer's own check (``load_state_dict``) refuse the state after DCP read it and the
    model was copied in, the model's previous values are copied back and the state created for the
    load is dropped."""
    import halfadam.state_dict as state_dict_module

    path, _, _ = saved
    model, opt = make("compact", seed=1)
    opt.zero_grad()
    model(torch.randn(4, 256).to(torch.bfloat16)).float().sum().backward()
    opt.step(grads={next(model.parameters()): next(model.parameters()).grad})  # state for one parameter only
    before = snapshot(model, opt)

    def refuse(optimizer, state_dict):
        raise halfadam.CheckpointError("refused by the test")

    monkeypatch.setattr(state_dict_module, "_prepare_load", refuse)
    with pytest.raises(halfadam.CheckpointError, match="refused by the test"):
        hd.load_checkpoint(path, model, opt)
    assert same(snapshot(model, opt), before) and len(opt.state) == 1


def test_masters_judged_as_in_one_process(saved, tmp_path):
    """A checkpoint with masters into an optimizer without master weights is refused (as its
    load_state_dict refuses it in one process), and one without masters into an optimizer with them
    rebuilds them from the loaded parameters, with load_state_dict's warning."""
    path, _, _ = saved
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(256, 8), nn.Tanh(), nn.Linear(8, 128)).to(torch.bfloat16)
    opt = halfadam.AdamW(model.parameters(), lr=1e-2, state_mode="compact", master_weights=False)
    before = snapshot(model, opt)
    with pytest.raises(halfadam.CheckpointError, match="cannot load the checkpoint .*the checkpoint has a master weight"):
        hd.load_checkpoint(path, model, opt)
    assert same(snapshot(model, opt), before)
    hd.save_checkpoint(tmp_path / "plain", model, opt)  # no masters
    model2, opt2 = make("fp32", seed=2)
    with pytest.warns(UserWarning, match="master weights rebuilt from the current parameter values"):
        hd.load_checkpoint(tmp_path / "plain", model2, opt2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q) and torch.equal(opt2.master_weight(q), q.float())
        assert torch.equal(opt2.state[q]["exp_avg"], opt.state[p]["exp_avg"].float())


def _torch_run(path, seed):
    """A torch.optim.AdamW (halfadam train's fp32 mode) one step in, saved at ``path``; and a fresh one."""
    torch.manual_seed(seed)
    model, fresh = nn.Linear(16, 4), nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    hd.save_checkpoint(path, model, opt)
    return (model, opt), (fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))


def test_torch_optimizers_load_the_dcp_way(tmp_path):
    """Saved and loaded through the same helpers; a failed load leaves a fresh one without state (DCP
    lays out a torch optimizer's state by a step of its own, which the failure takes away again)."""
    (model, opt), (model2, opt2) = _torch_run(tmp_path / "t", 0)
    hd.load_checkpoint(tmp_path / "t", model2, opt2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
    _, (model3, opt3) = _torch_run(tmp_path / "u", 1)
    _flip_bit(_data_file(tmp_path / "u"))
    with pytest.raises(halfadam.CheckpointError, match="SHA-256 differs"):
        hd.load_checkpoint(tmp_path / "u", model3, opt3)
    assert not opt3.state


def test_verify_checkpoint_reads_every_file(saved):
    """An extra-only load reads the file that holds the extra data; verify_checkpoint checks them all."""
    path, _, _ = saved
    (path / "stray.distcp").write_bytes(b"x")  # not in the manifest, read by no load: ignored
    hd.verify_checkpoint(path)
    victim = _data_file(path)
    _flip_bit(victim)
    with pytest.raises(halfadam.CheckpointError, match=f"{victim}: its SHA-256 differs"):
        hd.verify_checkpoint(path)


def test_ctrl_c_inside_dcp_stays_a_keyboard_interrupt(saved, monkeypatch):
    from halfadam._dcp_io import ChecksummedReader

    path, _, _ = saved

    def interrupted(self, plan, planner):
        raise KeyboardInterrupt("Ctrl-C")

    monkeypatch.setattr(ChecksummedReader, "read_data", interrupted)
    model, opt = make("compact", seed=1)
    with pytest.raises(KeyboardInterrupt):
        hd.load_checkpoint(path, model, opt)


def test_extra_that_weights_only_cannot_read_is_refused_at_save(tmp_path):
    import argparse

    model, opt = make("fp32", schedule=False)
    with pytest.raises(halfadam.CheckpointError, match="extra must hold plain data .*argparse.Namespace"):
        hd.save_checkpoint(tmp_path / "x", model, opt, extra={"args": argparse.Namespace(a=1)})
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("edit", ["uppercase and binary mode", "blank line", "directory"])
def test_the_manifest_in_sha256sum_forms(saved, edit):
    path, _, _ = saved
    manifest = path / "halfadam.sha256"
    lines = manifest.read_text().splitlines()
    model, opt = make("compact", seed=1)
    if edit == "directory":
        manifest.unlink()
        manifest.mkdir()
        with pytest.raises(halfadam.CheckpointError, match="cannot load the checkpoint .*manifest is not a file"):
            hd.load_checkpoint(path, model, opt)
        return
    if edit == "blank line":
        manifest.write_text("\n".join(lines) + "\n\n")
    else:
        manifest.write_text("".join(f"{d.upper()} *./{n}\n" for d, n in (line.split("  ", 1) for line in lines)))
    hd.load_checkpoint(path, model, opt)
    _flip_bit(_data_file(path))
    with pytest.raises(halfadam.CheckpointError, match="SHA-256 differs"):
        hd.load_checkpoint(path, model, opt)


def test_save_failures_are_checkpoint_errors(tmp_path):
    model, opt = make("fp32", schedule=False)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(halfadam.CheckpointError, match="cannot save the checkpoint") as info:
        hd.save_checkpoint(blocker / "ckpt", model, opt)
    assert info.value.__cause__ is not None


def test_extra_only_and_a_model_only(saved):
    path, source_model, _ = saved
    assert hd.load_checkpoint(path)["history"] == [1.0, 2.0]
    model, _ = make("fp32", seed=1)
    hd.load_checkpoint(path, model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source_model.state_dict().values()))


# ------------------------------------------------------------------------------ on 2 ranks
def _fsdp(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for k in (0, 2):
        fully_shard(model[k], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _local_bytes(model, opt):
    return [hd.local(t).detach().clone() for p in model.parameters() for t in (p, *opt.state.get(p, {}).values())
            if isinstance(t, torch.Tensor)]


def _ranks_worker(rank, world, out):
    dist = torch.distributed
    model, opt = make("compact")
    model = _fsdp(model)
    opt = halfadam.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, state_mode="compact")
    train(model, opt)
    path = Path(out) / "ckpt"
    hd.save_checkpoint(path, model, opt, extra={"rank": rank})
    m2 = _fsdp(make("compact", seed=1)[0])
    o2 = halfadam.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1, state_mode="compact")
    extra = hd.load_checkpoint(path, m2, o2)
    loaded = extra == {"rank": 0} and all(torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)
                 for a, b in zip(_local_bytes(model, opt), _local_bytes(m2, o2)))
    dist.barrier()
    if rank == 0:
        _flip_bit(path / "__1_0.distcp")  # rank 1's shards
    dist.barrier()
    m3 = _fsdp(make("compact", seed=2)[0])
    o3 = halfadam.AdamW(m3.parameters(), lr=1e-2, weight_decay=0.1, state_mode="compact")
    train(m3, o3, 1, seed=2)
    before = _local_bytes(m3, o3)
    try:
        hd.load_checkpoint(path, m3, o3)
        error = None
    except halfadam.CheckpointError as exc:
        error = str(exc)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _local_bytes(m3, o3)))
    results = [None] * world
    dist.all_gather_object(results, (loaded, error, unchanged))
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")


@needs_gloo
@pytest.mark.distributed
def test_a_corrupt_shard_of_one_rank_fails_every_rank_and_changes_nothing(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hd.launch(_ranks_worker, 2, str(tmp_path), timeout_s=120)
    results = torch.load(tmp_path / "results.pt")
    assert [r[0] for r in results] == [True, True]  # bitwise on both ranks, and rank 0's extra data on both
    for loaded, error, unchanged in results:
        assert error is not None and "__1_0.distcp: its SHA-256 differs" in error, error
        assert unchanged
