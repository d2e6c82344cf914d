"""``python -m kvcake.eval ...``: the ``kvcake eval`` command on its own."""

import sys

from .cli import main

sys.exit(main())
