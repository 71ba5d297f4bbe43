"""A DCP save killed between its two renames (issue 46, item 1).

Where the file system lacks ``RENAME_EXCHANGE`` (simulated: ``_dcp_io._exchange`` returns False), a
save renames the old checkpoint aside, then the new one in. A child process that is SIGKILLed right
after the first rename leaves no checkpoint at the path, and two complete ones beside it. Then:

* a load (``load_checkpoint``, ``verify_checkpoint``, ``get_optimizer_state_dict(checkpoint_id=...)``)
  raises CheckpointError naming the new one, which loads bitwise as the model the child saved;
* saves of other checkpoints in that directory (DCP and single-file) remove neither;
* the next save to the path renames the new one back before it removes anything, so that save killed
  at any later point (its leftovers being removed, its data written, between its own two renames)
  still leaves the last complete checkpoint at the path, or named by the load;
* a save that finishes leaves only its checkpoint in the directory.

Expected values are the saved models' and optimizers' own tensors, compared byte for byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import halfadam
import halfadam.checkpoint
import halfadam.distributed as hd
from test_dcp_checkpoints import make, same, snapshot, train

pytest.importorskip("torch.distributed.checkpoint")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
#: The next save renames a killed save's checkpoint back only once its writer has provably ended (/proc).
needs_proc = pytest.mark.skipif(halfadam.checkpoint._writer_scope() is None, reason="no /proc: dead writers "
                                                                                    "cannot be proven")

_CHILD = textwrap.dedent("""
    import os, shutil, signal, sys, warnings
    from pathlib import Path
    warnings.simplefilter("ignore")
    import torch
    torch.set_num_threads(1)
    import halfadam._tempfiles as tempfiles
    import halfadam.distributed as hd
    from halfadam import _dcp_io
    from test_dcp_checkpoints import make, train

    point, path, seed = sys.argv[1], Path(os.path.realpath(sys.argv[2])), int(sys.argv[3])

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    _dcp_io._exchange = lambda a, b: False  # a file system without RENAME_EXCHANGE
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        real_rename(src, dst, *args, **kwargs)
        if point == "between renames" and Path(src) == path:  # the old checkpoint renamed aside
            die()
    os.rename = rename
    if point == "recovered":            # the killed save's checkpoint renamed back, nothing removed yet
        _dcp_io._remove_dead_temporaries = die
    elif point == "removing":           # a leftover's manifest removed, its files not yet
        tempfiles.shutil = type("Shutil", (), {"rmtree": staticmethod(die)})
    elif point == "data written":       # every .distcp file written, no .metadata or manifest yet
        _dcp_io.ChecksummedWriter.finish = die
    model, opt = make("compact", seed=seed)
    train(model, opt, seed=seed)
    hd.save_checkpoint(path, model, opt, extra={"step": seed})
    print("NOT KILLED", flush=True)
