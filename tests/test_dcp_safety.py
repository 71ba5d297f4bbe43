"""halfadam.distributed's saves and loads under attack and faults (issue 33, items 5, 10, 11).

* A load never runs code from the checkpoint: a ``.metadata`` or a non-tensor item that names any
  other global (here ``os.system``, writing a marker file) is refused naming the file, by every load
  path and by ``verify_checkpoint``, even with a manifest recomputed to match; checkpoints of every
  state mode still load bitwise.
* A save over an existing checkpoint, killed (SIGKILL) at any point, leaves the old or the new
  checkpoint whole at the path; the next save removes the killed one's leftovers.
* A full disk (ENOSPC, simulated at the file writes) is reported as such, naming the path; the previous
  checkpoint loads bitwise and no temporary directory stays.
* Crafted or corrupt checkpoints (issue 46, items 2 to 6): a load opens no file outside the directory
  (``..``, absolute names, links) and no FIFO; unpickling ``.metadata`` changes no object it did not
  make and ends; a declared size is checked before it is allocated; every malformed ``.metadata`` is a
  CheckpointError naming the file and what is wrong. A genuine checkpoint loads after items 2 and 3's.

Expected values are the saved objects' own tensors, compared byte for byte.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import halfadam
import halfadam.distributed as hd
from conftest import needs_gloo
from test_dcp_checkpoints import make, same, snapshot, train

dcp = pytest.importorskip("torch.distributed.checkpoint")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MODES = ["fp32", "split", "bf16", "compact", "tiny"]


def _rewrite_manifest(path: Path) -> None:
    """The manifest recomputed over the files as they are now (what a tamperer does)."""
    lines = (path / "halfadam.sha256").read_text().splitlines()
    names = [line.split("  ", 1)[1] for line in lines]
    (path / "halfadam.sha256").write_text(
        "".join(f"{hashlib.sha256((path / n).read_bytes()).hexdigest()}  {n}\n" for n in names))


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _saved(path: Path, mode: str = "compact", seed: int = 0):
    model, opt = make(mode, seed=seed)
    train(model, opt, seed=seed)
    hd.save_checkpoint(path, model, opt, extra={"step": 3})
    return model, opt


# ------------------------------------------------------------------------------ item 5: no code runs
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_still_loads_bitwise(tmp_path, mode):
    """The restricted unpickler and planner admit everything halfadam writes: every state mode, with a
    schedule and extra data, loads into a fresh optimizer of the same mode byte for byte."""
    model, opt = _saved(tmp_path / "ckpt", mode)
    hd.verify_checkpoint(tmp_path / "ckpt")
    model2, opt2 = make(mode, seed=1)
    assert hd.load_checkpoint(tmp_path / "ckpt", model2, opt2) == {"step": 3}
    assert same(snapshot(model2, opt2), snapshot(model, opt))


def test_torch_optimizer_and_plain_dcp_checkpoints_still_load(tmp_path):
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    hd.save_checkpoint(tmp_path / "t", model, opt)
    model2 = torch.nn.Linear(6, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    hd.load_checkpoint(tmp_path / "t", model2, opt2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "plain"))  # no manifest
    model3 = torch.nn.Linear(6, 3)
    hd.load_checkpoint(tmp_path / "plain", model3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model3.state_dict().values()))


@pytest.mark.parametrize("manifest", ["recomputed", "removed"])
def test_a_metadata_file_that_runs_code_is_refused(tmp_path, manifest):
    path = tmp_path / "ckpt"
    _saved(path)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    if manifest == "recomputed":
        _rewrite_manifest(path)
    else:
        (path / "halfadam.sha256").unlink()
    model, opt = make("compact", seed=1)
    before = snapshot(model, opt)
    calls = {"load model and optimizer": lambda: hd.load_checkpoint(path, model, opt),
             "load the model": lambda: hd.load_checkpoint(path, model),
             "load extra": lambda: hd.load_checkpoint(path),
             "layout": lambda: hd.get_optimizer_state_dict(model, opt, checkpoint_id=path),
             "verify": lambda: hd.verify_checkpoint(path)}
    for what, call in calls.items():
        with pytest.raises(halfadam.CheckpointError) as info:
            call()
        message = str(info.value)
        assert f"{path / '.metadata'}: holds a reference to posix.system, which a halfadam checkpoint never " \
               f"contains; refusing to load it" in message, (what, message)
        assert not marker.exists(), what
    assert same(snapshot(model, opt), before)


def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    _saved(path)
    (path / ".metadata").write_bytes(pickle.dumps({"a": [1, 2]}))
    _rewrite_manifest(path)
    with pytest.raises(halfadam.CheckpointError, match=r"\.metadata: holds a dict, not DCP's checkpoint metadata"):
        hd.load_checkpoint(path)


def test_a_non_tensor_item_that_runs_code_is_refused(tmp_path):
    """A checkpoint written by halfadam's own writer (so its manifest matches) whose extra data is an
    object that runs code when unpickled: every load reads the extra data (a model-only and an
    extra-only one too), and each refuses it naming the data file and the item; so does
    verify_checkpoint. DCP's own planner would have run it (``torch.load(weights_only=False)``)."""
    from halfadam._dcp_io import ChecksummedWriter

    source, source_opt = make("compact")
    train(source, source_opt)
    path, marker = tmp_path / "ckpt", tmp_path / "pwned"
    state = {"model": dcp.state_dict.get_model_state_dict(source),
             "optim": hd.get_optimizer_state_dict(source, source_opt), hd.EXTRA_KEY: _Evil(marker)}
    dcp.save(state, storage_writer=ChecksummedWriter(str(path)))
    assert not marker.exists()
    model, opt = make("compact", seed=1)
    before = snapshot(model, opt)
    for call in (lambda: hd.load_checkpoint(path, model, opt), lambda: hd.load_checkpoint(path, model),
                 lambda: hd.load_checkpoint(path), lambda: hd.verify_checkpoint(path)):
        with pytest.raises(halfadam.CheckpointError) as info:
            call()
        message = str(info.value)
        assert f"{path / '__0_0.distcp'} (its item extra): holds a reference to posix.system, which a halfadam " \
               f"checkpoint never contains; refusing to load it" in message, message
        assert not marker.exists()
    assert same(snapshot(model, opt), before)


