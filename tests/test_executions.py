"""Every implementation (foreach, fused) against the reference path, flat state views, the scaler seam."""

import copy
import warnings

import pytest
import torch

import halfadam
from halfadam import executions
from halfadam.kernels import cpp as cpu_kernel
from halfadam.buckets import Bucket

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
FLAT_IMPLS = ["foreach", "fused", "cpp"]
SHAPES = [(3, 4), (7,), (2, 3, 5), ()]


def _params(dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_() for s in SHAPES * 2]


def _groups(params, with_order=True):
    groups = [
        {"params": params[:4], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[4:], "lr": 3e-3, "weight_decay": 0.0},
    ]
    if with_order:  # store group 0 in reversed order
        order = list(reversed(params[:4])) + params[4:]
        groups.append({"order_params": order})
    return groups


def _run(cls, dtype, impl, steps=12, device="cpu", skip=None, **kw):
    """Train ``steps`` steps with changing lr/wd; ``skip(k, i)`` says param i has no grad at step k."""
    params = _params(dtype, device=device)
    opt = cls(_groups(params), implementation=impl, **kw)
    g = torch.Generator().manual_seed(1)
    ptrs = [p.data_ptr() for p in params]
    for k in range(steps):
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g).to(device=device, dtype=dtype)
            p.grad = None if skip is not None and skip(k, i) else grad
        opt.param_groups[0]["lr"] = 1e-2 * (1 + k) / steps
        opt.param_groups[0]["weight_decay"] = 0.1 + 0.01 * k
        opt.step()
    assert [p.data_ptr() for p in params] == ptrs
    return params, opt


