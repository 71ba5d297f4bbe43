"""``halfadam train --nproc N``: start N CPU processes (gloo) and report a failure in any of them as one line.

:func:`_launch` runs a function in ``nproc`` processes (:func:`halfadam.distributed.launch`). A process
that fails writes what went wrong with :func:`_write_failure`; the launching process reads it back and
turns it into one line: a :class:`~halfadam.cli.errors.CLIError` stays one (exit status 2), anything
else names the failing rank (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .errors import CLIError


def _write_failure(error_dir: str, rank: int, exc: Exception) -> None:
    """Write ``exc`` to ``error_dir/<rank>.json`` for :func:`_launch`: a :class:`CLIError`'s message, or the
    exception's type and first line."""
    cli = isinstance(exc, CLIError)
    first = (str(exc).strip().splitlines() or [""])[0]
    message = first if cli else f"{type(exc).__name__}: {first}".rstrip(": ")
    Path(error_dir, f"{rank}.json").write_text(json.dumps({"cli": cli, "message": message}))


def _read_failures(error_dir: str) -> dict[int, dict]:
    """What the failed processes wrote with :func:`_write_failure`, by rank (unreadable files left out)."""
    errors = {}
    for path in Path(error_dir).glob("*.json"):
        try:
            errors[int(path.stem)] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return errors


def _launch(run_rank: Callable, args: argparse.Namespace, nproc: int) -> int:
    """Run ``run_rank(rank, nproc, args, error_dir)`` in ``nproc`` gloo processes
    (:func:`halfadam.distributed.launch`); returns the exit status.

    A failure in any process ends all of them and is reported as one line: a :class:`CLIError` raised
    by any rank is raised here (the other ranks then fail only because a peer went away); anything else
    prints the failing rank and exception and returns 1.
    """
    from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

    from halfadam.distributed import launch

    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)  # no "Terminating process ... via signal SIGTERM" when a rank fails
    try:
        with tempfile.TemporaryDirectory(prefix="halfadam-nproc-") as error_dir:
            try:
                launch(run_rank, nproc, args, error_dir)
                return 0
            except ProcessException as exc:
                errors = _read_failures(error_dir)
                cli = sorted(r for r, e in errors.items() if e.get("cli"))
                if cli:
                    raise CLIError(errors[cli[0]]["message"]) from None
                rank = exc.error_index
                if rank in errors:
                    what = errors[rank]["message"]
                elif isinstance(exc, ProcessExitedException) and exc.signal_name:
                    what = f"terminated by {exc.signal_name}"
                else:
                    what = str(exc).strip().splitlines()[-1]
                prog = getattr(args, "_prog", "halfadam train")
                print(f"{prog}: error: process {rank} of --nproc {nproc} failed: {what} "
                      f"(the same command under torchrun --standalone --nproc-per-node {nproc} -m halfadam "
                      f"shows the traceback)", file=sys.stderr)
                return 1
    finally:
        spawn_log.setLevel(level)