# ------------------------------------------------------------------------------ item 10: kill -9
_CHILD = textwrap.dedent("""
    import os, sys, time, warnings
    warnings.simplefilter("ignore")
    import halfadam.distributed as hd
    from halfadam import _dcp_io
    from test_dcp_checkpoints import make, train

    point, path = sys.argv[1], sys.argv[2]

    def pause(real):
        def paused(*args, **kwargs):
            print("PAUSED", flush=True)
            time.sleep(120)
            return real(*args, **kwargs)
        return paused

    if point == "data written":       # every .distcp file written, no .metadata or manifest yet
        _dcp_io.ChecksummedWriter.finish = pause(_dcp_io.ChecksummedWriter.finish)
    elif point == "manifest written":  # the new checkpoint whole, not yet swapped in
        _dcp_io.swap_in = pause(_dcp_io.swap_in)
    elif point == "swapped":          # the new checkpoint in place, the old one not yet removed
        _dcp_io._remove_entry = pause(_dcp_io._remove_entry)
    model, opt = make("compact", seed=5)
    train(model, opt, seed=5)
    hd.save_checkpoint(path, model, opt, extra={"step": 5})
    print("DONE", flush=True)
""")


@pytest.mark.parametrize("point", ["data written", "manifest written", "swapped"])
def test_a_save_killed_over_a_checkpoint_leaves_a_whole_one(tmp_path, point):
    path = tmp_path / "ckpt"
    old_model, old_opt = _saved(path)
    new_model, new_opt = make("compact", seed=5)
    train(new_model, new_opt, seed=5)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(halfadam.__file__).parents[1]),
                                                       str(Path(__file__).parent)]))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, point, str(path)], stdout=subprocess.PIPE, env=env,
                             text=True)
    try:
        line = child.stdout.readline().strip()
        assert line == "PAUSED", line
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    model, opt = make("compact", seed=1)
    extra = hd.load_checkpoint(path, model, opt)
    want = (new_model, new_opt, 5) if point == "swapped" else (old_model, old_opt, 3)
    assert extra == {"step": want[2]} and same(snapshot(model, opt), snapshot(want[0], want[1]))
    hd.verify_checkpoint(path)
    assert len(os.listdir(tmp_path)) == 2  # the checkpoint and the killed save's temporary directory
    hd.save_checkpoint(path, old_model, old_opt, extra={"step": 3})  # the next save removes it
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_save_over_a_checkpoint_replaces_it_whole(tmp_path):
    """No file of the old checkpoint stays (a save of fewer files than before), with and without the
    one-step exchange."""
    import halfadam._dcp_io as io_module

    path = tmp_path / "ckpt"
    _saved(path)
    (path / "__7_0.distcp").write_bytes(b"a file of an older save")
    model, opt = make("fp32", seed=4)
    hd.save_checkpoint(path, model, opt)
    assert "__7_0.distcp" not in os.listdir(path) and os.listdir(tmp_path) == ["ckpt"]
    real = io_module._exchange
    try:
        io_module._exchange = lambda a, b: False
        model2, opt2 = make("bf16", seed=6)
        train(model2, opt2, 1, seed=6)
        hd.save_checkpoint(path, model2, opt2)
    finally:
        io_module._exchange = real
    assert os.listdir(tmp_path) == ["ckpt"]
    model3, opt3 = make("bf16", seed=1)
    hd.load_checkpoint(path, model3, opt3)
    assert same(snapshot(model3, opt3), snapshot(model2, opt2))


