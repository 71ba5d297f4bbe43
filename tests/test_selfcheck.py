"""The kernels' self-check on first use (halfadam.selfcheck) and ``halfadam doctor``.

A kernel made wrong on purpose (one bit flipped in a code, a remainder or a moment after each call) must
be caught on its first use, warned about once, and replaced by the reference execution: training then
continues bit for bit as ``implementation="foreach"`` does.
"""

import subprocess
import sys
import threading
import warnings

import pytest
import torch

import halfadam
from halfadam import encodings, executions, selfcheck
from halfadam.encodings import PRESETS
from halfadam.kernels import cpp

from conftest import HAS_TRITON

needs_cpp = pytest.mark.skipif(cpp.load() is None, reason="the C++ kernel is unavailable here")


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch):
    """Every test starts with no configuration checked, and checks on."""
    monkeypatch.setattr(selfcheck, "_verdicts", {})
    monkeypatch.delenv(selfcheck.ENV, raising=False)


def _model(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(48, 200, generator=gen).to(dtype).requires_grad_(),
            torch.randn(7, 130, generator=gen).to(dtype).requires_grad_(),
            torch.randn(48, generator=gen).to(dtype).requires_grad_()]


def _train(params, opt, steps=4):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        opt.step()


def _flip_after(monkeypatch, target, key, element=5):
    """Wrap the kernel entry ``target`` (``"cpp"``: executions._cpp_call; ``"triton"``: the launch) so that
    after every call bit 0 of ``flat[key][element]`` is flipped: a kernel that is wrong in one bit."""
    def flip(flat):
        t = flat.get(key)
        if t is not None and t.numel() > element:
            bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
            bits[element] ^= 1
    if target == "cpp":
        original = executions._cpp_call

        def broken(kernel, params, grads, flat, *rest):
            original(kernel, params, grads, flat, *rest)
            flip(flat)
        monkeypatch.setattr(executions, "_cpp_call", broken)
    else:
        from halfadam.kernels import triton as triton_kernel
        original = triton_kernel.launch

        def broken(work, table, scalars, stored, **kw):
            original(work, table, scalars, stored, **kw)
            flip(stored)
        monkeypatch.setattr(triton_kernel, "launch", broken)


def _same(a, b):
    return selfcheck.compare(a, b) is None


def _state(opt):
    return {f"{i}.{k}": v for i, st in enumerate(opt.state.values()) for k, v in st.items()
            if isinstance(v, torch.Tensor)}


