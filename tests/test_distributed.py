"""halfadam under torch.distributed: DDP, ZeRO-1, FSDP2, overflow agreement, clipping and DCP.

Two CPU processes with gloo on 127.0.0.1 (:func:`halfadam.distributed.launch`: torch.multiprocessing.spawn,
a free TCP port). To keep the
file fast, one spawn runs every two-rank scenario in turn and writes its results to files in a
temporary directory; the tests below only read and compare them (plus the single-process reference
runs, which need no process group). A failing scenario records its traceback instead of results.
"""

from __future__ import annotations

import importlib.util

import hashlib
import inspect
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import halfadam
from conftest import HAS_TRITON, needs_gloo
import halfadam.distributed as hd

dist = torch.distributed
pytestmark = [needs_gloo, pytest.mark.distributed]

WORLD = 2
STEPS = 20
BATCH = 8  # global batch; each rank gets BATCH // WORLD rows
LR, WD = 1e-2, 0.01
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


# ------------------------------------------------------------------------------ shared helpers
def make_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    # dim 0 of the last layer (3) does not split evenly over 2 ranks: FSDP2 pads its shards.
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def make_data(steps=STEPS, batch=BATCH):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, batch, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 3, generator=g))
    return x, y


def loss_fn(model, x, y):
    dtype = next(iter(model.parameters())).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def make_opt(params, **kw):
    return halfadam.AdamW(params, lr=LR, weight_decay=WD, **kw)


# FSDP2 shards take the per-parameter (reference) execution on their local shards. Bitwise equality
# with an unsharded run needs the same execution there (flat/compiled ones agree only to rounding).
SAME_EXECUTION = ({"implementation": "reference"}
                  if "implementation" in inspect.signature(halfadam.AdamW).parameters else {})


def single_run(dtype, steps=STEPS, scaler=False, clip=None):
    """The reference: one process, the whole global batch."""
    model = make_model(dtype)
    opt = make_opt(model.parameters())
    sc = halfadam.GradScaler(init_scale=2.0**10) if scaler else None
    x, y = make_data(steps)
    losses = []
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x[t], y[t])
        losses.append(loss.item())
        if sc:
            sc.scale(loss).backward()
            if clip:
                sc.clip_grad_norm_(opt, clip)
            sc.step(opt)
            sc.update()
        else:
            loss.backward()
            opt.step()
    return model, opt, losses


def full(t):
    return (t.full_tensor() if hd.is_dtensor(t) else t).detach().clone()


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(local_bytes(full(t)))
    return h.hexdigest()


def local_bytes(t):
    return t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def snapshot(model, opt):
    """Every parameter and state tensor, full (gathered) and cloned, in parameter order."""
    inner = hd.halfadam_optimizer(opt)
    out = []
    for p in model.parameters():
        out.append(full(p))
        for k, v in sorted(inner.state.get(p, {}).items()):
            out.append(full(v))
    return out


def same_on_all_ranks(tensors) -> bool:
    ds = [None] * dist.get_world_size()
    dist.all_gather_object(ds, digest(tensors))
    return all(d == ds[0] for d in ds)


def global_mean(loss):
    t = loss.detach().float().clone().reshape(1)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


