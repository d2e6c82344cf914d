"""``python -m kvcake.cli``: the ``kvcake`` command."""

from kvcake.cli import main

raise SystemExit(main())