def test_a_directory_with_other_files_is_not_replaced(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    model, opt = make("fp32")
    with pytest.raises(halfadam.CheckpointError, match=r"run holds 'notes.txt', which is not a file of a DCP "
                                                       r"checkpoint"):
        hd.save_checkpoint(tmp_path / "run", model, opt)
    assert os.listdir(tmp_path / "run") == ["notes.txt"] and os.listdir(tmp_path) == ["run"]


# ------------------------------------------------------------------------------ item 11: full disk
@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata.tmp"])
def test_a_full_disk_is_named_and_the_previous_checkpoint_stays(tmp_path, monkeypatch, victim):
    from torch.distributed.checkpoint.filesystem import FileSystem

    path = tmp_path / "ckpt"
    old_model, old_opt = _saved(path)
    real = FileSystem.create_stream

    class Full(io.RawIOBase):
        """A file on a disk with 1000 bytes left."""

        def __init__(self, raw):
            self.raw, self.left = raw, 1000

        def writable(self):
            return True

        def write(self, b):
            n = len(memoryview(b))
            if n > self.left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= n
            return self.raw.write(b)

        def fileno(self):
            return self.raw.fileno()

        def tell(self):
            return self.raw.tell()

    import contextlib

    @contextlib.contextmanager
    def create_stream(self, file, mode):
        with real(self, file, mode) as stream:
            yield Full(stream) if "w" in mode and Path(file).name == victim else stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    model, opt = make("compact", seed=5)
    train(model, opt, seed=5)
    with pytest.raises(halfadam.CheckpointError) as info:
        hd.save_checkpoint(path, model, opt)
    message = str(info.value)
    assert message.startswith(f"cannot save the checkpoint {path}: the disk is full (no space left on device"), message
    assert "enforce fail" not in message
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporary directory left
    model2, opt2 = make("compact", seed=1)
    assert hd.load_checkpoint(path, model2, opt2) == {"step": 3}
    assert same(snapshot(model2, opt2), snapshot(old_model, old_opt))


def test_a_checkpoint_directory_under_a_file_names_the_checkpoint_path(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    path = tmp_path / "afile" / "ckpt"
    model, opt = make("compact", seed=5)
    with pytest.raises(halfadam.CheckpointError) as info:
        hd.save_checkpoint(path, model, opt)
    cause = info.value.__cause__
    assert isinstance(cause, NotADirectoryError) and cause.filename == str(path), repr(cause)
    assert str(info.value).startswith(f"cannot save the checkpoint {path}: "), str(info.value)
    assert f"{tmp_path / 'afile'} is a file, not a directory" in str(info.value)
    assert (tmp_path / "afile").read_text() == "not a directory"


# ------------------------------------------------------------------------------ on 2 ranks
def _full_disk_worker(rank, world, out):
    """Both ranks save over a checkpoint of theirs while rank 1's disk is full: both get the full-disk
    error (rank 1's OSError crosses to rank 0), and both then load the previous checkpoint bitwise."""
    import contextlib

    from torch.distributed.checkpoint.filesystem import FileSystem

    from test_dcp_checkpoints import _fsdp, _local_bytes

    dist = torch.distributed
    path = Path(out) / "ckpt"
    model, opt = make("compact")
    model = _fsdp(model)
    opt = halfadam.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, state_mode="compact")
    train(model, opt)
    hd.save_checkpoint(path, model, opt, extra={"step": 3})
    saved = _local_bytes(model, opt)
    train(model, opt, 1, seed=3)
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def full(self, file, mode):
        if "w" in mode and rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        with real(self, file, mode) as stream:
            yield stream

    FileSystem.create_stream = full
    try:
        hd.save_checkpoint(path, model, opt, extra={"step": 4})
        error = None
    except halfadam.CheckpointError as exc:
        error = str(exc)
    finally:
        FileSystem.create_stream = real
    dist.barrier()
    left = sorted(os.listdir(out))
    m2 = _fsdp(make("compact", seed=1)[0])
    o2 = halfadam.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1, state_mode="compact")
    extra = hd.load_checkpoint(path, m2, o2)
    bitwise = all(torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)
                  for a, b in zip(saved, _local_bytes(m2, o2)))
    results = [None] * world
    dist.all_gather_object(results, (error, left, extra, bitwise))
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")


