"""FSDP2's CPU offload (``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))``) in every
state mode, on 1, 2 and 3 gloo ranks.

On the CPU an offloaded run differs from a plain FSDP2 run in FSDP2's code path only (both keep the
parameters on the CPU; with offload the reduced gradient is copied to the host, ``.to("cpu")``, and the
all-gather reads the host shard through ``.to(device)``), so each case is checked two ways: bitwise the
plain FSDP2 run (real forward and backward passes, the same batches), and bitwise one unsharded
optimizer in this process fed the offloaded run's gathered gradients (an independent reference: no
FSDP2, whole tensors). Cases: every state mode x bf16/fp16/fp32 parameters; ``add_param_group`` after
two steps; user writes between steps (the master-sync rule: the next step starts from the written
value); ``model.to(dtype)`` between steps; DCP save and resume with :func:`halfadam.distributed.save_checkpoint`
/ ``load_checkpoint`` (the same run continued, and resharded 1 -> 2 -> 3 ranks -> one process); every
host shard stepped by the C++ kernel, none by the reference path. Clipping: halfadam's global norm over
host ``DTensor`` gradients (``GradScaler(max_grad_norm=)``, fused and unfused, and
``GradScaler.clip_grad_norm_``) is the norm ``torch.linalg.vector_norm`` gives over the full gradients.
One launch per world size runs every case.
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
BATCH = 6  # rows per step, split over 1, 2 or 3 ranks
WORLDS = (1, 2, 3)
MODES = ("fp32", "split", "bf16", "compact", "tiny")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: (plan, mode, parameter dtype): "plain": 4 steps; "edits": model[4] joins by add_param_group after one
#: step, and parameters are written between steps 2 and 3; "to-fp16"/"to-fp32": model.to() after 2 steps
#: (then injected gradients: FSDP2's all-gather keeps its first dtype, see :func:`run`)
CASES = ([("plain", m, d) for d in ("bf16", "fp16") for m in MODES] + [("plain", m, "fp32") for m in ("fp32", "tiny")]
         + [("edits", m, "bf16") for m in MODES]
         + [("to-fp16", "split", "bf16"), ("to-fp32", "compact", "bf16"), ("to-fp16", "tiny", "bf16")])
LR, WD, MAX_NORM = 1e-2, 0.1, 0.05


def make_model(dtype):
    torch.manual_seed(0)
    # [9, 384] (3 blocks per row), [128, 9] (rows of one short block; 43+43+42 rows on 3 ranks), [3, 128]
    return nn.Sequential(nn.Linear(384, 9), nn.Tanh(), nn.Linear(9, 128), nn.Tanh(), nn.Linear(128, 3)).to(dtype)


def fsdp(model, offload, mesh_shape=None):
    """``model`` under FSDP2 on a 1-D mesh of every rank, or HSDP on a 2-D ``mesh_shape`` (replicas, shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) if offload else {}
    mesh = (init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if mesh_shape
            else init_device_mesh("cpu", (dist.get_world_size(),)))
    for k in (0, 2, 4):
        fully_shard(model[k], mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def make_opt(model, mode, plan):
    params = [p for k in (0, 2) for p in model[k].parameters()] if plan == "edits" else model.parameters()
    return halfadam.AdamW(params, lr=LR, weight_decay=WD, state_mode=mode)


def batch(step, rank=0, world=1):
    g = torch.Generator().manual_seed(200 + step)
    x, y = torch.randn(BATCH, 384, generator=g), torch.randn(BATCH, 3, generator=g)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return x[rows], y[rows]


def injected(model, step):
    """Gradients for the steps after a dtype change: one float32 tensor per parameter, the same everywhere."""
    g = torch.Generator().manual_seed(300 + step)
    return [torch.randn(p.shape, generator=g) * 1e-2 for p in model.parameters()]


def full(t):
    return (t.full_tensor() if hd.is_dtensor(t) else t).detach().clone()


def snapshot(model, opt):
    """``{name: tensor}`` of every parameter and state tensor, gathered (all ranks must call it)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p)
        for k, v in sorted(opt.state.get(p, {}).items()):
            out[f"{name}.{k}"] = full(v)
    return out


def same(a, b):
    """Bitwise equality of two snapshots."""
    return a.keys() == b.keys() and all(
        u.dtype == v.dtype and u.shape == v.shape
        and torch.equal(u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
        for u, v in ((a[k], b[k]) for k in a))


def between_steps(model, opt, plan, step):
    """What the plan does before ``step``: add a group, write to parameters, change the dtype."""
    if plan == "edits" and step == 1:
        opt.add_param_group({"params": list(model[4].parameters()), "lr": LR / 2})
    elif plan == "edits" and step == 2:
        with torch.no_grad():  # in place on the (sharded) parameters, between steps
            model[4].weight.fill_(0.5)
            model[0].bias.mul_(-2.0)
    elif plan.startswith("to-") and step == 2:
        model.to(DTYPES[plan[3:]])


def run(model, opt, plan, rank, world, start=0, steps=STEPS, grads=None):
    """``steps`` steps of ``plan`` from ``start``: forward and backward on this rank's rows (the steps
    after a dtype change: injected gradients); ``grads``: a list that gets each step's gathered gradients."""
    from torch.distributed.tensor import distribute_tensor

    for t in range(start, start + steps):
        between_steps(model, opt, plan, t)
        if plan.startswith("to-") and t >= 2:
            # FSDP2 (torch 2.13) keeps the all-gather buffers of the first forward's dtype, so the forward
            # after model.to() fails, offloaded or not: these steps get their gradients injected
            for p, g in zip(model.parameters(), injected(model, t)):
                p.grad = distribute_tensor(g.to(p.dtype), p.device_mesh, p.placements)
        else:
            x, y = batch(t, rank, world)
            dtype = next(iter(model.parameters())).dtype
            ((model(x.to(dtype)).float() - y) ** 2).mean().backward()
        if grads is not None:
            grads.append({n: full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)


def reference(plan, mode, dtype, grads):
    """One unsharded optimizer in this process stepped with ``grads`` (gathered from a run of ``plan``)."""
    model = make_model(DTYPES[dtype])
    opt = make_opt(model, mode, plan)
    for t, step_grads in enumerate(grads):
        between_steps(model, opt, plan, t)
        for name, p in model.named_parameters():
            p.grad = step_grads[name].clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return snapshot(model, opt)


# ------------------------------------------------------------------------------ the ranks' work
def _counted_run(model, opt, plan, rank, world, grads=None):
    """:func:`run`, counting the host shards the C++ kernel and the reference execution step."""
    import halfadam.executions as executions
    import halfadam.optimizer as optimizer_module

    reference_step, cpp_call = optimizer_module.reference_step, executions._cpp_call
    counts = {"reference": 0, "cpp": 0}

    def counted_reference(pairs, *args, **kwargs):
        counts["reference"] += len(pairs)
        return reference_step(pairs, *args, **kwargs)

    def counted_cpp(kernel, params, *args, **kwargs):
        counts["cpp"] += len(params)
        return cpp_call(kernel, params, *args, **kwargs)

    optimizer_module.reference_step, executions._cpp_call = counted_reference, counted_cpp
    try:
        run(model, opt, plan, rank, world, grads=grads)
    finally:
        optimizer_module.reference_step, executions._cpp_call = reference_step, cpp_call
    return counts


def _worker(rank, world, out):
    results = {}
    for plan, mode, dtype in CASES:
        r = {}
        for offload in (False, True):
            model = fsdp(make_model(DTYPES[dtype]), offload)
            opt = make_opt(model, mode, plan)
            grads = [] if offload else None
            counts = _counted_run(model, opt, plan, rank, world, grads)
            r["offload" if offload else "plain"] = snapshot(model, opt)
        r["grads"], r["counts"] = grads, counts
        results[(plan, mode, dtype)] = r
    for mode in MODES:
        results[("resume", mode)] = _resume(rank, world, out, mode)
    results["clip"] = {dtype: _clipping(rank, world, dtype) for dtype in ("bf16", "fp16")}
    results["hsdp"] = _hsdp_clipping(rank, world)
    if rank == 0:
        torch.save(results, Path(out) / f"w{world}.pt")


def _resume(rank, world, out, mode):
    """An offloaded run saved after 2 steps and continued; a fresh one loading the checkpoint and
    continuing; with ``world > 1`` the checkpoint of ``world - 1`` ranks loaded here (resharded)."""
    model = fsdp(make_model(torch.bfloat16), True)
    opt = make_opt(model, mode, "plain")
    run(model, opt, "plain", rank, world, 0, 2)
    saved = snapshot(model, opt)
    hd.save_checkpoint(Path(out) / f"ckpt-w{world}-{mode}", model, opt)
    run(model, opt, "plain", rank, world, 2, 2)
    r = {"saved": saved, "continued": snapshot(model, opt)}
    model = fsdp(make_model(torch.bfloat16), True)
    opt = make_opt(model, mode, "plain")
    hd.load_checkpoint(Path(out) / f"ckpt-w{world}-{mode}", model, opt)
    r["loaded"] = snapshot(model, opt)
    run(model, opt, "plain", rank, world, 2, 2)
    r["resumed"] = snapshot(model, opt)
    if world > 1:
        model = fsdp(make_model(torch.bfloat16), True)
        opt = make_opt(model, mode, "plain")
        hd.load_checkpoint(Path(out) / f"ckpt-w{world - 1}-{mode}", model, opt)
        r["resharded"] = snapshot(model, opt)
    return r


def _clipping(rank, world, dtype):
    """Global norms of host DTensor gradients: halfadam's three ways, torch's, and the independent one."""
    r = {}
    x, y = batch(0, rank, world)
    scale = 2.0 ** 8

    def backward(model, factor=1.0):
        ((model(x.to(DTYPES[dtype])).float() - y) ** 2).mean().mul(factor).backward()
        return torch.linalg.vector_norm(torch.cat([full(p.grad).double().reshape(-1) for p in model.parameters()]))

    for how in ("fused", "unscaled", "clip_grad_norm_", "torch"):
        model = fsdp(make_model(DTYPES[dtype]), True)
        opt = make_opt(model, "compact", "plain")
        if how == "fused":  # GradScaler(max_grad_norm=): one pass over the scaled gradients
            scaler = halfadam.GradScaler(init_scale=scale, max_grad_norm=MAX_NORM)
            expected = backward(model, scaler.scale(torch.ones(())).item()) / scale
            scaler.step(opt)
            norm = scaler.last_grad_norm
        elif how == "unscaled":  # scaling off: the clipping coefficient only
            scaler = halfadam.GradScaler(enabled=False, max_grad_norm=MAX_NORM)
            expected = backward(model)
            scaler.step(opt)
            norm = scaler.last_grad_norm
        elif how == "clip_grad_norm_":  # unscale_, clip the float32 copies, written back into .grad
            scaler = halfadam.GradScaler(init_scale=scale)
            expected = backward(model, scaler.scale(torch.ones(())).item()) / scale
            scaler.unscale_(opt)
            norm = scaler.clip_grad_norm_(opt, MAX_NORM)
            r["clipped_norm"] = torch.linalg.vector_norm(
                torch.cat([full(p.grad).double().reshape(-1) for p in model.parameters()]))
        else:  # torch.nn.utils.clip_grad_norm_ (pytorch/pytorch#148532: fails on CUDA meshes)
            expected = backward(model)
            try:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                norm = norm.full_tensor() if hd.is_dtensor(norm) else norm
            except Exception as exc:  # noqa: BLE001 - recorded, and the test says what it was
                norm = f"{type(exc).__name__}: {exc}"
        r[how] = (norm, expected)
    return r


def _hsdp_clipping(rank, world):
    """HSDP meshes (1, world) and (world, 1), offloaded: gradients placed (Replicate(), Shard(0)); the
    norm of GradScaler(max_grad_norm=) against the full gradients'."""
    r = {}
    x, y = batch(0, rank, world)
    for shape in ((1, world), (world, 1)):
        model = fsdp(make_model(torch.bfloat16), True, shape)
        opt = make_opt(model, "tiny", "plain")
        ((model(x.to(torch.bfloat16)).float() - y) ** 2).mean().backward()
        placements = {tuple(type(pl).__name__ for pl in p.grad.placements) for p in model.parameters()}
        expected = torch.linalg.vector_norm(torch.cat([full(p.grad).double().reshape(-1) for p in model.parameters()]))
        scaler = halfadam.GradScaler(enabled=False, max_grad_norm=MAX_NORM)
        scaler.step(opt)
        r[shape] = (scaler.last_grad_norm, expected, placements)
    return r


# ------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The 1-, 2- and 3-rank launches (in that order: each loads the previous one's checkpoints)."""
    out = tmp_path_factory.mktemp("fsdp_offload")
    results = {}
    for world in WORLDS:
        hd.launch(_worker, world, str(out), timeout_s=120)
        results[world] = torch.load(Path(out) / f"w{world}.pt", weights_only=False)
    return out, results


def _cpp_available():
    if cpu_kernel.load() is None:
        pytest.skip(f"the C++ kernel does not build here: {cpu_kernel.unavailable_reason()}")


@pytest.mark.filterwarnings("ignore:a torch.bfloat16 parameter with a split master")  # bf16 -> fp16
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_offloaded_run_is_bitwise_the_plain_one_and_the_unsharded_one(ranks, case):
    plan, mode, dtype = case
    for world in WORLDS:
        r = ranks[1][world][case]
        assert same(r["offload"], r["plain"]), f"{world} ranks: offloaded != not offloaded"
        assert same(r["offload"], reference(plan, mode, dtype, r["grads"])), f"{world} ranks: != unsharded"
        assert len(r["grads"]) == STEPS
    if plan == "edits":
        st = ranks[1][2][case]["offload"]
        # the write was taken: two steps (of about lr / 2 each) from 0.5, not from the old weights (|w| < 0.09)
        assert (st["4.weight"].float() - 0.5).abs().max() < 2 * LR
        # model[4] joined after one step: 3 steps, the others 4
        assert st["4.weight.step"].item() == STEPS - 1 and st["0.weight.step"].item() == STEPS
    if plan.startswith("to-"):
        assert ranks[1][3][case]["offload"]["0.weight"].dtype == DTYPES[plan[3:]]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_the_cpp_kernel_steps_every_host_shard(ranks, case):
    _cpp_available()
    plan = case[0]
    # each rank steps each parameter's shard once per step; model[4] only from step 1 in "edits"
    shards = 6 * STEPS - (2 if plan == "edits" else 0)
    for world in WORLDS:
        assert ranks[1][world][case]["counts"] == {"reference": 0, "cpp": shards}, f"{world} ranks"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("mode", MODES)
def test_dcp_save_and_resume_offloaded(ranks, mode):
    out, results = ranks
    for world in WORLDS:
        r = results[world][("resume", mode)]
        assert same(r["loaded"], r["saved"]), f"{world} ranks: the load"
        assert same(r["resumed"], r["continued"]), f"{world} ranks: the resumed run"
        assert not same(r["continued"], r["saved"])  # the steps after the save changed something
        if world > 1:
            assert same(r["resharded"], results[world - 1][("resume", mode)]["saved"]), f"{world - 1} -> {world}"
    model = make_model(torch.bfloat16)  # 3 ranks -> one process, no FSDP2
    opt = make_opt(model, mode, "plain")
    hd.load_checkpoint(Path(out) / f"ckpt-w3-{mode}", model, opt)
    assert same(snapshot(model, opt), results[3][("resume", mode)]["saved"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("how", ["fused", "unscaled", "clip_grad_norm_"])
def test_halfadam_clipping_norm_of_host_dtensor_gradients(ranks, how, dtype):
    """The global norm over host DTensor shards: torch.linalg.vector_norm's over the full gradients
    (float64, gathered), to float32 rounding, on every mesh; and below MAX_NORM it is not clipped."""
    for world in WORLDS:
        r = ranks[1][world]["clip"][dtype]
        norm, expected = r[how]
        assert expected > 4 * MAX_NORM  # clipping happens
        torch.testing.assert_close(norm.double(), expected, rtol=2e-7, atol=0, msg=f"{world} ranks")
        if how == "clip_grad_norm_":  # .grad holds the clipped gradients (rounded to the parameter's dtype)
            torch.testing.assert_close(r["clipped_norm"], torch.tensor(MAX_NORM, dtype=torch.float64), rtol=2e-3,
                                       atol=0)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_torch_clip_grad_norm_on_a_cpu_mesh(ranks, dtype):
    """pytorch/pytorch#148532 (torch's clip_grad_norm_ fails with offloaded gradients) needs a CUDA mesh,
    whose process group has no CPU backend; on a gloo mesh torch 2.13's clip_grad_norm_ works and gives
    the same norm as halfadam's."""
    for world in WORLDS:
        r = ranks[1][world]["clip"][dtype]
        norm, expected = r["torch"]
        assert not isinstance(norm, str), norm
        assert norm.dtype == DTYPES[dtype]  # torch's norm is in the gradients' dtype
        torch.testing.assert_close(norm.double(), expected, rtol=torch.finfo(norm.dtype).eps, atol=0)


def test_halfadam_clipping_norm_on_hsdp_meshes(ranks):
    """2-D meshes (replicas x shards): each rank's partial norm is reduced over the sharded dim only."""
    for world in WORLDS:
        for shape, (norm, expected, placements) in ranks[1][world]["hsdp"].items():
            assert placements == {("Replicate", "Shard")}, placements
            assert expected > 4 * MAX_NORM
            torch.testing.assert_close(norm.double(), expected, rtol=2e-7, atol=0, msg=f"{world} ranks, {shape}")