# ------------------------------------------------------------------------------ two-rank scenarios
def _fsdp(model, mp=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = dict(mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    fully_shard(model[0], **kw)
    fully_shard(model[2], **kw)
    fully_shard(model, **kw)
    return model


def scenario_fp32(rank, out):
    """DDP, ZeRO-1 and FSDP2 (plain and bf16 MixedPrecisionPolicy) with fp32 parameters, 20 steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = make_data()
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    res = {}
    for mode in ("ddp", "zero", "fsdp", "fsdp_mp_bf16"):
        model = make_model()
        if mode in ("ddp", "zero"):
            wrapped = DDP(model, gradient_as_bucket_view=True)
        else:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if mode == "fsdp_mp_bf16" else None
            wrapped = _fsdp(model, mp)
        if mode == "zero":
            opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=halfadam.AdamW, lr=LR, weight_decay=WD)
        else:
            opt = make_opt(wrapped.parameters())
        losses, replicas_equal = [], True
        for t in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(wrapped, x[t, rows], y[t, rows])
            loss.backward()
            opt.step()
            losses.append(global_mean(loss))
            if mode != "fsdp" and mode != "fsdp_mp_bf16":
                replicas_equal &= same_on_all_ranks(list(model.parameters()))
        r = {"losses": losses, "params": [full(p) for p in model.parameters()], "replicas_equal": replicas_equal}
        if mode == "zero":
            owned = [i for i, p in enumerate(model.parameters()) if p in opt.optim.state]
            r["owned"] = owned
            r["state_only_for_shard"] = all(opt._param_to_rank[p] == rank for p in opt.optim.state)
        if mode.startswith("fsdp"):
            inner = opt
            r["state_is_sharded"] = all(
                hd.is_dtensor(v) and v.placements == p.placements and v.to_local().shape == p.to_local().shape
                for p in model.parameters() for k, v in inner.state[p].items() if k != "step")
        res[mode] = r
    return res


def scenario_half(rank, out, dtype_name):
    """fp16/bf16 parameters: DDP + GradScaler; ZeRO-1 and FSDP2 fed DDP's averaged gradients."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import distribute_tensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    dtype = HALF[dtype_name]
    x, y = make_data()
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    a = make_model(dtype)
    ddp = DDP(a, gradient_as_bucket_view=True)
    opt_a = make_opt(ddp.parameters())
    b = make_model(dtype)
    zero = ZeroRedundancyOptimizer(b.parameters(), optimizer_class=halfadam.AdamW, lr=LR, weight_decay=WD)
    c = _fsdp(make_model(dtype))
    opt_c = make_opt(c.parameters())
    scalers = [halfadam.GradScaler(init_scale=2.0**10) for _ in range(3)]
    clip = 1.0
    losses, norms, replicas_equal, zero_equal = [], [], True, True
    for t in range(STEPS):
        for o in (opt_a, zero, opt_c):
            o.zero_grad(set_to_none=True)
        loss = loss_fn(ddp, x[t, rows], y[t, rows])
        losses.append(global_mean(loss))
        scalers[0].scale(loss).backward()
        # The same averaged (scaled) gradients for ZeRO and FSDP2.
        for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters()):
            pb.grad = pa.grad.clone()
            pc.grad = distribute_tensor(pa.grad.clone(), pc.device_mesh, pc.placements)
        step_norms = []
        for sc, o in zip(scalers, (opt_a, zero, opt_c)):
            sc.scale(loss.detach())  # the scale tensor exists once scale() ran (all three are equal)
            step_norms.append(sc.clip_grad_norm_(o, clip).item())
            if o is zero and t == 0:  # the fp32 gradients the scaler made for ZeRO: this rank's shard
                unscaled = [i for i, p in enumerate(b.parameters()) if p in sc._opt_state(o)["grads"]]
            sc.step(o)
            sc.update()
        norms.append(step_norms)
        replicas_equal &= same_on_all_ranks(snapshot(a, opt_a))
        zero_equal &= same_on_all_ranks(list(b.parameters()))
    masters_a = [opt_a.state[p]["master_weight"].clone() for p in a.parameters()]
    # ZeRO: each rank compares the masters it owns; FSDP2: gathered masters.
    zero_diff, owned, zero_masters = 0.0, [], {}
    for i, (pa, pb) in enumerate(zip(a.parameters(), b.parameters())):
        if pb in zero.optim.state:
            owned.append(i)
            m = zero_masters[i] = zero.optim.state[pb]["master_weight"].clone()
            zero_diff = max(zero_diff, ((m - masters_a[i]).abs().max() / masters_a[i].abs().max()).item())
    fsdp_diff = max(((full(opt_c.state[pc]["master_weight"]) - ma).abs().max() / ma.abs().max()).item()
                    for pc, ma in zip(c.parameters(), masters_a))
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(zero.state_dict(), out / f"zero_{dtype_name}.pt")
    return {
        "losses": losses, "norms": norms, "replicas_equal": replicas_equal, "zero_params_equal": zero_equal,
        "zero_owned": owned, "zero_unscaled": unscaled, "zero_masters": zero_masters, "zero_master_diff": zero_diff, "fsdp_master_diff": fsdp_diff,
        "masters_a": masters_a, "scales": [s.get_scale() for s in scalers],
        "fsdp_master_dtype": str(opt_c.state[next(iter(c.parameters()))]["master_weight"].dtype),
    }


def scenario_overflow(rank, out):
    """An inf in one rank's gradient: every rank skips, state unchanged, same scale (DDP, ZeRO, FSDP2)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = make_data(4)
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    res = {}
    for mode in ("ddp", "zero", "fsdp"):
        model = make_model(torch.float16 if mode != "fsdp" else torch.bfloat16)
        if mode == "fsdp":
            wrapped = _fsdp(model)
            opt = make_opt(wrapped.parameters())
        else:
            wrapped = DDP(model, gradient_as_bucket_view=True)
            opt = make_opt(wrapped.parameters()) if mode == "ddp" else ZeroRedundancyOptimizer(
                wrapped.parameters(), optimizer_class=halfadam.AdamW, lr=LR, weight_decay=WD)
        sc = halfadam.GradScaler(init_scale=2.0**10)
        r = {"skipped_unchanged": None, "scales": []}
        for t in range(4):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(wrapped, x[t, rows], y[t, rows])
            sc.scale(loss).backward()
            inject = t == 2
            if inject and rank == 1:  # after DDP's all-reduce / FSDP's reduce-scatter: this rank only
                # ZeRO: in a gradient of this rank's shard (the only ones it unscales and checks).
                p = opt.optim.param_groups[0]["params"][0] if mode == "zero" else next(iter(model.parameters()))
                hd.local(p.grad).view(-1)[0] = float("inf")
            before = [v.clone() for v in snapshot(model, opt)] if inject else None
            sc.step(opt)
            sc.update()
            if inject:
                after = snapshot(model, opt)
                r["skipped_unchanged"] = all(torch.equal(u, v) for u, v in zip(before, after))
            r["scales"].append(sc.get_scale())
        r["scales_equal"] = same_on_all_ranks([torch.tensor(r["scales"])])
        r["params_equal"] = mode == "fsdp" or same_on_all_ranks(list(model.parameters()))
        res[mode] = r
    return res


DCP_STEPS = 3


def dcp_train(model, opt, x, y, steps, start):
    for t in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(model, x[t], y[t]).backward()  # the whole batch on every rank: the average is exact
        opt.step()


def scenario_dcp(rank, out):
    """FSDP2 bf16 + fp32 masters: save on 2 ranks, load on 2 ranks, continue bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy

    x, y = make_data(3 * DCP_STEPS)
    ckpt = str(out / "dcp")
    # bf16 sharded parameters, bf16 compute, fp32 gradient reduction.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _fsdp(make_model(torch.bfloat16), mp)
    opt = make_opt(model.parameters())
    dcp_train(model, opt, x, y, DCP_STEPS, 0)
    dcp.save({"model": get_model_state_dict(model), "optim": hd.get_optimizer_state_dict(model, opt)},
             checkpoint_id=ckpt)
    saved = snapshot(model, opt)
    dcp_train(model, opt, x, y, DCP_STEPS, DCP_STEPS)
    expected = snapshot(model, opt)

    model2 = _fsdp(make_model(torch.bfloat16), mp)
    opt2 = make_opt(model2.parameters())
    sd = {"model": get_model_state_dict(model2), "optim": hd.get_optimizer_state_dict(model2, opt2)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model2, sd["model"])
    hd.set_optimizer_state_dict(model2, opt2, sd["optim"])
    loaded = snapshot(model2, opt2)
    p0 = next(iter(model2.parameters()))
    master = opt2.state[p0]["master_weight"]
    dcp_train(model2, opt2, x, y, DCP_STEPS, DCP_STEPS)
    got = snapshot(model2, opt2)
    return {
        "loaded_equal": all(torch.equal(u, v) for u, v in zip(saved, loaded)) and len(saved) == len(loaded),
        "continued_equal": all(torch.equal(u, v) for u, v in zip(expected, got)),
        "master_sharded_fp32": hd.is_dtensor(master) and master.dtype == torch.float32,
        "global_step": opt2.param_groups[0]["global_step"],
        "saved": saved, "expected": expected,
    }


def make_wide_model(dtype):
    """make_model with 128 inputs: the first weight's rows are whole blocks, the second's one short block."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def scenario_state_modes(rank, out):
    """Compact state (bf16 parameters): DDP, ZeRO-1 and FSDP2 through the reference execution and the
    Triton kernel (tests/test_fsdp_state_modes.py runs every mode and 1, 2, 4 ranks), all fed DDP's
    averaged gradients."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import distribute_tensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = make_data()
    x = x.repeat(1, 1, 16)  # 128 features
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    compact = dict(state_mode="compact")
    a = make_wide_model(torch.bfloat16)
    ddp = DDP(a, gradient_as_bucket_view=True)
    opt_a = make_opt(ddp.parameters(), **compact)
    b = make_wide_model(torch.bfloat16)
    zero = ZeroRedundancyOptimizer(b.parameters(), optimizer_class=halfadam.AdamW, lr=LR, weight_decay=WD,
                                   **compact)
    c = _fsdp(make_wide_model(torch.bfloat16))
    opt_c = make_opt(c.parameters(), **compact, **SAME_EXECUTION)
    d = make_wide_model(torch.bfloat16)  # the unsharded reference of FSDP2's run
    opt_d = make_opt(d.parameters(), **compact, **SAME_EXECUTION)
    # FSDP2 through the Triton kernel (its local shards, state in the tensor table; the interpreter on CPU)
    e = _fsdp(make_wide_model(torch.bfloat16)) if importlib.util.find_spec("triton") else None
    opts = [opt_a, zero, opt_c, opt_d]
    if e is not None:
        opts.append(make_opt(e.parameters(), **compact, implementation="triton"))
    for t in range(STEPS):
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss_fn(ddp, x[t, rows], y[t, rows]).backward()
        for k, (pa, pb, pc, pd) in enumerate(zip(a.parameters(), b.parameters(), c.parameters(), d.parameters())):
            pb.grad, pd.grad = pa.grad.clone(), pa.grad.clone()
            pc.grad = distribute_tensor(pa.grad.clone(), pc.device_mesh, pc.placements)
            if e is not None:
                pe = list(e.parameters())[k]
                pe.grad = distribute_tensor(pa.grad.clone(), pe.device_mesh, pe.placements)
        for o in opts:
            o.step()
    return {
        "replicas_equal": same_on_all_ranks(list(a.parameters())),
        "zero_equal_ddp": all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters())),
        "ddp_state_keys": sorted(opt_a.state[next(iter(a.parameters()))]),
        "fsdp_equal_unsharded": all(torch.equal(full(pc), pd) for pc, pd in zip(c.parameters(), d.parameters())),
        "fsdp_equal_unsharded_state": all(
            torch.equal(full(opt_c.state[pc][k]), opt_d.state[pd][k]) for pc, pd in zip(c.parameters(), d.parameters())
            for k in opt_d.state[pd]),
        "fsdp_exp_avg": [(hd.is_dtensor(opt_c.state[pc]["exp_avg"]), str(opt_c.state[pc]["exp_avg"].dtype))
                         for pc in c.parameters()],
        "fsdp_triton_equal_unsharded": None if e is None else all(
            torch.equal(full(pe), pd) for pe, pd in zip(e.parameters(), d.parameters())),
    }


