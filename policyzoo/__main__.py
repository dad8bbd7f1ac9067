"""``python -m policyzoo``: the command line (see `policyzoo.cli`)."""

import sys

from .cli import main

sys.exit(main())
