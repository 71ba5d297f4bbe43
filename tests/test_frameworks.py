"""halfadam inside HF Trainer, Lightning and accelerate (the README's recipes).

Each part skips when its framework is not installed (CI does not install them). Nothing is
downloaded: the models are tiny ``nn.Module``s built here, the data are in-memory tensors.

The references are independent of the framework under test: the schedule's own values, and a plain
PyTorch loop that replays the batches the framework fed the model with halfadam given the learning
rates as a per-step list (``lr=[schedule(0), schedule(1), ...]``), so that bitwise-equal masters mean
the framework stepped halfadam exactly once per batch, at the schedule's steps, with nothing
overriding the learning rate.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import halfadam
from halfadam.schedules import CosineWithWarmUpLR, as_lr_scheduler

STEPS = 6
BATCH = 4
IMPL = "foreach"  # every implementation gives the same result; this one needs no compiler
OVERRIDE_MESSAGE = "was changed outside the optimizer"


def make_schedule():
    # schedule(0) == 0: the warm-up start that HF Trainer's own scheduler turned into a logged 0
    return CosineWithWarmUpLR(learning_rate=1e-2, warmup_steps=2, total_steps=STEPS)


class MLP(nn.Module):
    """Two linear layers; ``forward`` returns ``{"loss": ...}`` (HF style). Computes in the parameter
    dtype (bf16 here), the loss in fp32."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)
        self.seen = []  # the batches forward was called with, in order

    def forward(self, x, labels):
        self.seen.append((x.detach().clone(), labels.detach().clone()))
        dtype = self.fc1.weight.dtype
        out = self.fc2(torch.tanh(self.fc1(x.to(dtype)))).float().squeeze(-1)
        return {"loss": F.mse_loss(out, labels.float())}


def make_model() -> MLP:
    return MLP().to(torch.bfloat16)


def make_data(n: int = STEPS * BATCH):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :3].sum(-1) + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def masters(opt, model):
    return [opt.state[p]["master_weight"] for p in model.parameters() if p.requires_grad]


def assert_fp32_masters(opt, model):
    for p in model.parameters():
        assert p.dtype == torch.bfloat16
        m = opt.state[p]["master_weight"]
        assert m.dtype == torch.float32 and m.shape == p.shape
        assert torch.equal(m.to(torch.bfloat16), p)  # the parameter is its master, rounded


def replay(batches, schedule, steps):
    """The reference: a plain loop over ``batches`` with halfadam given the schedule's values as a list."""
    model = make_model()
    opt = halfadam.AdamW(model.parameters(), lr=[schedule(t) for t in range(steps)], weight_decay=0.01,
                         implementation=IMPL)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        model(x, y)["loss"].backward()
        opt.step()
    return opt, model


def assert_masters_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype == torch.float32
        assert torch.equal(x, y)


def override_warnings(record):
    return [w for w in record if OVERRIDE_MESSAGE in str(w.message)]


# ---------------------------------------------------------------------------------------------------
# HF Trainer
# ---------------------------------------------------------------------------------------------------