@needs_gloo
@pytest.mark.distributed
def test_a_full_disk_on_one_rank_fails_every_rank_and_keeps_the_checkpoint(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hd.launch(_full_disk_worker, 2, str(tmp_path), timeout_s=120)
    for error, left, extra, bitwise in torch.load(tmp_path / "results.pt"):
        assert error is not None and error.startswith(f"cannot save the checkpoint {tmp_path / 'ckpt'}: rank 1: the "
                                                      f"disk is full (no space left on device: "), error
        assert left == ["ckpt"] and extra == {"step": 3} and bitwise


# ------------------------------------------------------------------------------ issue 46: crafted checkpoints
def _edit_metadata(path: Path, edit) -> None:
    """``edit`` applied to the checkpoint's metadata (unpickled: the test's own, trusted), written back, and
    the manifest recomputed (what a tamperer does)."""
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _metadata_calls(path: Path, model, opt):
    """Every load path that reads ``.metadata``, by name."""
    return {"load model and optimizer": lambda: hd.load_checkpoint(path, model, opt),
            "load the model": lambda: hd.load_checkpoint(path, model),
            "load extra": lambda: hd.load_checkpoint(path),
            "layout": lambda: hd.get_optimizer_state_dict(model, opt, checkpoint_id=path),
            "verify": lambda: hd.verify_checkpoint(path)}


@pytest.mark.parametrize("manifest", ["recomputed", "removed"])
@pytest.mark.parametrize("escape", ["relative", "absolute", "link"])
def test_a_load_opens_no_file_outside_the_checkpoint(tmp_path, escape, manifest):
    """Item 2: ``.metadata`` naming another checkpoint's data file (``../a/__0_0.distcp``, or its absolute
    path), or a data file that is a link to it, with a manifest recomputed to match or none: every load
    and verify_checkpoint refuse, naming the file, and load nothing of the other checkpoint (which has
    the same layout, so reading it would succeed)."""
    other, path = tmp_path / "a", tmp_path / "ckpt"
    other_model, other_opt = _saved(other, seed=7)
    _saved(path)
    outside = other / "__0_0.distcp"
    name = {"relative": "../a/__0_0.distcp", "absolute": str(outside), "link": "__0_0.distcp"}[escape]
    if escape == "link":
        (path / name).unlink()
        (path / name).symlink_to(outside)
    else:
        def edit(metadata):
            for index, info in metadata.storage_data.items():
                info.relative_path = name

        _edit_metadata(path, edit)
    if manifest == "recomputed":
        (path / "halfadam.sha256").write_text(f"{_sha256(path / '.metadata')}  .metadata\n{_sha256(outside)}  {name}\n")
    else:
        (path / "halfadam.sha256").unlink()
    if escape == "link":
        want = f"{path / name}: lies outside the checkpoint directory {path} (a link to " \
               f"{os.path.realpath(outside)}); refusing to read it"
    else:
        want = f"{path / '.metadata'}: names the data file {name!r} (for its item "
    model, opt = make("compact", seed=1)
    before = snapshot(model, opt)
    calls = _metadata_calls(path, model, opt)
    if escape == "link":
        del calls["layout"]  # reads .metadata alone
    for what, call in calls.items():
        with pytest.raises(halfadam.CheckpointError) as info:
            call()
        if what == "verify" and manifest == "recomputed":  # it checks the manifest's files first
            want = f"{path / name}: lies outside the checkpoint directory {path}"
        assert want in str(info.value), (what, str(info.value))
    assert same(snapshot(model, opt), before)
    assert hd.load_checkpoint(other, model, opt) == {"step": 3}  # the other checkpoint, genuine, loads
    assert same(snapshot(model, opt), snapshot(other_model, other_opt))


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _text(s: str) -> bytes:
    return pickle.BINUNICODE + len(s).to_bytes(4, "little") + s.encode()


@pytest.mark.parametrize("target", ["a class", "an enum member"])
def test_unpickling_metadata_changes_nothing_outside_what_it_returns(tmp_path, target):
    """Item 3: a ``.metadata`` whose pickle gives attributes (BUILD) to an object it only names, here
    ``pathlib.PosixPath`` itself (its ``__truediv__``, used by every path join) or a member of DCP's
    memory-format enum, both shared by the whole process: refused before the attribute is set, by every
    load path; the class and the member are as they were, and a genuine checkpoint loads after."""
    import pathlib

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    if target == "a class":  # PosixPath.__truediv__ = collections.OrderedDict, by BUILD's (dict, slot state)
        crafted = (_global("pathlib", "PosixPath") + pickle.NONE + pickle.EMPTY_DICT + _text("__truediv__")
                   + _global("collections", "OrderedDict") + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD)
        what = "the class pathlib.PosixPath"
    else:  # _MEM_FORMAT_ENCODING(0).halfadam_marker = True, by BUILD's dict state
        crafted = (_global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING") + pickle.BININT1 + b"\0"
                   + pickle.TUPLE1 + pickle.REDUCE + pickle.EMPTY_DICT + _text("halfadam_marker") + pickle.NEWTRUE
                   + pickle.SETITEM + pickle.BUILD)
        what = "a torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"
    path = tmp_path / "ckpt"
    _saved(path)
    (path / ".metadata").write_bytes(pickle.PROTO + b"\2" + crafted + pickle.STOP)
    _rewrite_manifest(path)
    model, opt = make("compact", seed=1)
    try:
        for name, call in _metadata_calls(path, model, opt).items():
            with pytest.raises(halfadam.CheckpointError) as info:
                call()
            assert f"{path / '.metadata'}: sets attributes of {what}, which DCP's metadata never does; refusing to " \
                   f"load it" in str(info.value), (name, str(info.value))
        assert "__truediv__" not in vars(pathlib.PosixPath) and "halfadam_marker" not in vars(member)
    finally:  # where the attribute was set after all (the code before the fix), for the tests that follow
        if "__truediv__" in vars(pathlib.PosixPath):
            del pathlib.PosixPath.__truediv__
        vars(member).pop("halfadam_marker", None)
    genuine_model, genuine_opt = _saved(tmp_path / "genuine", seed=3)
    assert hd.load_checkpoint(tmp_path / "genuine", model, opt) == {"step": 3}
    assert same(snapshot(model, opt), snapshot(genuine_model, genuine_opt))


def test_a_declared_size_is_checked_before_anything_is_allocated(tmp_path):
    """Item 4: ``.metadata`` declaring a master weight of 2^44 float32 elements (64 TiB) for an optimizer
    without master weights (a field its layout lacks, so the load would make a tensor of the saved size
    to read it into): refused naming the key and the sizes, before any allocation, by the load and by
    ``get_optimizer_state_dict(checkpoint_id=)``. The genuine size gets the optimizer's own refusal."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    path = tmp_path / "ckpt"
    _saved(path, "fp32")
    key = "optim.state.0.weight.master_weight"

    def edit(metadata):
        meta = metadata.state_dict_metadata[key]
        meta.size = torch.Size([2 ** 44])
        meta.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([2 ** 44]))]
        metadata.storage_data[MetadataIndex(key, [0])] = metadata.storage_data.pop(MetadataIndex(key, [0, 0]))

    model, opt = make("fp32", seed=1, master_weights=False)
    with pytest.raises(halfadam.CheckpointError, match="has a master weight .* but this optimizer keeps none"):
        hd.load_checkpoint(path, model, opt)
    _edit_metadata(path, edit)
    want = f"{path / '.metadata'}: its key {key!r} is a tensor of {2 ** 44} elements [{2 ** 44}], more than its " \
           f"parameter's {8 * 256}, which no state tensor has; refusing to allocate it"
    before = snapshot(model, opt)
    with pytest.raises(halfadam.CheckpointError) as info:
        hd.load_checkpoint(path, model, opt)
    assert want in str(info.value), str(info.value)
    assert same(snapshot(model, opt), before)
    with pytest.raises(halfadam.CheckpointError) as info:
        hd.get_optimizer_state_dict(model, opt, checkpoint_id=path)
    assert want in str(info.value), str(info.value)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("manifest", ["kept", "removed"])
@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata"])
def test_a_fifo_in_a_checkpoint_is_never_opened(tmp_path, victim, manifest):
    """Item 5: a data file or ``.metadata`` that is a FIFO (opening it for reading blocks until a writer
    comes): the load and verify_checkpoint refuse it at once, naming it (an alarm ends the test where
    they block)."""
    path = tmp_path / "ckpt"
    _saved(path)
    if manifest == "removed":
        (path / "halfadam.sha256").unlink()
    (path / victim).unlink()
    os.mkfifo(path / victim)
    model, opt = make("compact", seed=1)
    before = snapshot(model, opt)

    def blocked(signum, frame):
        raise TimeoutError(f"blocked opening {victim}")

    previous = signal.signal(signal.SIGALRM, blocked)
    try:
        for call in (lambda: hd.load_checkpoint(path, model, opt), lambda: hd.verify_checkpoint(path)):
            signal.alarm(5)
            with pytest.raises(halfadam.CheckpointError) as info:
                call()
            signal.alarm(0)
            assert f"{path / victim}: is a FIFO, not a regular file; a checkpoint's files are regular files, " \
                   f"refusing to read it" in str(info.value), str(info.value)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert same(snapshot(model, opt), before)


@pytest.mark.parametrize("content, message", [
    (pickle.PROTO + b"\2" + pickle.EXT1 + b"\5" + pickle.STOP,
     "uses pickle's extension registry, which DCP's metadata never does; refusing to load it"),
    (pickle.PERSID + b"abc\n" + pickle.STOP,
     "holds a persistent id ('abc'), which DCP's metadata never contains; refusing to load it"),
    (pickle.PROTO + b"\2" + _text("abc") + pickle.BINPERSID + pickle.STOP,
     "holds a persistent id ('abc'), which DCP's metadata never contains; refusing to load it"),
    (None, "cannot be unpickled (corrupt or truncated?): "),  # None: the checkpoint's own, cut in half
    (b"\0\1 not a pickle", "cannot be unpickled (corrupt or truncated?): "),
], ids=["EXT1", "PERSID", "BINPERSID", "truncated", "not a pickle"])
def test_metadata_that_is_not_a_plain_pickle_is_a_checkpoint_error(tmp_path, content, message):
    """Item 6: corrupt ``.metadata`` (pickle's persistent ids, its extension registry, cut short, no
    pickle): CheckpointError naming the file and what is wrong from every load path (a raw ValueError
    or UnpicklingError from get_optimizer_state_dict(checkpoint_id=) before)."""
    path = tmp_path / "ckpt"
    _saved(path)
    data = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(data[:len(data) // 2] if content is None else content)
    _rewrite_manifest(path)
    model, opt = make("compact", seed=1)
    for name, call in _metadata_calls(path, model, opt).items():
        with pytest.raises(halfadam.CheckpointError) as info:
            call()
        assert f"{path / '.metadata'}: {message}" in str(info.value), (name, str(info.value))


def _nested_tuples(depth: int) -> bytes:
    """Pickle opcodes that leave ``t[depth]`` on the stack, ``t[0] = (1,)`` and ``t[i] = (t[i-1], t[i-1])``:
    a few bytes a level, each level sharing the one below, so hashing (or printing) it takes 2^depth steps."""
    ops = pickle.BININT1 + b"\1" + pickle.TUPLE1 + pickle.BINPUT + b"\0" + pickle.POP
    for i in range(1, depth + 1):
        ops += pickle.BINGET + bytes([i - 1]) + pickle.BINGET + bytes([i - 1]) + pickle.TUPLE2 + pickle.BINPUT + \
            bytes([i]) + pickle.POP
    return ops + pickle.BINGET + bytes([depth])


_HASHED = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("ignore")
    import halfadam, halfadam.distributed as hd
    for path in sys.argv[1:]:
        try:
            hd.verify_checkpoint(path)
            print("LOADED", flush=True)
        except halfadam.CheckpointError as exc:
            print(exc, flush=True)
""")


