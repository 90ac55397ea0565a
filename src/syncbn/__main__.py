"""``python -m syncbn``: the ``syncbn`` command line."""

from __future__ import annotations

import sys

from syncbn._cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
