"""The one exception the command line turns into a one-line error message."""


class CLIError(Exception):
    """A user-facing error: ``halfadam`` prints ``halfadam <command>: error: <message>`` and exits 2."""
