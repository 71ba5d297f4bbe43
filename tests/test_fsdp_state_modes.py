"""Every state mode under FSDP2 and DCP: the encoded state does not depend on the sharding.

The same gradients are fed to one unsharded optimizer in this process and to FSDP2 (``fully_shard``)
models on 1, 2 and 4 gloo ranks (:func:`halfadam.distributed.launch`); every parameter, master and
encoded state tensor (codes, scales, split remainders and tie bytes), gathered, must be bitwise the
unsharded one. The model's shapes cover rows of 1, 2 and 3 blocks, rows of one short block (9
elements), row counts that do not divide by the world size (4 ranks over 3 rows: an empty shard) and
1-D biases, which keep float32 fields (``halfadam.encodings.for_param``). DCP checkpoints
written on 1 and 2 ranks load on 2 ranks and in one process, bitwise; checkpoints load into optimizers
of another mode (one process, and FSDP2 on 1, 2, 4 ranks) as a single-process state dict does; the
GradScaler's agreed skip changes no byte of any shard.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import halfadam
import halfadam.distributed as hd
from conftest import needs_gloo
from halfadam.kernels import cpp as cpu_kernel

dist = torch.distributed
pytestmark = [needs_gloo, pytest.mark.distributed]

STEPS = 4
MODES = {
    "fp32": dict(state_mode="fp32"),
    "split": dict(state_mode="split"),
    "bf16": dict(state_mode="bf16"),
    "compact": dict(state_mode="compact"),
    "tiny": dict(state_mode="tiny"),
    "mixed": dict(state_mode="compact", exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=False),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CASES = [(mode, dtype) for mode in MODES for dtype in DTYPES]
#: checkpoints loaded into optimizers of another mode (bf16 parameters)
CROSS = [("compact", mode) for mode in MODES if mode != "compact"] + [("fp32", "compact"), ("split", "bf16"), ("tiny", "fp32")]
#: bf16 runs converted between steps (model.to(dtype)) on 2 and 4 ranks: uneven shards, split masters
CONVERTED = [(mode, dtype) for mode in ("split", "bf16", "compact", "tiny") for dtype in ("fp16", "fp32")]


def make_model(dtype):
    torch.manual_seed(0)
    # weights [9, 384] (3 blocks per row, 9 rows), [128, 9] (rows of one short block of 9), [3, 128]
    # (1 block per row, 3 rows: on 4 ranks one shard is empty); the biases are 1-D (float32 fields)
    return nn.Sequential(nn.Linear(384, 9), nn.Tanh(), nn.Linear(9, 128), nn.Tanh(), nn.Linear(128, 3)).to(dtype)


def make_opt(model, mode, **kw):
    return halfadam.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **MODES[mode], **kw)


def gradients(model, step):
    """The step's gradients (float32, one per parameter): the same on every rank and in every run."""
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(-4, 1, (), generator=g).item()
            for p in model.parameters()]


def full(t):
    return (t.full_tensor() if hd.is_dtensor(t) else t).detach().clone()


