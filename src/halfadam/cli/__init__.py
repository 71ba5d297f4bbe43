"""The ``halfadam`` command line: ``halfadam <command> [options]``.

Each command is a module in this package with ``HELP`` (a one-line summary), ``add_arguments(parser)``
and ``run(args) -> int``. Adding a command is one line in :data:`COMMANDS`.

``halfadam --help`` imports every command's module to build its parser, so a command module imports
torch (and anything heavy) inside ``run``, not at its top: help then answers in a fraction of a second
instead of 2-3 s (tests/test_cli.py checks every command of :data:`COMMANDS`).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from .errors import CLIError

__all__ = ["COMMANDS", "CLIError", "build_parser", "main"]

#: Command name -> module implementing it (absolute, or relative to this package).
COMMANDS = {
    "train": ".train",
    "bench": "halfadam.bench",
    "doctor": "halfadam.doctor",
}


def _plain_text(text: str) -> str:
    """``text`` without docstring markup: ````code```` and ``:role:`target``` become ``code`` and ``target``."""
    return _MARKUP.sub(lambda m: m[1] or m[2], text)


_MARKUP = re.compile(r"``(.+?)``|:[\w:]+:`~?([^`]+)`")


class _PlainFormatter(argparse.HelpFormatter):
    """argparse's formatter, printing descriptions and help taken from docstrings as plain text."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(_plain_text(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return _plain_text(super()._expand_help(action))


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (no usage dump), exit status 2, and whose
    help is plain text (no docstring markup)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _PlainFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D102 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of :data:`COMMANDS`."""
    parser = _Parser(prog="halfadam", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name, __name__)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run, _prog=command.prog)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``halfadam`` with ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    User errors (bad options, missing files, unavailable devices) print one line on stderr and
    return 2; they never show a traceback.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args._run(args)
    except CLIError as exc:
        print(f"{args._prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{args._prog}: interrupted", file=sys.stderr)
        return 130
