"""``python -m halfadam``: the same as the ``halfadam`` command."""

from halfadam.cli import main

raise SystemExit(main())