def snapshot(model, opt):
    """``{name: tensor}`` of every parameter and state tensor, gathered (all ranks must call it)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p)
        for k, v in sorted(opt.state[p].items()):
            out[f"{name}.{k}"] = full(v)
    return out


def same(a, b):
    """Bitwise equality of two snapshots (nan payloads included)."""
    return a.keys() == b.keys() and all(
        u.dtype == v.dtype and u.shape == v.shape
        and torch.equal(u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
        for u, v in ((a[k], b[k]) for k in a))


def train(model, opt, steps=STEPS, start=0):
    for t in range(start, start + steps):
        for p, g in zip(model.parameters(), gradients(model, t)):
            g = g.to(p.dtype)
            p.grad = like(g, p)
        opt.step()


def like(g, p):
    """``g`` as ``p`` is: sharded like a DTensor parameter (every rank holds the same ``g``)."""
    if not hd.is_dtensor(p):
        return g
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(g, p.device_mesh, p.placements)


def single_run(mode, dtype, steps=STEPS):
    model = make_model(DTYPES[dtype])
    opt = make_opt(model, mode)
    train(model, opt, steps)
    return model, opt


def converted_run(model, mode, dtype):
    """Two bf16 steps, ``model.to(dtype)``, two more steps: the gathered parameters and state."""
    opt = make_opt(model, mode)
    train(model, opt, 2)
    model.to(DTYPES[dtype])
    train(model, opt, 2, 2)
    return snapshot(model, opt)


def fsdp(model, **kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for k in (0, 2, 4):
        fully_shard(model[k], mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def dcp_save(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": hd.get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(path))


def dcp_load(model, opt, path):
    """Load ``path`` into ``model`` and ``opt``, in the layout of the checkpoint's state mode (``opt``'s own
    or another: ``checkpoint_id``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sd = {"model": get_model_state_dict(model), "optim": hd.get_optimizer_state_dict(model, opt, checkpoint_id=path)}
    dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(model, sd["model"])
    hd.set_optimizer_state_dict(model, opt, sd["optim"])


def case_dir(out, world, mode, dtype):
    """Where the checkpoint of a case is: ``world`` ranks of FSDP2, or "one" (one process, no FSDP2)."""
    return Path(out) / f"w{world}" / f"{mode}-{dtype}"


# ------------------------------------------------------------------------------ the ranks' work
def _worker(rank, world, out):
    """Each case on ``world`` ranks (an exception on any rank fails the launch with its traceback)."""
    import halfadam.optimizer as optimizer_module

    results = {}
    reference_step = optimizer_module.reference_step
    for mode, dtype in CASES:
        model = fsdp(make_model(DTYPES[dtype]))
        opt = make_opt(model, mode)
        calls = []  # the shards the reference execution got (the C++ kernel, shard_step, takes them all)

        def counted(pairs, *args, **kwargs):
            calls.append(len(pairs))
            return reference_step(pairs, *args, **kwargs)

        optimizer_module.reference_step = counted
        try:
            train(model, opt)
        finally:
            optimizer_module.reference_step = reference_step
        r = {"state": snapshot(model, opt), "reference_calls": calls}
        dcp_save(model, opt, case_dir(out, world, mode, dtype))
        if world == 2:
            # 2 -> 2 and 1 -> 2: fresh FSDP2 optimizers load this run's and the one-process checkpoints
            for source in (2, "one"):
                m2 = fsdp(make_model(DTYPES[dtype]))
                o2 = make_opt(m2, mode)
                dcp_load(m2, o2, case_dir(out, source, mode, dtype))
                r[f"loaded_from_{source}"] = snapshot(m2, o2)
            r["skip_unchanged"] = _agreed_skip(rank, model, opt)
        results[(mode, dtype)] = r
    for source, target in CROSS:  # this run's checkpoint of `source` into FSDP2 optimizers of `target`
        model = fsdp(make_model(torch.bfloat16))
        opt = make_opt(model, target)
        dcp_load(model, opt, case_dir(out, world, source, "bf16"))
        results[("cross", source, target)] = snapshot(model, opt)
    if world > 1:
        for mode, dtype in CONVERTED:
            results[("converted", mode, dtype)] = converted_run(fsdp(make_model(torch.bfloat16)), mode, dtype)
    if world == 2:
        results["refused"] = _refused()
        results["exports"] = _exports()
    if rank == 0:
        torch.save(results, Path(out) / f"w{world}.pt")


def _exports():
    """The fp32 exports of a compact FSDP2 optimizer, gathered: master_state_dict and to_torch_state_dict."""
    from halfadam.checkpoint import master_state_dict, to_torch_state_dict

    model = fsdp(make_model(torch.bfloat16))
    opt = make_opt(model, "compact")
    train(model, opt)
    masters = {k: full(v) for k, v in master_state_dict(opt, model).items()}
    torch_sd = to_torch_state_dict(opt)
    return masters, {i: {k: full(v) for k, v in st.items()} for i, st in torch_sd["state"].items()}


