"""Checks of the paths a command will write, made with its other path checks before anything is built,
and the one-line message of a write to one of them that fails later in the run."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from geofm.errors import OutputPathError

_OUTPUTS: dict[Path, tuple[str, str]] = {}
"""The outputs checked so far in this process: absolute path -> the option naming it and the path as
given, for :func:`output_write_error`."""


def _refused(folder: Path) -> str | None:
    """Why no file can be created in the existing ``folder``, or None if one can: a probe file is
    created and removed (``os.access`` says yes to root even on a read-only mount or /sys)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".geofm-write-probe-"):
            return None
    except OSError as err:
        return f"{folder} is not writable ({err.strerror or err})"


def _unwritable(path: Path, folder: bool) -> str | None:
    """Why ``path`` (a folder to fill, or a file to write) cannot be written, or None if it can."""
    if path.exists():
        if path.is_dir() != folder:
            return f"it is a {'file' if folder else 'folder'}, not a {'folder' if folder else 'file'}"
        return _refused(path if folder else path.parent)
    existing = next(parent for parent in path.parents if parent.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    return _refused(existing)


def check_writable(path: str | Path, name: str, *, folder: bool) -> None:
    """Check that ``path`` can be written: the folder itself (``folder``) or a file there, by writing a
    probe file into the deepest folder of it that exists. A write to ``path`` that fails later in the
    run is then reported naming ``name`` (:func:`output_write_error`).

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
    _OUTPUTS[absolute] = (name, str(path))


def _within(written: Path, output: Path) -> bool:
    """Whether ``written`` is the output, inside it, or a file beside it of its name (``OUT.tif.partial``)."""
    beside = written.parent == output.parent and written.name.startswith(f"{output.name}.")
    return written == output or output in written.parents or beside


def output_write_error(err: OSError) -> OutputPathError | None:
    """``err``, a failed write to an output a command checked with :func:`check_writable`, as one line
    naming its option, path and the system's reason; None where ``err`` is not about such an output.

    The path is the error's file name, or for a library that names it only in its message (rasterio),
    the first output the message names.
    """
    named = [Path(name).absolute() for name in (err.filename, err.filename2) if isinstance(name, str | os.PathLike)]
    for output, (option, given) in _OUTPUTS.items():
        if named:
            written = next((path for path in named if _within(path, output)), None)
        else:
            written = output if any(re.search(rf"{re.escape(p)}\b", str(err)) for p in {str(output), given}) else None
        if written is not None:
            reason = err.strerror or str(err)
            where = "" if written == output else f" ({written})"
            return OutputPathError(f"{option} {output} cannot be written{where}: {reason}; choose another path")
    return None
