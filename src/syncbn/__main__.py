"""``python -m syncbn``: the ``syncbn`` command line."""

from __future__ import annotations

import sys

from syncbn.cli import main

if __name__ == "__main__":
    sys.exit(main())