def test_metadata_that_would_hash_for_ever_is_refused_at_once(tmp_path):
    """A ``.metadata`` of a few hundred bytes whose nested tuples (60 levels, each sharing the one below)
    are a dict's key, or the argument of the enum DCP's metadata names (a lookup: a hash), directly or
    as the state of a second BUILD of an object given that enum as its ``__setstate__`` by the first:
    hashing them takes 2^60 steps (the C unpickler, in C, cannot even be interrupted). Refused at
    once, naming the file; run in a child process, which the test ends after 60 s."""
    enum = _global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
    bombs = {"key": pickle.EMPTY_DICT + _nested_tuples(60) + pickle.NONE + pickle.SETITEM,
             "call": enum + _nested_tuples(60) + pickle.TUPLE1 + pickle.REDUCE,
             "setstate": _global("torch.distributed.checkpoint.metadata", "MetadataIndex") + pickle.EMPTY_TUPLE
             + pickle.NEWOBJ + pickle.EMPTY_DICT + _text("__setstate__") + enum + pickle.SETITEM + pickle.BUILD
             + _nested_tuples(60) + pickle.BUILD}
    for name, bomb in bombs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(pickle.PROTO + b"\2" + bomb + pickle.STOP)
    env = dict(os.environ, PYTHONPATH=str(Path(halfadam.__file__).parents[1]))
    try:
        out = subprocess.run([sys.executable, "-c", _HASHED, *(str(tmp_path / name) for name in bombs)], env=env,
                             capture_output=True, text=True, timeout=60).stdout.splitlines()
    except subprocess.TimeoutExpired:
        pytest.fail("the load still hashed after 60 s")
    assert out == [f"cannot load the checkpoint {tmp_path / 'key'}: {tmp_path / 'key' / '.metadata'}: keys a dict by "
                   f"other than a string, an int or a MetadataIndex, which DCP's metadata never does; refusing to "
                   f"load it",
                   f"cannot load the checkpoint {tmp_path / 'call'}: {tmp_path / 'call' / '.metadata'}: calls "
                   f"_MEM_FORMAT_ENCODING with other than plain values, which DCP's metadata never does; refusing to "
                   f"load it",
                   f"cannot load the checkpoint {tmp_path / 'setstate'}: {tmp_path / 'setstate' / '.metadata'}: "
                   f"gives a MetadataIndex a state other than its attributes, which DCP's metadata never does; "
                   f"refusing to load it"], out