@needs_cpp
@pytest.mark.parametrize("mode", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_cpp_kernel_agrees_in_every_mode(mode, dtype):
    params = _model(dtype)
    _train(params, halfadam.AdamW(params, lr=1e-3, weight_decay=0.1, state_mode=mode, implementation="cpp"), 1)
    verdicts = list(selfcheck.results().values())
    fmt = encodings.for_param(PRESETS[mode], params[0], dtype != torch.float32)
    assert {v.config.fmt for v in verdicts} >= {fmt}  # the matrices' format was checked, beside the bias's
    assert all(v.config.kernel == "cpp" and v.config.param_dtype == dtype for v in verdicts)
    assert all(v.agrees for v in verdicts), [v.difference for v in verdicts]


@needs_cpp
@pytest.mark.parametrize("mode, key", [("compact", "exp_avg_sq"), ("compact", "exp_avg_scale"),
                                       ("compact", "master_lo"), ("tiny", "master_hi"), ("tiny", "exp_avg"),
                                       ("fp32", "master_weight"), ("bf16", "exp_avg")])
def test_a_wrong_cpp_kernel_is_caught_once_and_the_reference_takes_over(mode, key, monkeypatch):
    reference = _model(torch.bfloat16)
    ref_opt = halfadam.AdamW(reference, lr=1e-3, weight_decay=0.1, state_mode=mode, implementation="foreach")
    _train(reference, ref_opt)
    _flip_after(monkeypatch, "cpp", key)
    params = _model(torch.bfloat16)
    opt = halfadam.AdamW(params, lr=1e-3, weight_decay=0.1, state_mode=mode)  # auto: the C++ kernel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(params, opt)
    failed = [str(w.message) for w in caught if "self-check failed" in str(w.message)]
    wrong = [v for v in selfcheck.results().values() if not v.agrees]
    assert len(failed) == len(wrong) >= 1  # once per configuration (the matrices', the bias's), over 4 steps
    assert all(key in m and "element" in m and "C++ kernel" in m and selfcheck.ENV in m for m in failed)
    assert all("halfadam doctor" in m for m in failed)
    assert _same(dict(enumerate(params)), dict(enumerate(reference)))
    assert _same(_state(opt), _state(ref_opt))


@needs_cpp
def test_with_the_check_off_a_wrong_kernel_goes_unnoticed(monkeypatch):
    """The counter-check: the check is what guards (HALFADAM_SELFCHECK=0 turns it off)."""
    reference = _model(torch.bfloat16)
    ref_opt = halfadam.AdamW(reference, lr=1e-3, state_mode="compact", implementation="foreach")
    _train(reference, ref_opt)
    _flip_after(monkeypatch, "cpp", "exp_avg_sq")
    monkeypatch.setenv(selfcheck.ENV, "0")
    params = _model(torch.bfloat16)
    opt = halfadam.AdamW(params, lr=1e-3, state_mode="compact")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(params, opt)
    assert selfcheck.results() == {}
    assert not _same(_state(opt), _state(ref_opt))


@needs_cpp
@pytest.mark.parametrize("broken", [False, True])
def test_shards_are_checked_and_fall_back_to_the_reference_path(broken, monkeypatch):
    """FSDP2's local shards (parameters with their own state) go through executions.shard_step: checked in
    their own layout; a wrong kernel leaves them to the per-parameter reference path."""
    if broken:
        _flip_after(monkeypatch, "cpp", "exp_avg")
    fmt = PRESETS["tiny"]
    params = _model(torch.bfloat16)[:2]
    state = {p: encodings.new_state(fmt, p, True) for p in params}
    for st in state.values():
        st["step"] = torch.tensor(0.0)
    hp = executions.Hyperparameters(1e-3, 0.1, beta1=0.9, beta2=0.999, eps=1e-8, decay="decoupled",
                                    optimized_update=False)
    pairs = [(p, torch.ones_like(p)) for p in params]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        left = executions.shard_step(pairs, state, hp, "auto", None, fmt, [0, 0])
    assert left == ([0, 1] if broken else [])
    assert [v.config.layout for v in selfcheck.results().values()] == ["shard"]
    assert sum("self-check failed" in str(w.message) for w in caught) == (1 if broken else 0)


def _in_threads(*targets):
    """Runs each target in its own thread (named as the function) and joins them; the first exception a
    target raised, raised here."""
    errors = []

    def guarded(target):
        try:
            target()
        except BaseException as exc:  # noqa: B902 (re-raised in the calling thread)
            errors.append(exc)
    threads = [threading.Thread(target=guarded, args=(t,), name=t.__name__) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 120 s"
    if errors:
        raise errors[0]


@needs_cpp
@pytest.mark.usefixtures("one_thread")
def test_two_threads_first_steps_are_each_checked_before_their_kernel_runs(monkeypatch):
    """Two threads, each training its own model in its own configuration (bfloat16 and float16 matrices),
    on a kernel wrong in one bit: the second thread's first step starts while the first thread's check
    runs (the check is held until the second thread has either come back from kernel_agrees, as it did
    unchecked when one process-wide flag said "a check is running", or is about to wait for the check's
    lock). Both configurations are checked before their kernel's result is kept: each model ends bit for
    bit as the reference leaves it, and each failure is warned about once."""
    dtypes = (torch.bfloat16, torch.float16)
    references = []
    for dtype in dtypes:
        params = _model(dtype)[:2]
        opt = halfadam.AdamW(params, lr=1e-3, weight_decay=0.1, state_mode="compact", implementation="foreach")
        _train(params, opt, 2)
        references.append((params, opt))
    _flip_after(monkeypatch, "cpp", "exp_avg_sq")
    models = [_model(dtype)[:2] for dtype in dtypes]
    opts = [halfadam.AdamW(m, lr=1e-3, weight_decay=0.1, state_mode="compact", implementation="cpp") for m in models]
    started, passed, held = threading.Barrier(2, timeout=60), threading.Event(), []

    def first():
        _train(models[0], opts[0], 2)

    def second():
        started.wait()  # the first thread's check is running
        _train(models[1], opts[1], 2)

    check, agrees, lock = selfcheck._check, selfcheck.kernel_agrees, getattr(selfcheck, "_lock", None)

    def held_check(config, run):
        if threading.current_thread().name == "first" and not held:
            held.append(config)
            started.wait()
            assert passed.wait(60), "the second thread neither came back nor waited"
        return check(config, run)

    def watched_agrees(config, run):
        try:
            return agrees(config, run)
        finally:
            if threading.current_thread().name == "second":
                passed.set()  # it came back from kernel_agrees (having run its check, or none)

    class AnnouncedLock:  # the check's lock, saying when the second thread is about to wait for it
        def __enter__(self):
            if threading.current_thread().name == "second":
                passed.set()
            return lock.__enter__()

        def __exit__(self, *exc):
            return lock.__exit__(*exc)

    monkeypatch.setattr(selfcheck, "_check", held_check)
    monkeypatch.setattr(selfcheck, "kernel_agrees", watched_agrees)
    monkeypatch.setattr(selfcheck, "_lock", AnnouncedLock(), raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _in_threads(first, second)
    assert [c.param_dtype for c in held] == [torch.bfloat16]
    verdicts = selfcheck.results()
    assert sorted(str(c.param_dtype) for c in verdicts) == ["torch.bfloat16", "torch.float16"]
    assert not any(v.agrees for v in verdicts.values())
    assert sum("self-check failed" in str(w.message) for w in caught) == 2
    for params, opt, (ref_params, ref_opt) in zip(models, opts, references):
        assert _same(dict(enumerate(params)), dict(enumerate(ref_params)))
        assert _same(_state(opt), _state(ref_opt))


@needs_cpp
def test_a_recheck_in_one_thread_leaves_the_other_threads_as_they_were(monkeypatch):
    """recheck() (the doctor's) checks the calling thread's configurations again: a thread training beside
    it with HALFADAM_SELFCHECK=0 still runs unchecked, and no check of its configuration is recorded."""
    monkeypatch.setenv(selfcheck.ENV, "0")
    params = _model(torch.bfloat16)[:2]
    opt = halfadam.AdamW(params, lr=1e-3, state_mode="compact", implementation="cpp")
    with selfcheck.recheck():
        assert selfcheck.enabled()
        _in_threads(lambda: _train(params, opt, 1))
        assert selfcheck.results() == {}
    assert selfcheck.results() == {} and not selfcheck.enabled()


@pytest.mark.skipif(not HAS_TRITON, reason="the triton package is not installed")
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("broken", [False, True])
def test_the_triton_kernel_is_checked_under_the_interpreter(broken, monkeypatch):
    from halfadam.kernels import triton as triton_kernel
    if not triton_kernel.available(torch.device("cpu")):
        pytest.skip("CPU tensors run the Triton kernel only under TRITON_INTERPRET=1")
    reference = _model(torch.bfloat16)[:2]
    ref_opt = halfadam.AdamW(reference, lr=1e-3, state_mode="compact", implementation="foreach")
    _train(reference, ref_opt, 2)
    if broken:
        _flip_after(monkeypatch, "triton", "exp_avg_sq_exponent", element=1)
    params = _model(torch.bfloat16)[:2]
    opt = halfadam.AdamW(params, lr=1e-3, state_mode="compact", implementation="triton")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(params, opt, 2)
    (verdict,) = selfcheck.results().values()
    assert verdict.config.kernel == "triton" and verdict.config.variant == "interpreted"
    assert verdict.agrees is not broken
    assert sum("self-check failed" in str(w.message) for w in caught) == int(broken)
    same = _same(dict(enumerate(params)), dict(enumerate(reference))) and _same(_state(opt), _state(ref_opt))
    assert same  # right kernel: the same bits; wrong one: the reference took over


def test_compare_names_the_first_difference():
    a = {"x": torch.tensor([1.0, float("nan"), 2.0]), "c": torch.tensor([3, 4], dtype=torch.uint8)}
    b = {"x": torch.tensor([1.0, float("nan"), 2.0]), "c": torch.tensor([3, 5], dtype=torch.uint8)}
    assert selfcheck.compare(a, dict(a)) is None  # nans with any payload count as equal
    assert selfcheck.compare(a, b) == "c element 1 is 4 where the reference gives 5 (1 of 2 elements differ)"
    b = {"x": torch.tensor([1.0, float("nan"), -0.0]), "c": a["c"]}
    a["x"][2] = 0.0
    assert selfcheck.compare(a, b).startswith("x element 2 is 0 (0x00000000) where the reference gives -0 (0x80000000)")


def test_the_synthetic_set_holds_the_hard_values():
    config = selfcheck.Config("cpp", "cpu", torch.bfloat16, torch.bfloat16, PRESETS["fp32"], True, "adam",
                              True)
    case = selfcheck.synthetic_set(config, torch.device("cpu"))
    p = torch.cat([q.detach().reshape(-1).float() for q in case["params"]])
    g = torch.cat([q.reshape(-1).float() for q in case["all_grads"][0] + case["all_grads"][1]])
    tiny = torch.finfo(torch.bfloat16).tiny
    assert (p == 0).any() and (p.abs() < tiny).logical_and(p != 0).any() and (p.abs() > 1e37).any()
    assert g.isnan().any() and (g == float("inf")).any() and (g == -float("inf")).any() and (g == 0).any()
    assert [q.numel() for q in case["params"]][0] == 1
    master = case["bucket"].flat["master_weight"]
    q = torch.cat([q.detach().reshape(-1) for q in case["params"]])
    midpoint = (p + (q.view(torch.int16) + 1).view(torch.bfloat16).float()) / 2  # halfway to the next value
    assert (master == midpoint).float().mean() > 0.3  # ties of the rounding
    assert ((master != midpoint) & (master != p)).float().mean() > 0.3  # next to them


@needs_cpp
def test_doctor_on_the_cpu_exits_0_and_names_every_mode():
    out = subprocess.run([sys.executable, "-m", "halfadam", "doctor", "--params", "3e5"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for word in ("torch", "triton", "compiler", "cpu", "cpp", "configurations agree", *PRESETS, "torch fused"):
        assert word in text, word
    assert "\r" not in text + out.stderr and len(text.splitlines()) <= 30
    assert "every kernel gives the reference's bits" in text


@needs_cpp
def test_doctor_reports_a_wrong_kernel_and_exits_1(monkeypatch, capsys):
    """In a process that has already met the wrong kernel (and warned) the doctor checks everything
    again and lists those configurations too."""
    from halfadam.cli import main
    _flip_after(monkeypatch, "cpp", "exp_avg")
    params = [torch.randn(64, 96).to(torch.bfloat16).requires_grad_()]
    with pytest.warns(RuntimeWarning, match="self-check failed"):
        _train(params, halfadam.AdamW(params, lr=1e-3, weight_decay=0.01, state_mode="compact"), 1)
    assert main(["doctor", "--no-timing"]) == 1
    text = capsys.readouterr().out
    assert "DIFFERS" in text and "exp_avg" in text and "please report" in text
    # exp_avg is Adam's and Lion's: their 26 configurations differ; SGD's 9 (momentum_buffer, or none) agree
    assert "9 of 35 configurations agree" in text
    assert len(selfcheck.results()) == 35  # the earlier verdict kept, the doctor's added
    assert {c.rule.split(",")[0] for c, v in selfcheck.results().items() if not v.agrees} == {"adam", "lion"}


def test_doctor_says_when_no_kernel_was_checked(monkeypatch, capsys):
    from halfadam import doctor
    from halfadam.cli import main
    monkeypatch.setattr(doctor, "_kernel_for", lambda device: None)
    assert main(["doctor", "--no-timing"]) == 0
    text = capsys.readouterr().out
    assert "none was checked" in text and "every kernel gives" not in text