""")


def _killed_save(path: Path, point: str, seed: int):
    """Run a save of ``make(seed=seed)`` trained with ``seed`` to ``path`` in a child process SIGKILLed
    at ``point``; the model and optimizer it saved (made here the same way)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(halfadam.__file__).parents[1]),
                                                       str(Path(__file__).parent)]))
    child = subprocess.run([sys.executable, "-c", _CHILD, point, str(path), str(seed)], env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, (child.returncode, child.stdout, child.stderr[-2000:])
    model, opt = make("compact", seed=seed)
    train(model, opt, seed=seed)
    return model, opt


def _loads_as(path: Path, model, opt, step: int) -> None:
    model2, opt2 = make("compact", seed=1)
    assert hd.load_checkpoint(path, model2, opt2) == {"step": step}
    assert same(snapshot(model2, opt2), snapshot(model, opt))


def _named(path: Path) -> Path:
    """The checkpoint that a load of the missing ``path`` names (each load function names the same)."""
    model, opt = make("compact", seed=1)
    messages = []
    for call in (lambda: hd.load_checkpoint(path, model, opt), lambda: hd.verify_checkpoint(path),
                 lambda: hd.get_optimizer_state_dict(model, opt, checkpoint_id=path)):
        with pytest.raises(halfadam.CheckpointError) as info:
            call()
        messages.append(str(info.value))
    start = f"cannot load the checkpoint {path}: no such directory; a save to it that did not finish (killed?) " \
            f"left the complete checkpoint "
    assert messages[0].startswith(start) and messages[1].startswith(start), messages
    assert messages[2].startswith(start.replace("cannot load", "cannot read")), messages[2]
    named = Path(messages[0][len(start):].split(":", 1)[0])
    assert all(str(named) in m for m in messages) and named.parent == path.parent, messages
    return named


@pytest.fixture
def stranded(tmp_path):
    """The checkpoint of step 3 at ``ckpt``, then a save of step 5 over it killed between its two renames:
    ``(path, (model, opt) of step 3, (model, opt) of step 5)``."""
    path = tmp_path / "ckpt"
    old = make("compact", seed=3)
    train(*old, seed=3)
    hd.save_checkpoint(path, *old, extra={"step": 3})
    new = _killed_save(path, "between renames", 5)
    return path, old, new


def test_a_load_names_the_new_checkpoint_that_a_killed_save_left(stranded):
    path, old, new = stranded
    assert not path.exists() and len(os.listdir(path.parent)) == 2  # the new checkpoint and the old one
    named = _named(path)
    _loads_as(named, *new, 5)
    assert not path.exists() and len(os.listdir(path.parent)) == 2  # a load renames nothing


def test_saves_of_other_checkpoints_keep_it(stranded):
    path, old, new = stranded
    left = set(os.listdir(path.parent))
    hd.save_checkpoint(path.parent / "other", *old)  # each removes the dead writers' temporaries
    halfadam.checkpoint.save_checkpoint(path.parent / "other.pt", model=old[0])
    assert set(os.listdir(path.parent)) == left | {"other", "other.pt"}
    _loads_as(_named(path), *new, 5)


@needs_proc
@pytest.mark.parametrize("point", ["recovered", "removing", "data written"])
def test_the_next_save_killed_leaves_the_last_checkpoint_at_the_path(stranded, point):
    path, old, new = stranded
    _killed_save(path, point, 7)
    if point == "removing":  # the old checkpoint's manifest removed first: no longer a complete one
        (left,) = set(os.listdir(path.parent)) - {"ckpt"}
        assert not (path.parent / left / "halfadam.sha256").exists() and (path.parent / left / ".metadata").exists()
    _loads_as(path, *new, 5)
    hd.save_checkpoint(path, *old, extra={"step": 3})
    assert os.listdir(path.parent) == ["ckpt"]
    _loads_as(path, *old, 3)


@needs_proc
def test_the_next_save_killed_between_its_renames_too(stranded):
    path, old, new = stranded
    newest = _killed_save(path, "between renames", 7)
    assert not path.exists()
    _loads_as(_named(path), *newest, 7)
    hd.save_checkpoint(path, *old, extra={"step": 3})
    assert os.listdir(path.parent) == ["ckpt"]
    _loads_as(path, *old, 3)


def test_a_missing_checkpoint_is_named(tmp_path):
    """Nothing left beside it: the same CheckpointError, without a hint (get_optimizer_state_dict
    raised FileNotFoundError)."""
    model, opt = make("compact")
    with pytest.raises(halfadam.CheckpointError, match=rf"^cannot read the checkpoint {tmp_path / 'nope'}: "
                                                       rf"no such directory$"):
        hd.get_optimizer_state_dict(model, opt, checkpoint_id=tmp_path / "nope")


@needs_proc
def test_train_resume_refuses_to_start_over_a_stranded_checkpoint(tmp_path, capsys, monkeypatch):
    """``halfadam train --dist fsdp --resume DIR``: a mode whose checkpoint a killed save left beside its path
    is refused, naming it, before any mode trains (it took the missing path for "not saved yet" and started
    that mode from step 0; its first save would then have replaced the stranded checkpoint)."""
    pytest.importorskip("sklearn")
    import halfadam.cli.train as T
    from halfadam.cli import main

    path = tmp_path / "ck" / "bf16-halfadam-compact.dcp"
    old = make("compact", seed=3)
    train(*old, seed=3)
    hd.save_checkpoint(path, *old, extra={"step": 3})
    _killed_save(path, "between renames", 5)
    monkeypatch.setattr(T, "train_mode", lambda *a, **k: pytest.fail("trained despite a stranded checkpoint"))
    capsys.readouterr()
    assert main(["train", "--task", "digits", "--modes", "bf16-halfadam-compact", "--dist", "fsdp", "--steps", "4",
                 "--no-progress", "--out", str(tmp_path / "out"), "--resume", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"halfadam train: error: --resume: cannot load the checkpoint {path}: no such directory; a save to it "
                          f"that did not finish (killed?) left the complete checkpoint {path.parent}/."), err
    assert err.count("\n") == 1, err