def _refused():
    """Per-block state over shards that are not runs of whole rows (FSDP2 told to shard dim 1 of the
    [9, 384] weight)."""
    from torch.distributed.tensor import Shard

    world = dist.get_world_size()
    model = fsdp(make_model(torch.bfloat16),
                 shard_placement_fn=lambda p: Shard(1) if p.dim() > 1 and p.shape[1] % world == 0 else Shard(0))
    try:
        make_opt(model, "compact")
    except ValueError as exc:
        return str(exc)
    return "accepted"


def _agreed_skip(rank, model, opt):
    """One scaled step with an inf in rank 1's local gradient shard: every rank skips; no byte of this
    rank's shards (parameters, masters, every state tensor, step counts) changes."""
    scaler = halfadam.GradScaler(init_scale=2.0 ** 8)
    scaler.scale(torch.ones(()))
    for p, g in zip(model.parameters(), gradients(model, STEPS)):
        p.grad = like((g * 2.0 ** 8).to(p.dtype), p)
    if rank == 1:
        hd.local(next(iter(model.parameters())).grad).view(-1)[0] = float("inf")
    before = [hd.local(t).clone() for p in model.parameters() for t in (p, *opt.state[p].values())]
    scaler.step(opt)
    scaler.update()
    after = [hd.local(t) for p in model.parameters() for t in (p, *opt.state[p].values())]
    unchanged = all(torch.equal(u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
                    for u, v in zip(before, after))
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (unchanged, scaler.get_scale()))
    return flags


# ------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One-process runs and checkpoints here, then the 1-, 2- and 4-rank FSDP2 runs."""
    import warnings

    out = tmp_path_factory.mktemp("fsdp_state")
    single = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        for mode, dtype in CASES:
            model, opt = single_run(mode, dtype)
            single[(mode, dtype)] = snapshot(model, opt)
            dcp_save(model, opt, case_dir(out, "one", mode, dtype))
    ranks = {}
    for world in (1, 2, 4):
        hd.launch(_worker, world, str(out), timeout_s=120)
        ranks[world] = torch.load(Path(out) / f"w{world}.pt", weights_only=False)
    return out, single, ranks


def _result(runs, world, case):
    return runs[2][world][case]