SCENARIOS = {
    "fp32": scenario_fp32,
    "state_modes": scenario_state_modes,
    "fp16": lambda r, o: scenario_half(r, o, "fp16"),
    "bf16": lambda r, o: scenario_half(r, o, "bf16"),
    "overflow": scenario_overflow,
    "dcp": scenario_dcp,
}


def _worker(rank, world, out_dir):
    """Run by :func:`halfadam.distributed.launch` in each process, inside the gloo process group."""
    out = Path(out_dir)
    results = {}
    try:
        for name, fn in SCENARIOS.items():
            try:
                results[name] = fn(rank, out)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run every scenario once on two gloo ranks; returns (out_dir, [rank0 results, rank1 results])."""
    out = tmp_path_factory.mktemp("dist")
    # A failing collective raises after 60 s instead of hanging the suite.
    hd.launch(_worker, WORLD, str(out), timeout_s=60)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def result(runs, name):
    out, ranks = runs
    for r, res in enumerate(ranks):
        if "error" in res[name]:
            pytest.fail(f"scenario {name} failed on rank {r}:\n{res[name]['error']}")
    return [res[name] for res in ranks]


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_fp32_modes_equal_single_process(runs, mode):
    ref_model, _, ref_losses = single_run(torch.float32)
    for r in result(runs, "fp32"):
        res = r[mode]
        for p, q in zip(res["params"], ref_model.parameters()):
            assert rel(p, q.detach()) < 1e-5
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-5)
        if mode != "fsdp":
            assert res["replicas_equal"]


def test_zero_keeps_state_only_for_its_shard(runs):
    r0, r1 = (r["zero"] for r in result(runs, "fp32"))
    assert r0["state_only_for_shard"] and r1["state_only_for_shard"]
    assert sorted(r0["owned"] + r1["owned"]) == [0, 1, 2, 3]


def test_fsdp_state_is_sharded_like_params(runs):
    for r in result(runs, "fp32"):
        assert r["fsdp"]["state_is_sharded"]
        assert r["fsdp_mp_bf16"]["state_is_sharded"]


def test_fsdp_mixed_precision_policy_bf16_compute(runs):
    _, _, ref_losses = single_run(torch.float32)
    for r in result(runs, "fp32"):
        assert r["fsdp_mp_bf16"]["losses"] == pytest.approx(ref_losses, rel=1e-2)


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_half_replicas_masters_and_loss(runs, dtype_name):
    r0, r1 = result(runs, dtype_name)
    for r in (r0, r1):
        assert r["replicas_equal"] and r["zero_params_equal"]
        assert r["zero_master_diff"] <= 1e-6
        assert r["fsdp_master_diff"] <= 1e-6
        assert r["fsdp_master_dtype"] == "torch.float32"
        # Global-norm clipping: ZeRO and FSDP2 (sharded) compute the same total norm as DDP.
        for n_ddp, n_zero, n_fsdp in r["norms"]:
            assert n_zero == pytest.approx(n_ddp, rel=1e-5)
            assert n_fsdp == pytest.approx(n_ddp, rel=1e-5)
        assert len(set(r["scales"])) == 1
    assert sorted(r0["zero_owned"] + r1["zero_owned"]) == [0, 1, 2, 3]
    assert r0["zero_unscaled"] == r0["zero_owned"] and r1["zero_unscaled"] == r1["zero_owned"]
    for m0, m1 in zip(r0["masters_a"], r1["masters_a"]):
        assert torch.equal(m0, m1)
    _, _, ref_losses = single_run(HALF[dtype_name], scaler=True, clip=1.0)
    assert r0["losses"] == pytest.approx(ref_losses, rel=1e-2)


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_zero_consolidated_state_loads_on_one_process(runs, dtype_name):
    out, _ = runs
    r0, r1 = result(runs, dtype_name)
    zero_masters = {**r0["zero_masters"], **r1["zero_masters"]}  # each rank's own shard
    sd = torch.load(out / f"zero_{dtype_name}.pt", weights_only=False)
    model = make_model(HALF[dtype_name])
    opt = make_opt(model.parameters())
    opt.load_state_dict(sd)
    for i, p in enumerate(model.parameters()):
        assert opt.state[p]["master_weight"].dtype == torch.float32
        assert torch.equal(opt.state[p]["master_weight"], zero_masters[i])
        assert opt.state[p]["step"].item() == STEPS
    assert opt.param_groups[0]["global_step"] == STEPS


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_inf_on_one_rank_skips_everywhere(runs, mode):
    rs = [r[mode] for r in result(runs, "overflow")]
    for r in rs:
        assert r["skipped_unchanged"] is True
        assert r["scales_equal"] and r["params_equal"]
        assert r["scales"][2] == r["scales"][1] * 0.5
    assert rs[0]["scales"] == rs[1]["scales"]


def test_dcp_save_load_two_ranks_continues_bitwise(runs):
    for r in result(runs, "dcp"):
        assert r["master_sharded_fp32"]
        assert r["loaded_equal"]
        assert r["continued_equal"]
        assert r["global_step"] == 2 * DCP_STEPS


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # loading on one process is the point
def test_dcp_reshard_to_one_process_continues_bitwise(runs):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    out, _ = runs
    r0 = result(runs, "dcp")[0]
    model = make_model(torch.bfloat16)
    opt = make_opt(model.parameters(), **SAME_EXECUTION)
    sd = {"model": get_model_state_dict(model), "optim": hd.get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=str(out / "dcp"))
    set_model_state_dict(model, sd["model"])
    hd.set_optimizer_state_dict(model, opt, sd["optim"])
    loaded = snapshot(model, opt)
    assert len(loaded) == len(r0["saved"])
    for u, v in zip(loaded, r0["saved"]):
        assert u.dtype == v.dtype and torch.equal(u, v)
    assert opt.state[next(iter(model.parameters()))]["master_weight"].dtype == torch.float32
    x, y = make_data(3 * DCP_STEPS)
    dcp_train(model, opt, x, y, DCP_STEPS, DCP_STEPS)
    for u, v in zip(snapshot(model, opt), r0["expected"]):
        assert torch.equal(u, v)


def test_scaler_process_group_option():
    assert hd.resolve_process_group(hd.AUTO) is None  # no process group in this process
    assert hd.resolve_process_group(None) is None
    with pytest.raises(ValueError):
        hd.resolve_process_group("world")


def test_local_and_localize_are_identity_without_dtensors():
    p = torch.zeros(3)
    pairs, state = [(p, torch.ones(3))], {p: {"exp_avg": torch.zeros(3)}}
    assert hd.local(p) is p
    assert hd.localize(pairs, state) == (pairs, state)
    assert hd.halfadam_optimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)) is None


def test_init_from_env_outside_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert hd.init_from_env() == (0, 1)
    assert not dist.is_initialized()
    with pytest.raises(ValueError):
        hd.launch(_worker, 0)


@pytest.mark.parametrize("backend, expected", [
    (None, [("init_process_group", "gloo")]),  # CUDA (mocked) unavailable: gloo, no GPU to set
    ("nccl", [("set_device", 1), ("init_process_group", "nccl")]),
    ("cuda:nccl,cpu:gloo", [("set_device", 1), ("init_process_group", "cuda:nccl,cpu:gloo")]),
    ("gloo", [("init_process_group", "gloo")]),
])
def test_init_from_env_sets_the_gpu_for_any_nccl_backend(monkeypatch, backend, expected):
    """Under torchrun (mocked: no process group is made) a backend with nccl in it sets LOCAL_RANK's GPU first."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(dist, "init_process_group", lambda b: calls.append(("init_process_group", b)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert hd.init_from_env(backend) == (1, 2)
    assert calls == expected


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distributed_train.py"