def _add_item(metadata, name: str, like: str) -> None:
    """A new item ``name`` in ``metadata``, stored where the item ``like`` is."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata.state_dict_metadata[name] = metadata.state_dict_metadata[like]
    metadata.storage_data[MetadataIndex(name)] = metadata.storage_data[MetadataIndex(like)]


def _renumbered(metadata) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    prefix = "optim.param_groups.0."
    for name in [n for n in metadata.state_dict_metadata if n.startswith(prefix)]:
        new = "optim.param_groups.3." + name[len(prefix):]
        metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(name)
        metadata.storage_data[MetadataIndex(new)] = metadata.storage_data.pop(MetadataIndex(name))


def _without_storage(metadata) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata.storage_data.pop(MetadataIndex("model.0.weight", [0, 0]))


@pytest.mark.parametrize("edit, message", [
    (lambda md: _add_item(md, "optim.param_groups.x.lr", "optim.param_groups.0.lr"),
     "its key 'optim.param_groups.x.lr' is not 'optim.param_groups.<group index>.<name>'"),
    (_renumbered, "its parameter groups under 'optim' are numbered [3], not 0 to 0"),
    (lambda md: _add_item(md, "optim.param_groups.0.lr.x", "optim.param_groups.0.lr"),
     "its key 'optim.param_groups.0.lr.x' holds a value where another key holds values under it (or the other "
     "way round)"),
    (lambda md: setattr(md, "storage_meta", "x"),
     "is malformed: its state_dict_metadata and storage_data must be dicts and its storage_meta a StorageMeta"),
    (_without_storage, "is malformed: its item 'model.0.weight' (or one of its chunks) has no storage entry"),
], ids=["group index", "group numbers", "value and dict", "storage_meta", "no storage entry"])
def test_malformed_metadata_is_a_checkpoint_error(tmp_path, edit, message):
    """Item 6: ``.metadata`` that unpickles but is not what DCP writes (keys that are not DCP's flattening of
    an optimizer state dict, a wrong field type, an item without its place in a file): CheckpointError
    naming the file and what is wrong, from the load and from get_optimizer_state_dict(checkpoint_id=),
    before either changes anything."""
    path = tmp_path / "ckpt"
    _saved(path)
    _edit_metadata(path, edit)
    model, opt = make("compact", seed=1)
    before = snapshot(model, opt)
    for call in (lambda: hd.load_checkpoint(path, model, opt),
                 lambda: hd.get_optimizer_state_dict(model, opt, checkpoint_id=path)):
        with pytest.raises(halfadam.CheckpointError) as info:
            call()
        assert f"{path / '.metadata'}: {message}" in str(info.value), str(info.value)
        assert same(snapshot(model, opt), before)


@pytest.mark.parametrize("what", ["a bytes item", "a tensor item", "a truncated file, no manifest"])
def test_an_item_past_its_files_end_is_refused_before_it_is_read(tmp_path, what):
    """``.metadata`` declaring an item of 2^50 bytes (its manifest recomputed), or a data file cut in half in a
    checkpoint without a manifest: every load and verify_checkpoint refuse, naming the file and the item,
    before reading or allocating it (it was a MemoryError or an OSError naming no file; verify_checkpoint
    passed the truncated file)."""
    path = tmp_path / "ckpt"
    _saved(path)
    if what == "a truncated file, no manifest":
        data = (path / "__0_0.distcp").read_bytes()
        (path / "__0_0.distcp").write_bytes(data[:len(data) // 2])
        (path / "halfadam.sha256").unlink()
    else:
        def edit(metadata):
            prefix = hd.EXTRA_KEY if what == "a bytes item" else "model."  # an item every load below reads
            fqn = next(k for k in metadata.state_dict_metadata if k.startswith(prefix))
            next(info for index, info in metadata.storage_data.items() if index.fqn == fqn).length = 2 ** 50

        _edit_metadata(path, edit)
    model, opt = make("compact", seed=1)
    before = snapshot(model, opt)
    calls = _metadata_calls(path, model, opt)
    del calls["layout"]  # reads .metadata alone
    if what != "a bytes item":
        del calls["load extra"]  # reads the extra data alone
    for call_name, call in calls.items():
        with pytest.raises(halfadam.CheckpointError) as info:
            call()
        message = str(info.value)
        assert f"{path / '__0_0.distcp'}: its item " in message and "past the file's" in message, (call_name, message)
    assert same(snapshot(model, opt), before)
