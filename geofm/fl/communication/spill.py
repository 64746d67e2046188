"""A round's uploads and decoded updates on disk, so that the server's memory stays flat in its clients.

The uploads themselves: as each reply arrives, the transport writes its arrays to the run's
``spill/uploads`` folder (:class:`UploadStore`) and keeps only a :class:`StoredArrays` handle,
which maps an array afresh each time it is taken; nothing of it stays resident once the caller
lets it go. A float32 upload (FedAvg's) is as large as the decoded update, so keeping every
encoded upload in memory would grow as the decoded ones do.

The weighted mean (FedAvg's, and every rule built on it) streams: each accepted upload is
decoded, added to a running sum and freed, so the server holds the encoded uploads and one
decoded update whatever the number of clients. The coordinate-wise median, the trimmed mean and
Krum compare every client's value of a coordinate (or every pair of updates); they spill instead:
:class:`SpilledUpdates` decodes the updates one at a time into a float32 file of one row per client,
laid out by blocks of columns, and reads it back one block (all clients, a range of coordinates)
at a time. The blocks are read with plain file reads rather than through a memory map, so the
pages read are the kernel's cache, not the server's resident memory: the server holds one block
of at most :data:`BLOCK_BYTES` besides the result.

The file lives in a temporary folder under the run's ``spill`` folder (:data:`SPILL_FOLDER`) and
is removed as soon as the rule is done; the stored uploads once the round is aggregated. A server
killed mid-round redoes that round from its last checkpoint (the clients upload again), so what a
killed round left there is stale: the server removes the ``spill`` folder when it starts
(:func:`clear_spill`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from geofm.errors import LayoutMismatchError

SPILL_FOLDER = "spill"
"""The folder of a run's spilled updates, under its output folder."""
BLOCK_BYTES = 64 << 20
"""The most bytes of one block of columns read back at a time (all clients together)."""


UPLOADS_FOLDER = "uploads"
"""The folder of a round's stored uploads, under the spill folder."""


class StoredArrays(Mapping[str, np.ndarray]):
    """One upload's arrays as ``.npy`` files, each taken as a fresh read-only memory map (its pages leave
    the server's memory with it); ``nbytes`` gives the sizes without reading the data."""

    def __init__(self, folder: Path, names: Sequence[str]) -> None:
        self.folder, self._names = folder, list(names)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return np.load(self.folder / f"{name}.npy", mmap_mode="r")

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class UploadStore:
    """A round's uploads kept on disk as they arrive (see the module docstring).

    Args:
        folder: where each upload gets a numbered folder of ``.npy`` files (the run's
            ``spill/uploads``).
    """

    def __init__(self, folder: Path) -> None:
        self.folder, self._count = folder, 0

    def keep(self, arrays: Mapping[str, np.ndarray]) -> StoredArrays:
        """Write an upload's arrays and return their handle; the caller drops the arrays themselves."""
        folder = self.folder / f"{self._count:06d}"
        self._count += 1
        folder.mkdir(parents=True)
        for name, array in arrays.items():
            np.save(folder / f"{name}.npy", np.asarray(array), allow_pickle=False)
        return StoredArrays(folder, list(arrays))

    def clear(self) -> None:
        """Remove the round's stored uploads (their handles must no longer be used)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self._count = 0


def clear_spill(run_dir: Path) -> None:
    """Remove what a killed round left in ``run_dir``'s spill folder (see the module docstring)."""
    shutil.rmtree(run_dir / SPILL_FOLDER, ignore_errors=True)


class SpilledUpdates:
    """Equally long update vectors in a file, read back by blocks of columns; a context manager that
    removes the file on exit.

    Args:
        updates: the vectors (float tensors, 1-D, one length); each is taken once, in order, and
            written before the next is taken, so a lazily decoded sequence holds one at a time.
        folder: where the temporary folder of the file goes; None: the system's temporary folder.
        block_bytes: the most bytes of one block (all rows); None: :data:`BLOCK_BYTES`.

    Raises:
        LayoutMismatchError: if the vectors differ in shape or are not 1-D.
    """

    def __init__(self, updates: Sequence[Tensor], folder: Path | None = None, block_bytes: int | None = None) -> None:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self._folder = tempfile.TemporaryDirectory(prefix="round-", dir=folder)
        self.rows, self.columns, self.width = len(updates), 0, 1
        self.path = Path(self._folder.name) / "updates.f32"
        try:
            self._write(updates, block_bytes or BLOCK_BYTES)
        except BaseException:
            self._folder.cleanup()
            raise

    def _write(self, updates: Sequence[Tensor], block_bytes: int) -> None:
        with self.path.open("wb") as file:
            for row, update in enumerate(updates):
                if update.dim() != 1 or (row and update.numel() != self.columns):
                    raise LayoutMismatchError(
                        f"expected 1-D updates of {self.columns or update.numel()} values, got shape {tuple(update.shape)}"
                    )
                if not row:
                    self.columns = update.numel()
                    self.width = max(1, min(self.columns, block_bytes // (4 * self.rows)))
                values = update.detach().to(torch.float32).cpu().numpy()
                for start in range(0, self.columns, self.width):
                    stop = min(start + self.width, self.columns)
                    # Block b holds rows x width values from offset rows * start: row r's part at r * (stop - start).
                    offset = 4 * (self.rows * start + row * (stop - start))
                    os.pwrite(file.fileno(), values[start:stop].tobytes(), offset)

    def blocks(self) -> Iterator[tuple[slice, Tensor]]:
        """(columns, the rows' values there as a rows x columns float32 tensor), block after block."""
        for start in range(0, self.columns, self.width):
            stop = min(start + self.width, self.columns)
            values = np.fromfile(self.path, np.float32, self.rows * (stop - start), offset=4 * self.rows * start)
            yield slice(start, stop), torch.from_numpy(values).view(self.rows, stop - start)

    def __enter__(self) -> SpilledUpdates:
        return self

    def __exit__(self, *exc: object) -> None:
        self._folder.cleanup()


__all__ = [
    "BLOCK_BYTES",
    "SPILL_FOLDER",
    "UPLOADS_FOLDER",
    "SpilledUpdates",
    "StoredArrays",
    "UploadStore",
    "clear_spill",
]
