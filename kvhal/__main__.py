"""``python -m kvhal``: the ``kvhal`` command."""

import sys

from .tools.cli import main

sys.exit(main())
