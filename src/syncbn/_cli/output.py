"""Where the commands write their results, checked before the minutes of work that make
them (``syncbn demo --out``, ``syncbn bench --json``): a failure to write at the end lost
the whole run."""

from __future__ import annotations

import tempfile

__all__ = ["new_file_refusal"]


def new_file_refusal(folder: str) -> OSError | None:
    """Why ``folder`` takes no new file, or ``None``: a file of its own is created there
    and removed at once (a folder such as ``/proc`` passes ``os.access``)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as error:
        return error
