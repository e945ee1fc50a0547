"""``python -m fulcrum`` = the ``fulcrum`` command."""

import sys

from fulcrum.cli import main

sys.exit(main())