def hf_trainer(tmp_path, model, opt, scheduler, **kwargs):
    transformers = pytest.importorskip("transformers")
    args = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
                logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", max_grad_norm=0.0,
                seed=0, disable_tqdm=True, dataloader_num_workers=0)
    args.update(kwargs)
    return transformers.Trainer(model=model, args=transformers.TrainingArguments(**args),
                                train_dataset=make_data(), optimizers=(opt, scheduler))


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """One uninterrupted Trainer run, bf16 parameters, schedule as halfadam's learning_rate=, saving at
    steps 3 and 6."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("hf")
    schedule = make_schedule()
    model = make_model()
    opt = halfadam.AdamW(model.parameters(), learning_rate=schedule, weight_decay=0.01, implementation=IMPL)
    trainer = hf_trainer(tmp, model, opt, as_lr_scheduler(opt), save_strategy="steps", save_steps=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    return dict(tmp=tmp, schedule=schedule, model=model, opt=opt, trainer=trainer, warnings=record)


def logged_lrs(trainer):
    return [(h["step"], h["learning_rate"]) for h in trainer.state.log_history if "learning_rate" in h]


def test_hf_trainer_logs_the_schedule(hf_run, tmp_path):
    schedule, trainer = hf_run["schedule"], hf_run["trainer"]
    # HF logs, for step s (1-based), the learning rate that step used: schedule(s - 1) (0-based global step)
    assert logged_lrs(trainer) == [(s, schedule(s - 1)) for s in range(1, STEPS + 1)]
    assert any(lr > 0 for _, lr in logged_lrs(trainer))
    # the same log as for an ordinary torch scheduler setting these values on a torch optimizer
    model = MLP()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    reference = hf_trainer(tmp_path, model, torch_opt, as_lr_scheduler(torch_opt, schedule))
    reference.train()
    assert logged_lrs(reference) == logged_lrs(trainer)
    # the scheduler only reports: nothing overrode the optimizer's schedule
    assert override_warnings(hf_run["warnings"]) == []
    assert [g["lr"] for g in hf_run["opt"].param_groups] == [schedule(STEPS)]


def test_hf_trainer_steps_halfadam_with_fp32_masters(hf_run):
    model, opt = hf_run["model"], hf_run["opt"]
    assert opt.param_groups[0]["global_step"] == STEPS
    assert_fp32_masters(opt, model)
    ref_opt, ref_model = replay(model.seen, hf_run["schedule"], STEPS)
    assert len(model.seen) == STEPS
    assert_masters_equal(masters(opt, model), masters(ref_opt, ref_model))


def test_hf_trainer_checkpoint_keeps_fp32_masters(hf_run, tmp_path):
    tmp, model, opt = hf_run["tmp"], hf_run["model"], hf_run["opt"]
    saved = torch.load(tmp / f"checkpoint-{STEPS}" / "optimizer.pt", weights_only=True)
    for i, m in enumerate(masters(opt, model)):
        assert saved["state"][i]["master_weight"].dtype == torch.float32
        assert torch.equal(saved["state"][i]["master_weight"], m)
    fresh_model = make_model()
    fresh = halfadam.AdamW(fresh_model.parameters(), learning_rate=make_schedule(), weight_decay=0.01,
                           implementation=IMPL)
    fresh.load_state_dict(saved)
    assert_masters_equal([fresh.state[p]["master_weight"] for p in fresh_model.parameters()], masters(opt, model))

    # resume from step 3 in a fresh Trainer: the same masters as the uninterrupted run, bitwise
    resumed_model = make_model()
    resumed_opt = halfadam.AdamW(resumed_model.parameters(), learning_rate=make_schedule(), weight_decay=0.01,
                                 implementation=IMPL)
    trainer = hf_trainer(tmp_path, resumed_model, resumed_opt, as_lr_scheduler(resumed_opt), save_steps=3)
    trainer.train(resume_from_checkpoint=str(tmp / "checkpoint-3"))
    assert resumed_opt.param_groups[0]["global_step"] == STEPS
    assert_fp32_masters(resumed_opt, resumed_model)
    assert_masters_equal(masters(resumed_opt, resumed_model), masters(opt, model))
    schedule = hf_run["schedule"]
    # the log history comes back from the checkpoint (steps 1-3); steps 4-6 are logged by this run
    assert logged_lrs(trainer) == [(s, schedule(s - 1)) for s in range(1, STEPS + 1)]


def test_hf_trainer_ignores_its_optimizer_and_scheduler_arguments(tmp_path):
    """docs/migrating.md: with optimizers=(opt, sched), TrainingArguments' learning rate, decay, betas, eps,
    optimizer and scheduler settings reach nothing: the masters are the plain loop's with halfadam's own."""
    transformers = pytest.importorskip("transformers")
    schedule, model = make_schedule(), make_model()
    opt = halfadam.AdamW(model.parameters(), learning_rate=schedule, weight_decay=0.01, implementation=IMPL)
    trainer = hf_trainer(tmp_path, model, opt, as_lr_scheduler(opt), learning_rate=0.5, weight_decay=0.3,
                         adam_beta1=0.5, adam_beta2=0.6, adam_epsilon=0.1, optim="sgd", lr_scheduler_type="constant",
                         warmup_steps=3)
    trainer.train()
    assert logged_lrs(trainer) == [(s, schedule(s - 1)) for s in range(1, STEPS + 1)]
    assert [(g["betas"], g["eps"], g["weight_decay"]) for g in opt.param_groups] == [((0.9, 0.999), 1e-8, 0.01)]
    ref_opt, ref_model = replay(model.seen, schedule, STEPS)
    assert_masters_equal(masters(opt, model), masters(ref_opt, ref_model))
    # Trainer's own optimizer would have left the biases undecayed; halfadam's one group decays them
    own = hf_trainer(tmp_path, MLP(), None, None, weight_decay=0.3)
    own.create_optimizer()
    assert [(g["weight_decay"], len(g["params"])) for g in own.optimizer.param_groups] == [(0.3, 2), (0.0, 2)]
    assert own.get_decay_parameter_names(model) == ["fc1.weight", "fc2.weight"]
    assert isinstance(own.optimizer, torch.optim.AdamW) and not isinstance(opt, torch.optim.AdamW)
    assert transformers.TrainingArguments(output_dir=str(tmp_path)).max_grad_norm == 1.0


def test_hf_trainer_keeps_its_schedule_through_get_scheduler(tmp_path):
    """transformers.get_scheduler over halfadam with a numeric lr: the learning rates Trainer's own scheduler
    logs for the same arguments, and the masters of a plain loop given those rates."""
    transformers = pytest.importorskip("transformers")
    kw = dict(learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=2)
    own = hf_trainer(tmp_path, MLP(), None, None, **kw)  # Trainer builds torch's AdamW and its scheduler
    own.train()
    model = make_model()
    opt = halfadam.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, implementation=IMPL)
    args = own.args
    sched = transformers.get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=args.get_warmup_steps(STEPS),
                                       num_training_steps=STEPS)
    trainer = hf_trainer(tmp_path, model, opt, sched, **kw)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    assert override_warnings(record) == []
    assert logged_lrs(trainer) == logged_lrs(own)
    lrs = [lr for _, lr in logged_lrs(trainer)]
    assert lrs[0] == 0.0 and max(lrs) == 1e-2
    ref_opt, ref_model = replay(model.seen, lambda t: lrs[t], STEPS)
    assert_masters_equal(masters(opt, model), masters(ref_opt, ref_model))


def test_hf_trainer_clips_at_one_by_default(tmp_path):
    """docs/migrating.md: Trainer clips .grad to a global norm of 1.0 unless max_grad_norm=0."""
    transformers = pytest.importorskip("transformers")

    class Norms(transformers.TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # after Trainer's clipping
            self.seen.append(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()])))

    data = [{"x": d["x"], "labels": 100 * d["labels"]} for d in make_data()]  # gradients of norm far above 1
    seen = {}
    for name, extra in {"default": {}, "off": {"max_grad_norm": 0.0}}.items():
        model, norms = make_model(), Norms()
        opt = halfadam.AdamW(model.parameters(), lr=1e-3, implementation=IMPL)
        args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, report_to=[], use_cpu=True,
                                              per_device_train_batch_size=BATCH, save_strategy="no",
                                              disable_tqdm=True, **extra)
        transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, as_lr_scheduler(opt)),
                             callbacks=[norms]).train()
        seen[name] = torch.stack(norms.seen)
    assert len(seen["default"]) == len(seen["off"]) == STEPS
    assert (seen["off"] > 10).all()                          # unclipped
    assert ((seen["default"] - 1.0).abs() < 0.02).all()       # clipped to 1 (bf16 gradients: within rounding)


# ---------------------------------------------------------------------------------------------------
# Lightning
# ---------------------------------------------------------------------------------------------------

LIGHTNING_BATCHES = 3  # per epoch: 2 epochs of STEPS // 2; checkpoints at epoch ends resume exactly


def lightning_module(L):
    class LitMLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = MLP()  # fp32 here; Trainer(precision="bf16-true") makes the parameters bf16
            self.schedule = make_schedule()
            self.seen_lr = []  # (global step, group lr, scheduler's last lr) before each step

        def training_step(self, batch, batch_idx):
            return self.net(batch["x"], batch["labels"])["loss"]

        def on_train_batch_start(self, batch, batch_idx):
            opt, sched = self.trainer.optimizers[0], self.trainer.lr_scheduler_configs[0].scheduler
            self.seen_lr.append((self.trainer.global_step, opt.param_groups[0]["lr"], sched.get_last_lr()[0]))

        def configure_optimizers(self):
            opt = halfadam.AdamW(self.parameters(), learning_rate=self.schedule, weight_decay=0.01,
                                 implementation=IMPL)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": as_lr_scheduler(opt), "interval": "step"}}

    return LitMLP()


def lightning_fit(L, tmp, ckpt_path=None):
    module = lightning_module(L)
    data = torch.utils.data.DataLoader(make_data(LIGHTNING_BATCHES * BATCH), batch_size=BATCH, shuffle=False)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp), every_n_epochs=1, save_top_k=-1,
                                                      save_on_train_epoch_end=True)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, precision="bf16-true", logger=False,
                        callbacks=[checkpoints], enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, trainer, record


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    L = pytest.importorskip("lightning")
    tmp = tmp_path_factory.mktemp("lightning")
    module, trainer, record = lightning_fit(L, tmp)
    return dict(L=L, tmp=tmp, module=module, trainer=trainer, warnings=record)


def test_lightning_steps_halfadam_with_the_schedule(lightning_run):
    module, trainer = lightning_run["module"], lightning_run["trainer"]
    opt = trainer.optimizers[0]
    assert isinstance(opt, halfadam.AdamW)
    assert trainer.global_step == opt.param_groups[0]["global_step"] == STEPS
    schedule = module.schedule
    # before step k, the group and the scheduler show the learning rate step k uses
    assert module.seen_lr == [(k, schedule(k), schedule(k)) for k in range(STEPS)]
    assert override_warnings(lightning_run["warnings"]) == []
    assert_fp32_masters(opt, module.net)
    ref_opt, ref_model = replay(module.net.seen, schedule, STEPS)
    assert len(module.net.seen) == STEPS
    assert_masters_equal(masters(opt, module.net), masters(ref_opt, ref_model))


def test_lightning_checkpoint_keeps_fp32_masters_and_resumes_bitwise(lightning_run, tmp_path):
    L, tmp, module, trainer = (lightning_run[k] for k in ("L", "tmp", "module", "trainer"))
    opt = trainer.optimizers[0]
    saved = torch.load(tmp / f"epoch=1-step={STEPS}.ckpt", weights_only=True)
    state = saved["optimizer_states"][0]["state"]
    for i, m in enumerate(masters(opt, module.net)):
        assert state[i]["master_weight"].dtype == torch.float32
        assert torch.equal(state[i]["master_weight"], m)

    resumed, resumed_trainer, _ = lightning_fit(L, tmp_path, ckpt_path=str(tmp / f"epoch=0-step={STEPS // 2}.ckpt"))
    resumed_opt = resumed_trainer.optimizers[0]
    assert resumed_opt.param_groups[0]["global_step"] == STEPS
    assert resumed.seen_lr == [(k, module.schedule(k), module.schedule(k)) for k in range(STEPS // 2, STEPS)]
    assert_fp32_masters(resumed_opt, resumed.net)
    # Continues bitwise: equal to one uninterrupted plain loop over the first run's 3 batches and the
    # batches the resumed run got. (Which batches those are is Lightning's choice: resuming from this
    # epoch-end checkpoint with a plain DataLoader, Lightning 2.6 fed batch 0 once more before epoch 1,
    # so the batches are compared through the replay rather than against the first run's steps 4-6.)
    assert len(resumed.net.seen) == STEPS // 2
    ref_opt, ref_model = replay(module.net.seen[:STEPS // 2] + resumed.net.seen, module.schedule, STEPS)
    assert_masters_equal(masters(resumed_opt, resumed.net), masters(ref_opt, ref_model))
    if all(torch.equal(a[0], b[0]) for a, b in zip(resumed.net.seen, module.net.seen[STEPS // 2:])):
        assert_masters_equal(masters(resumed_opt, resumed.net), masters(opt, module.net))


# ---------------------------------------------------------------------------------------------------
# accelerate
# ---------------------------------------------------------------------------------------------------


def accelerate_run(accelerate, ckpt_dir, start=0, load_from=None):
    """Steps ``start`` .. STEPS-1 through ``Accelerator(cpu=True)``; ``save_state`` after step 3."""
    accelerator = accelerate.Accelerator(cpu=True)
    schedule = make_schedule()
    model = make_model()
    opt = halfadam.AdamW(model.parameters(), learning_rate=schedule, weight_decay=0.01, implementation=IMPL)
    data = torch.utils.data.DataLoader(make_data(), batch_size=BATCH, shuffle=False)
    model, opt_w, data, scheduler = accelerator.prepare(model, opt, data, as_lr_scheduler(opt))
    if load_from is not None:
        accelerator.load_state(str(load_from))
        data = accelerator.skip_first_batches(data, start)
    lrs = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for k, batch in enumerate(data, start=start):
            lrs.append(scheduler.get_last_lr()[0])
            loss = model(batch["x"], batch["labels"])["loss"]
            accelerator.backward(loss)
            opt_w.step()
            scheduler.step()
            opt_w.zero_grad()
            if k + 1 == STEPS // 2 and load_from is None:
                accelerator.save_state(str(ckpt_dir))
    return dict(model=accelerator.unwrap_model(model), opt=opt, wrapped=opt_w, schedule=schedule, lrs=lrs,
                warnings=record)


def test_accelerate_steps_halfadam_and_round_trips_fp32_masters(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    ckpt = tmp_path / "state"
    run = accelerate_run(accelerate, ckpt)
    model, opt, schedule = run["model"], run["opt"], run["schedule"]
    assert run["wrapped"].optimizer is opt  # accelerate's AcceleratedOptimizer steps the halfadam optimizer
    assert opt.param_groups[0]["global_step"] == STEPS
    assert run["lrs"] == [schedule(k) for k in range(STEPS)]
    assert override_warnings(run["warnings"]) == []
    assert_fp32_masters(opt, model)
    ref_opt, ref_model = replay(model.seen, schedule, STEPS)  # the plain loop on the same data
    assert len(model.seen) == STEPS
    assert_masters_equal(masters(opt, model), masters(ref_opt, ref_model))

    # save_state wrote the halfadam state_dict, fp32 masters included, to optimizer.bin
    saved = torch.load(ckpt / "optimizer.bin", weights_only=True)
    assert saved["param_groups"][0]["global_step"] == STEPS // 2
    assert all(s["master_weight"].dtype == torch.float32 for s in saved["state"].values())
    ref3_opt, ref3_model = replay(model.seen[:STEPS // 2], schedule, STEPS)
    assert_masters_equal([saved["state"][i]["master_weight"] for i in range(len(saved["state"]))],
                         masters(ref3_opt, ref3_model))

    # load_state into a fresh model and optimizer, then steps 4-6: bitwise the uninterrupted run
    resumed = accelerate_run(accelerate, ckpt, start=STEPS // 2, load_from=ckpt)
    assert resumed["lrs"] == [schedule(k) for k in range(STEPS // 2, STEPS)]
    assert resumed["opt"].param_groups[0]["global_step"] == STEPS
    assert_fp32_masters(resumed["opt"], resumed["model"])
    assert_masters_equal(masters(resumed["opt"], resumed["model"]), masters(opt, model))


# ---------------------------------------------------------------------------------------------------
# as_lr_scheduler(opt): the follow scheduler itself (no framework needed)
# ---------------------------------------------------------------------------------------------------


def test_follow_scheduler_reports_the_optimizers_schedule_and_writes_nothing():
    import io

    schedule = make_schedule()
    a = nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    b = nn.Parameter(torch.randn(2, dtype=torch.bfloat16))
    opt = halfadam.AdamW([{"params": [a]}, {"params": [b], "lr": 0.25}], learning_rate=schedule,
                         implementation=IMPL)
    scheduler = as_lr_scheduler(opt)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and scheduler.follows_optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no override warning, no call-order warning
        for k in range(STEPS):
            assert scheduler.get_last_lr() == [schedule(k), 0.25]
            a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
            opt.step()
            assert scheduler.get_last_lr() == [schedule(k), 0.25]  # what step k used, until step()
            assert [g["lr"] for g in opt.param_groups] == [schedule(k + 1), 0.25]
            scheduler.step()
            scheduler.step()  # extra calls (accelerate steps once per process) change nothing
        assert opt.param_groups[0]["global_step"] == STEPS
        assert scheduler.get_last_lr() == [schedule(STEPS), 0.25]
    # its state is plain data: HF Trainer loads scheduler.pt with weights_only=True
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == scheduler.state_dict()

    with pytest.raises(TypeError, match="halfadam optimizer"):
        as_lr_scheduler(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))


def test_explicit_schedule_state_dict_is_plain_data():
    schedule = make_schedule()
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scheduler = as_lr_scheduler(opt, schedule)
    for _ in range(3):
        opt.step()
        scheduler.step()
    import io

    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # the schedule objects are not in it
    opt2 = torch.optim.SGD([p], lr=1.0)
    scheduler2 = as_lr_scheduler(opt2, schedule)
    scheduler2.load_state_dict(state)
    opt2.step()
    scheduler2.step()
    assert opt2.param_groups[0]["lr"] == schedule(4) and scheduler2.schedules == [schedule]
