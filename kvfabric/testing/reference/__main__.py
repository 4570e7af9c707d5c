"""``python -m kvfabric.testing.reference serve ...``: run the pure-Python reference server."""

import sys

from .main import main

sys.exit(main())
