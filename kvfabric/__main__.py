"""``python -m kvfabric ...`` is the ``kvfabric`` command."""

import sys

from .cli import main

sys.exit(main())