def _assert_close(ref, other):
    (p_ref, o_ref), (p_oth, o_oth) = ref, other
    for a, b in zip(p_ref, p_oth):
        sa, sb = o_ref.state[a], o_oth.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and sa[key].shape == sb[key].shape, key
            torch.testing.assert_close(sb[key], sa[key], rtol=1e-6, atol=1e-6 * float(sa[key].abs().max()) + 1e-12)
        # The parameters are the rounded masters; allow one ulp where the masters differ by rounding.
        tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(a.dtype, 1e-6)
        torch.testing.assert_close(b, a, rtol=tol, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", FLAT_IMPLS)
@pytest.mark.parametrize("cls", [halfadam.AdamW, halfadam.Adam, halfadam.AdamFP16])
def test_matches_reference(cls, impl, dtype):
    if cls is halfadam.AdamFP16 and dtype != torch.float16:
        pytest.skip("AdamFP16 covered on float16")
    if impl == "fused" and cls is not halfadam.AdamW and dtype != torch.float16:
        pytest.skip("fused variants of the other decay modes covered on float16 (keeps compile time down)")
    if cls is halfadam.AdamFP16:
        kw = {}
        make = lambda groups, **k: halfadam.AdamFP16(groups, weight_decay=halfadam.WeightDecay(0.05), **k)  # noqa
        ref, other = _run(make, dtype, "reference", **kw), _run(make, dtype, impl, **kw)
    else:
        ref, other = _run(cls, dtype, "reference"), _run(cls, dtype, impl)
    _assert_close(ref, other)


def test_fused_variants_do_not_share_constants():
    """Kernels compiled for other betas/eps in the same process (and Inductor's on-disk FX graph
    cache) must not leak their constants: with ``dynamic=True`` torch 2.13 reused ``1 - beta2`` of the
    first variant for the second, silently."""
    for betas, eps in [((0.9, 0.999), 1e-8), ((0.9, 0.99), 1e-8), ((0.5, 0.6), 1e-3)]:
        kw = dict(betas=betas, eps=eps)
        ref, other = _run(halfadam.AdamW, torch.float16, "reference", steps=4, **kw), \
            _run(halfadam.AdamW, torch.float16, "fused", steps=4, **kw)
        _assert_close(ref, other)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", FLAT_IMPLS)
def test_direct_and_packed_segments_match_reference(impl, dtype, monkeypatch):
    """Large parameters are updated by their own kernel call in place; small ones are packed."""
    monkeypatch.setattr(executions, "DIRECT_MIN_NUMEL", 10)  # (3,4) and (2,3,5) direct; (7,) and () packed
    params = _params(dtype)
    assert [d for _, _, d in executions._segments(Bucket(params, dtype != torch.float32), list(enumerate(params)))] \
        == ["direct", "packed", "direct", "packed", "direct", "packed", "direct", "packed"]
    _assert_close(_run(halfadam.AdamW, dtype, "reference"), _run(halfadam.AdamW, dtype, impl))
    scaled = _scaler_run(impl, max_grad_norm=0.5, dtype=dtype)
    _assert_close(_scaler_run("reference", explicit_unscale=True, max_grad_norm=0.5, dtype=dtype)[:2], scaled[:2])


@pytest.mark.parametrize("impl", FLAT_IMPLS)
def test_params_without_grads_fall_back(impl, monkeypatch):
    """A parameter without a gradient leaves a gap in the flat step; diverged step counts fall back."""
    calls = []
    real = executions.flat_step
    monkeypatch.setattr(halfadam.optimizer, "flat_step", lambda b, items, *a, **k: (calls.append(len(items)), real(b, items, *a, **k)))
    skip = lambda k, i: (k % 4 == 2 and i == 5) or (k == 3 and i == 1)  # noqa: E731
    ref = _run(halfadam.AdamW, torch.float16, "reference", skip=skip)
    other = _run(halfadam.AdamW, torch.float16, impl, skip=skip)
    _assert_close(ref, other)
    assert calls, "the flat path never ran"
    steps = [other[1].state[p]["step"].item() for p in other[0]]
    assert steps[5] < 12 and steps[1] == 11 and steps[0] == 12


@pytest.mark.parametrize("impl", FLAT_IMPLS)
def test_state_entries_are_views_of_flat_buffers(impl):
    params, opt = _run(halfadam.AdamW, torch.float16, impl, steps=2)
    layout = opt._states.group_layout(opt.param_groups[0])
    (bucket,) = layout.buckets
    # group 0 is laid out in order_params order (reversed)
    assert [id(p) for p in bucket.params] == [id(p) for p in reversed(params[:4])]
    for i, p in enumerate(bucket.params):
        st = opt.state[p]
        for key, flat in (("master_weight", bucket.flat["master_weight"]), ("exp_avg", bucket.flat["exp_avg"]),
                          ("exp_avg_sq", bucket.flat["exp_avg_sq"])):
            assert st[key].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert st[key].data_ptr() == flat.data_ptr() + 4 * bucket.offsets[i]
            assert st[key].dtype == torch.float32 and st[key].shape == p.shape
        assert st["step"].dtype == torch.float32 and st["step"].dim() == 0
        assert st["step"].data_ptr() == bucket.steps.data_ptr() + 4 * i


def test_torch_load_state_dict_rebuilds_views():
    params, opt = _run(halfadam.AdamW, torch.float32, "foreach", steps=3)
    ref_params, ref_opt = _run(halfadam.AdamW, torch.float32, "reference", steps=3)
    clone = [p.detach().clone().requires_grad_() for p in params]
    opt2 = halfadam.AdamW(_groups(clone), implementation="foreach")
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q, r in zip(clone, params, ref_params):
        g = torch.full(p.shape, 0.5)
        p.grad, q.grad, r.grad = g.clone(), g.clone(), g.clone()
    for o in (opt, opt2, ref_opt):
        o.step()
    for p, q, r in zip(clone, params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    bucket = opt2._states.group_layout(opt2.param_groups[0]).buckets[0]
    assert bucket.is_attached(opt2.state[bucket.params[0]], 0)


def test_implementation_validated():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match="implementation"):
        halfadam.AdamW(p, implementation="cuda")
    with pytest.raises(ValueError, match="implementation"):
        halfadam.AdamFP16(p, implementation=None)


def test_auto_falls_back_to_foreach_when_compile_fails(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(cpu_kernel, "_module", None)
    monkeypatch.setattr(cpu_kernel, "_reason", "no C++ compiler (simulated)")  # the C++ kernel cannot be built
    monkeypatch.setattr(executions, "_get_compiled", lambda *a: broken)
    monkeypatch.setattr(executions, "_compile_failed", None)
    monkeypatch.setattr(executions, "_compiled_ran", set())  # no variant compiled yet in this process
    with pytest.warns(RuntimeWarning, match="falls back to 'foreach'"):
        auto = _run(halfadam.AdamW, torch.float16, "auto", steps=4)
    assert not executions.compile_available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(halfadam.AdamW, torch.float16, "auto", steps=2)  # warned once only
    _assert_close(_run(halfadam.AdamW, torch.float16, "reference", steps=4), auto)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        _run(halfadam.AdamW, torch.float16, "fused", steps=1)
    with pytest.raises(RuntimeError, match="unavailable here .no C\\+\\+ compiler"):
        _run(halfadam.AdamW, torch.float16, "cpp", steps=1)


def test_auto_runs_cpp_on_cpu(monkeypatch):
    """On the CPU with the fp32 state format, ``auto`` is the C++ kernel: nothing is compiled by torch."""
    def no_compile(*a, **k):
        raise AssertionError("auto compiled a kernel although the C++ kernel applies")
    monkeypatch.setattr(executions, "_get_compiled", no_compile)
    assert cpu_kernel.load() is not None, cpu_kernel.unavailable_reason()
    _assert_close(_run(halfadam.AdamW, torch.bfloat16, "reference"), _run(halfadam.AdamW, torch.bfloat16, "auto"))


def test_cpp_can_be_turned_off(monkeypatch):
    """HALFADAM_CPP=0: the kernel is never built or used; auto runs the compiled path, cpp says why not."""
    monkeypatch.setenv("HALFADAM_CPP", "0")
    monkeypatch.setattr(cpu_kernel, "_module", None)
    monkeypatch.setattr(cpu_kernel, "_reason", None)
    assert cpu_kernel.load() is None and cpu_kernel.unavailable_reason() == "disabled (HALFADAM_CPP=0)"
    _assert_close(_run(halfadam.AdamW, torch.float16, "reference", steps=3), _run(halfadam.AdamW, torch.float16, "auto", steps=3))
    with pytest.raises(RuntimeError, match="HALFADAM_CPP=0"):
        _run(halfadam.AdamW, torch.float16, "cpp", steps=1)


def test_cpp_failed_build_is_reported_and_remembered(monkeypatch, tmp_path):
    """No compiler: load() gives None with the cause (not torch's command line), logged, and a marker
    in the build directory stops later processes from retrying the build."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    for attempt in range(2):
        monkeypatch.setattr(cpu_kernel, "_module", None)
        monkeypatch.setattr(cpu_kernel, "_reason", None)
        assert cpu_kernel.load() is None
        assert "/nonexistent/g++" in cpu_kernel.unavailable_reason() and "not found" in cpu_kernel.unavailable_reason()
    assert "an earlier build" in cpu_kernel.unavailable_reason()  # the second attempt read the marker
    assert list(tmp_path.rglob("halfadam_build_failed.txt"))


def test_cpp_runs_every_state_mode():
    """The C++ kernel has every encoding (8-bit moments included): implementation='cpp' takes every preset
    and override, and runs them (tests/test_cpp_uint8.py compares their bytes with the reference)."""
    for kw in ({"state_mode": m} for m in ("fp32", "split", "bf16", "compact")):
        p = [torch.zeros(300, dtype=torch.bfloat16, requires_grad=True)]
        opt = halfadam.AdamW(p, implementation="cpp", **kw)
        p[0].grad = torch.ones(300, dtype=torch.bfloat16)
        opt.step()
    for kw in ({"exp_avg_dtype": torch.uint8}, {"exp_avg_sq_dtype": torch.uint8, "store_param_remainders": True}):
        halfadam.AdamW([torch.zeros(3, requires_grad=True)], implementation="cpp", **kw)


@pytest.mark.parametrize("bad, error, match", [
    (lambda p: torch.zeros(p.numel() + 1, dtype=p.dtype), ValueError, "has shape"),
    (lambda p: torch.zeros(p.shape, dtype=torch.int32), TypeError, "floating point"),
    (lambda p: torch.zeros(p.shape).to_sparse(), TypeError, "sparse"),
    (lambda p: torch.zeros(p.shape, device="meta"), ValueError, "is on meta"),
    (lambda p: [0.0] * p.numel(), TypeError, "must be a tensor"),
])
def test_gradient_checks_in_one_call_name_the_parameter(bad, error, match):
    """With the C++ kernel loaded, a group's gradients are checked in one call (more than 8 of them);
    a bad one still raises the Python check's error naming it, before anything changes."""
    assert cpu_kernel.load() is not None, cpu_kernel.unavailable_reason()
    params = [torch.randn(5, dtype=torch.bfloat16, requires_grad=True) for _ in range(20)]
    opt = halfadam.AdamW(params, lr=1e-2, implementation="cpp")
    grads = {p: torch.randn(5) for p in params}
    opt.step(grads=grads)
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    grads[params[13]] = bad(params[13])
    with pytest.raises(error, match=match) as info:
        opt.step(grads=grads)
    assert "['params'][13]" in str(info.value)
    assert all(torch.equal(p, q) for p, q in zip(params, before[0]))
    after = opt.state_dict()
    for i, st in before[1]["state"].items():
        assert all(torch.equal(v, after["state"][i][k]) for k, v in st.items())
    grads[params[13]] = torch.randn(5)
    params[3].data = torch.zeros(1, dtype=torch.bfloat16).expand(5)  # elements that share memory
    with pytest.raises(ValueError, match=r"\['params'\]\[3\].*share memory"):
        opt.step(grads=grads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpp_strided_params_and_grads(dtype):
    """Transposed (non-contiguous) parameters and gradients, float32 gradients for half parameters,
    large tensors split across threads at arbitrary points: the reference's values; each parameter's
    version counter moves (autograd sees the in-place update) and its storage stays."""
    def run(impl, threads):
        torch.manual_seed(0)
        base = [torch.randn(300, 257), torch.randn(70_001), torch.randn(5, 3)]
        params = [base[0].to(dtype).t().requires_grad_(), base[1].to(dtype).requires_grad_(),
                  base[2].to(dtype).requires_grad_()]
        opt = halfadam.AdamW(params, lr=1e-2, weight_decay=0.1, implementation=impl)
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for k in range(3):
                grads = {p: torch.randn(p.shape[::-1]).t() if p.dim() == 2 else torch.randn(p.shape) for p in params}
                versions = [p._version for p in params]
                opt.step(grads=grads)
                assert all(p._version > v for p, v in zip(params, versions))
        finally:
            torch.set_num_threads(prev)
        return params, opt
    ref = run("reference", 1)
    one, two = run("cpp", 1), run("cpp", 2)
    _assert_close(ref, one)
    for a, b in zip(one[0], two[0]):  # threads split the work, not the arithmetic
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------- scaler seam
def _scaler_run(impl, *, explicit_unscale=False, max_grad_norm=None, inf_at=(), steps=6, dtype=torch.float16):
    params = _params(dtype)
    opt = halfadam.AdamW(_groups(params), implementation=impl)
    scaler = halfadam.GradScaler(init_scale=2.0**10, growth_interval=2, max_grad_norm=max_grad_norm)
    g = torch.Generator().manual_seed(2)
    snapshots = []
    for k in range(steps):
        loss = sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in params)
        for p in params:
            p.grad = None
        scaler.scale(loss).backward()
        if k in inf_at:
            params[2].grad.view(-1)[0] = float("inf")
        before = copy.deepcopy(({i: {k2: v.clone() for k2, v in opt.state[p].items()} for i, p in enumerate(params)},
                                [p.detach().clone() for p in params]))
        if explicit_unscale:
            scaler.unscale_(opt)
            if max_grad_norm is not None:
                scaler.clip_grad_norm_(opt, max_grad_norm)
                scaler._max_grad_norm_saved, scaler._max_grad_norm = scaler._max_grad_norm, None
        scaler.step(opt)
        if explicit_unscale and max_grad_norm is not None:
            scaler._max_grad_norm = scaler._max_grad_norm_saved
        after = ({i: {k2: v.clone() for k2, v in opt.state[p].items()} for i, p in enumerate(params)},
                 [p.detach().clone() for p in params])
        snapshots.append((before, after))
        scaler.update()
    return params, opt, snapshots, scaler


@pytest.mark.parametrize("impl", ["reference", "foreach", "fused", "cpp"])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_scaler_fused_handover_matches_explicit_unscale(impl, max_grad_norm):
    ref = _scaler_run("reference", explicit_unscale=True, max_grad_norm=max_grad_norm)
    other = _scaler_run(impl, explicit_unscale=False, max_grad_norm=max_grad_norm)
    _assert_close(ref[:2], other[:2])
    if max_grad_norm is not None:
        assert other[3].last_grad_norm is not None and other[3].last_grad_norm.dim() == 0


@pytest.mark.parametrize("impl", ["foreach", "fused", "cpp"])
def test_scaler_skips_bit_for_bit_on_inf(impl):
    params, opt, snapshots, scaler = _scaler_run(impl, inf_at=(2, 3), max_grad_norm=1.0)
    for k in (2, 3):
        (state_b, params_b), (state_a, params_a) = snapshots[k]
        for i in state_b:
            for key in state_b[i]:
                assert torch.equal(state_b[i][key], state_a[i][key]), (k, i, key)
            assert torch.equal(params_b[i], params_a[i])
    (state_b, _), (state_a, _) = snapshots[4]
    assert not torch.equal(state_b[0]["exp_avg"], state_a[0]["exp_avg"])  # a clean step changes state
    assert opt.state[params[0]]["step"].item() == 4


def test_fused_never_recompiles_for_changing_values():
    """lr, weight decay, betas, eps, step and the scaler's inverse scale change every step: no
    recompilation (every value is a 0-d tensor input of the kernel, none a compiled constant)."""
    params, opt, _, _ = _scaler_run("fused", steps=2, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(3)
    scaler = halfadam.GradScaler(init_scale=2.0**8, growth_interval=1, max_grad_norm=1.0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for k in range(5):
            opt.param_groups[0]["lr"] = 1e-3 * (k + 1)
            opt.param_groups[1]["weight_decay"] = 0.01 * k
            opt.param_groups[0]["betas"] = (0.85 + 0.01 * k, 0.999)  # as OneCycleLR's cycle_momentum
            opt.param_groups[1]["eps"] = 1e-8 * (k + 1)
            loss = sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in params)
            for p in params:
                p.grad = None
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()  # the scale grows every step
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step()  # without the scaler


def test_bucket_layout_roundtrip():
    ps = [torch.randn(2, 3).half(), torch.randn(4).half()]
    b = Bucket(ps, use_master=True)
    assert b.numel == 10 and b.offsets == [0, 6]
    st = {}
    b.attach(st, 1)
    assert torch.equal(st["master_weight"], ps[1].float()) and st["exp_avg"].abs().sum() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("impl", FLAT_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_reference(impl, dtype):
    _assert_close(_run(halfadam.AdamW, dtype, "reference", device="cuda"),
                  _run(halfadam.AdamW, dtype, impl, device="cuda"))


def test_deepcopy_keeps_implementation_and_rebuilds_views():
    params, opt = _run(halfadam.AdamW, torch.float16, "foreach", steps=2)
    clone = copy.deepcopy(opt)
    assert clone.implementation == "foreach"
    cparams = [p for g in clone.param_groups for p in g["params"]]
    for p, q in zip([p for g in opt.param_groups for p in g["params"]], cparams):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    opt.step()
    clone.step()
    for p, q in zip([p for g in opt.param_groups for p in g["params"]], cparams):
        assert torch.equal(opt.state[p]["master_weight"], clone.state[q]["master_weight"])
    bucket = clone._states.group_layout(clone.param_groups[0]).buckets[0]
    assert bucket.is_attached(clone.state[bucket.params[0]], 0)
