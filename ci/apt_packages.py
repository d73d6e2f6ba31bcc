"""Print the Debian packages the tests need: the root's and every backend's ``[tool.kvhal] apt``, one line."""

from __future__ import annotations

import sys

from kvhal_tables import apt_packages

sys.stdout.write(" ".join(apt_packages()) + "\n")
