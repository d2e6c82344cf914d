"""``python -m kvcake.bench {memory,prefill,decode,bandwidth,all} ...``."""

import sys

from .cli import main

sys.exit(main())
