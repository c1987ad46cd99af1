"""``python -m thing serve`` / ``python -m thing demo``: the ``thing`` command."""

import sys

from .cli import main

sys.exit(main())