IDS = [f"{m}-{d}" for m, d in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sharded_state_is_bitwise_the_unsharded_one(runs, case):
    expected = runs[1][case]
    mode, dtype = case
    if mode == "compact" and dtype != "fp32":  # the per-block state really is there, and sharded with its rows
        assert {"0.weight.exp_avg_sq_exponent", "0.weight.master_tie", "4.weight.exp_avg_scale",
                "0.bias.master_weight", "2.weight.master_tie", "2.weight.exp_avg_scale"} <= set(expected)
        assert tuple(expected["0.weight.exp_avg_scale"].shape) == (9, 3)
        assert tuple(expected["2.weight.exp_avg_scale"].shape) == (128, 1)  # rows of 9: one short block each
        assert expected["2.weight.exp_avg"].dtype == torch.uint8
    for world in (1, 2, 4):
        assert same(_result(runs, world, case)["state"], expected), f"{world} ranks"
        if cpu_kernel.load() is not None:  # every shard went through the C++ kernel, none the reference
            assert _result(runs, world, case)["reference_calls"] == [], f"{world} ranks"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dcp_reshards_bitwise(runs, case):
    out, single, _ = runs
    r = _result(runs, 2, case)
    assert same(r["loaded_from_2"], single[case])  # 2 -> 2
    assert same(r["loaded_from_one"], single[case])  # 1 -> 2
    mode, dtype = case
    model = make_model(DTYPES[dtype])
    opt = make_opt(model, mode)
    dcp_load(model, opt, case_dir(out, 2, mode, dtype))  # 2 -> 1
    assert same(snapshot(model, opt), single[case])
    train(model, opt, 2, STEPS)  # and the run goes on as the unsharded one does
    assert same(snapshot(model, opt), snapshot(*single_run(mode, dtype, STEPS + 2)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("source, target", CROSS, ids=[f"{s}-to-{t}" for s, t in CROSS])
def test_checkpoint_loads_into_another_mode_on_any_ranks(runs, source, target):
    """A checkpoint in an optimizer of another mode, read in the checkpoint's layout
    (``get_optimizer_state_dict(..., checkpoint_id=...)``): decoded and encoded exactly as the
    one-process optimizer's own state dict is,
    whether it loads into one process (from 2 ranks) or into FSDP2 on 1, 2 or 4 ranks (from as many)."""
    out = runs[0]
    source_model, source_opt = single_run(source, "bf16")
    reference = make_opt(source_model, target)
    reference.load_state_dict(source_opt.state_dict())
    expected = snapshot(source_model, reference)
    model = make_model(torch.bfloat16)
    opt = make_opt(model, target)
    dcp_load(model, opt, case_dir(out, 2, source, "bf16"))
    assert same(snapshot(model, opt), expected), "2 ranks -> 1 process"
    for world in (1, 2, 4):
        assert same(runs[2][world][("cross", source, target)], expected), f"{world} ranks"


def test_checkpoint_layout_needs_a_halfadam_optimizer(runs):
    model = make_model(torch.float32)
    with pytest.raises(TypeError, match="checkpoint_id needs a halfadam optimizer"):
        hd.get_optimizer_state_dict(model, torch.optim.AdamW(model.parameters()),
                                    checkpoint_id=case_dir(runs[0], 2, "fp32", "fp32"))


@pytest.mark.parametrize("mode, dtype", CONVERTED, ids=[f"{m}-bf16-to-{d}" for m, d in CONVERTED])
def test_dtype_change_between_steps_on_uneven_shards(runs, mode, dtype):
    """``model.to(float16 / float32)`` after bf16 steps with split masters and encoded moments: the state
    is conformed on each local shard (rows 5+4 and 3+2+2+2 of the [9, 384] weight), and the run is
    bitwise the one-process run's."""
    expected = converted_run(make_model(torch.bfloat16), mode, dtype)
    for world in (2, 4):
        assert same(runs[2][world][("converted", mode, dtype)], expected), f"{world} ranks"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_agreed_skip_changes_no_byte_of_any_shard(runs, case):
    flags = _result(runs, 2, case)["skip_unchanged"]
    assert [f[0] for f in flags] == [True, True]
    assert flags[0][1] == flags[1][1] == 2.0 ** 7  # the same halved scale on both ranks


def test_fp32_exports_of_sharded_compact_state(runs):
    """master_state_dict and to_torch_state_dict of a compact FSDP2 optimizer: the one-process ones."""
    from halfadam.checkpoint import master_state_dict, to_torch_state_dict

    masters, torch_state = runs[2][2]["exports"]
    model, opt = single_run("compact", "bf16")
    expected = master_state_dict(opt, model)
    assert masters.keys() == expected.keys()
    assert all(masters[k].dtype == torch.float32 and torch.equal(masters[k], expected[k]) for k in expected)
    expected_torch = to_torch_state_dict(opt)["state"]
    assert torch_state.keys() == expected_torch.keys()
    for i, st in expected_torch.items():
        assert all(torch.equal(torch_state[i][k], v) for k, v in st.items()), i


def test_per_block_state_needs_shards_of_whole_rows(runs):
    refused = runs[2][2]["refused"]
    assert "param_groups[0]['params'][0]" in refused and "whole rows" in refused and "Shard(0)" in refused
