"""Run by tests/test_checkpoint.py in fresh processes (not a test module).

``python checkpoint_helper.py first DIR N M``: for each dtype, train N+M steps uninterrupted and save the
final tensors to DIR/full-<dtype>.pt; train N steps again from scratch and write DIR/ckpt-<dtype>.pt with
save_checkpoint.
``python checkpoint_helper.py second DIR N M``: load each checkpoint into a fresh model, optimizer and
scaler, train M more steps, save the final tensors to DIR/resumed-<dtype>.pt.
``python checkpoint_helper.py killed-save PATH STAGE``: save a first checkpoint, print "saved", then
start a second save that stops at STAGE ("write": half written; "fsync": written, not renamed) and
prints "in-save" before sleeping, to be killed.
"""

import sys
import time

import torch

torch.set_num_threads(1)

import halfadam  # noqa: E402
from halfadam import checkpoint  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def build(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    groups = [
        {"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
        {"params": [model[0].bias, model[2].bias]},
    ]
    # A per-step learning rate (a schedule saved by value) on the first group.
    lrs = [1e-3 * (1 + (i % 7)) for i in range(50)]
    optimizer = halfadam.AdamW(groups, lr=3e-3)
    optimizer.param_groups[0]["lr_schedule"] = halfadam.hyperparams.PerStepValues(lrs)
    scaler = halfadam.GradScaler(init_scale=2.0**24, growth_interval=2) if dtype == torch.float16 else None
    return model, optimizer, scaler


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)


def train(model, optimizer, scaler, start, stop, dtype):
    for step in range(start, stop):
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()


def snapshot(model, optimizer, scaler):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()],
        "global_step": [g["global_step"] for g in optimizer.param_groups],
        "scale": None if scaler is None else scaler.get_scale(),
    }


def main(argv):
    mode, where = argv[0], argv[1]
    if mode == "killed-save":
        stage = argv[2]
        checkpoint.save_checkpoint(where, step=1, data=torch.arange(10.0))
        print("saved", flush=True)
        real_save, real_fsync = torch.save, checkpoint.os.fsync
        if stage == "write":
            def slow_save(obj, f):
                import io

                buf = io.BytesIO()
                real_save(obj, buf)
                data = buf.getvalue()
                f.write(data[: len(data) // 2])
                f.flush()
                print("in-save", flush=True)
                time.sleep(60)
            checkpoint.torch.save = slow_save
        else:
            def slow_fsync(fd):
                real_fsync(fd)
                print("in-save", flush=True)
                time.sleep(60)
            checkpoint.os.fsync = slow_fsync
        checkpoint.save_checkpoint(where, step=2, data=torch.zeros(100_000))
        return
    n, m = int(argv[2]), int(argv[3])
    for name, dtype in DTYPES.items():
        if mode == "first":
            model, optimizer, scaler = build(dtype)
            train(model, optimizer, scaler, 0, n + m, dtype)
            torch.save(snapshot(model, optimizer, scaler), f"{where}/full-{name}.pt")
            model, optimizer, scaler = build(dtype)
            train(model, optimizer, scaler, 0, n, dtype)
            objects = dict(model=model, optimizer=optimizer, step=n)
            if scaler is not None:
                objects["scaler"] = scaler
            checkpoint.save_checkpoint(f"{where}/ckpt-{name}.pt", **objects)
        else:
            model, optimizer, scaler = build(dtype)
            # Different hyperparameters and no schedule: everything must come from the checkpoint.
            optimizer.param_groups[0]["lr_schedule"] = None
            optimizer.param_groups[0]["lr"] = 0.5
            objects = dict(model=model, optimizer=optimizer)
            if scaler is not None:
                objects["scaler"] = scaler
            entries = checkpoint.load_checkpoint(f"{where}/ckpt-{name}.pt", **objects)
            assert entries["step"] == n
            train(model, optimizer, scaler, n, n + m, dtype)
            torch.save(snapshot(model, optimizer, scaler), f"{where}/resumed-{name}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
