"""Checks of the paths a command will write, made with its other path checks before anything is built."""

from __future__ import annotations

import os
from pathlib import Path

from geofm.errors import OutputPathError


def _unwritable(path: Path, folder: bool) -> str | None:
    """Why ``path`` (a folder to fill, or a file to write) cannot be written, or None if it can."""
    if path.exists():
        if path.is_dir() != folder:
            return f"it is a {'file' if folder else 'folder'}, not a {'folder' if folder else 'file'}"
        if not os.access(path if folder else path.parent, os.W_OK):
            return f"{path if folder else path.parent} is not writable"
        return None
    existing = next(parent for parent in path.parents if parent.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def check_writable(path: str | Path, name: str, *, folder: bool) -> None:
    """Check that ``path`` can be written: the folder itself (``folder``) or a file there.

    Args:
        path: the output, relative to the working directory or absolute.
        name: the option or config field that names it, e.g. ``--out`` or ``run.output_dir``.
        folder: whether the command fills ``path`` as a folder (created when missing) or writes one file.

    Raises:
        OutputPathError: naming ``name``, the absolute path and why it cannot be written.
    """
    absolute = Path(path).absolute()
    reason = _unwritable(absolute, folder)
    if reason is not None:
        raise OutputPathError(f"{name} {absolute} cannot be written: {reason}; choose another path")