@pytest.mark.parametrize("launcher, mode, dtype, state_mode", [
    ("nproc", "fsdp", "bf16", "compact"),  # halfadam.distributed.launch (what `halfadam train --nproc N` calls)
    ("torchrun", "zero", "fp16", "fp32"),  # the documented torchrun line
])
def test_example_runs_data_parallel_on_cpu(launcher, mode, dtype, state_mode):
    import subprocess
    import sys

    args = ["--mode", mode, "--dtype", dtype, "--steps", "12", "--state-mode", state_mode]
    if launcher == "nproc":
        cmd = [sys.executable, str(EXAMPLE), "--nproc", "2", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE), *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(hd.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert f"done: {mode}, {dtype}, 2 processes, state_mode={state_mode}" in proc.stdout
    assert losses[-1] < losses[0]


def test_state_modes_ddp_zero_fsdp(runs):
    for r in result(runs, "state_modes"):
        assert r["replicas_equal"]
        assert r["zero_equal_ddp"]  # each ZeRO rank encodes its own shard's state exactly as DDP does
        assert r["ddp_state_keys"] == ["exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_exponent",
                                       "master_hi", "master_lo", "master_tie", "step"]
        assert r["fsdp_equal_unsharded"] and r["fsdp_equal_unsharded_state"]
        # both weights keep uint8 moments (the [3, 16] one in rows of one short block), the 1-D biases float32 ones
        assert r["fsdp_exp_avg"] == [(True, "torch.uint8"), (True, "torch.float32")] * 2
        if HAS_TRITON:  # FSDP2's local shards through the Triton kernel: the unsharded run's bits
            assert r["fsdp_triton_equal_unsharded"] is True
