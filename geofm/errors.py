"""Typed errors. Each names the file or field at fault and what was expected."""

from __future__ import annotations


class GeoFMError(Exception):
    """Base class of every error geofm raises on purpose.

    A DataLoader worker's error reaches the main process rebuilt from one string, the worker's
    whole traceback ("Caught ... in DataLoader worker process 0. Original Traceback ..."). Such an
    error keeps only its own message, the last line of that traceback, and the traceback in
    :attr:`worker_traceback` (shown with ``geofm --verbose``).
    """

    def __init__(self, *args: object) -> None:
        self.worker_traceback: str | None = None
        if len(args) == 1 and isinstance(args[0], str):
            message = _worker_message(type(self), args[0])
            if message is not None:
                self.worker_traceback, args = args[0], (message,)
        super().__init__(*args)


def _worker_message(cls: type, text: str) -> str | None:
    """The original message inside a DataLoader worker's wrapped traceback, or None if ``text`` is not one."""
    first_line = text.partition("\n")[0]
    if not (first_line.startswith(f"Caught {cls.__name__} ") and "DataLoader worker" in first_line):
        return None
    marker = f"{cls.__module__}.{cls.__qualname__}: "
    at = text.rfind(marker)
    return text[at + len(marker) :].strip() if at >= 0 else None


class ConfigError(GeoFMError, ValueError):
    """A configuration file or override is invalid: unknown key, wrong type, impossible combination."""


class RasterReadError(GeoFMError, OSError):
    """An image file could not be read, or holds other bands/dtype than its source declares."""

    def __init__(self, path: object, reason: str | None = None) -> None:
        # With one argument it is a finished message: DataLoader workers re-raise errors that way.
        self.path = str(path) if reason is not None else None
        self.reason = reason
        super().__init__(f"{self.path}: {reason}" if reason is not None else str(path))


class InvalidChipError(GeoFMError):
    """A sample's quality band marks more of its pixels unusable (cloud, fill...) than its source accepts.

    The pretraining pile passes over such a sample to the next, and counts it.
    """

    def __init__(
        self,
        path: object,
        window: tuple[int, int, int, int] | None = None,
        fraction: float | None = None,
        limit: float | None = None,
    ) -> None:
        # With one argument it is a finished message: DataLoader workers re-raise errors that way.
        self.path = str(path) if fraction is not None else None
        self.window, self.fraction, self.limit = window, fraction, limit
        if fraction is None:
            super().__init__(str(path))
            return
        where = f" window (row, col, height, width) {window}" if window is not None else ""
        super().__init__(
            f"{path}{where}: {fraction:.0%} of the pixels are invalid by its quality band "
            f"(quality.max_invalid_fraction {limit})"
        )


class DatasetNotFoundError(GeoFMError, FileNotFoundError):
    """A data source points at a folder that is missing or holds no matching image."""


class DatasetTooSmallError(GeoFMError, ValueError):
    """A split or a pretraining pile holds no sample, or fewer samples than one global batch."""


class DataMismatchError(GeoFMError, ValueError):
    """Files of one sample do not fit together or with the config.

    A mask of another size than its image, class ids outside the configured classes, before/after
    images on different grids, a super-resolution pair off the scale factor, a file without its
    partner, a dataset delivering other bands than declared.
    """


class OutputPathError(GeoFMError, OSError):
    """A path a command would write is below a file, of the wrong kind (file or folder) or not writable."""


class CheckpointNotFoundError(GeoFMError, FileNotFoundError):
    """A weights file named in a config is missing."""


class CheckpointFormatError(GeoFMError, ValueError):
    """A checkpoint's layout is not one geofm knows, or it is unsafe to load."""


class LossNotFiniteError(GeoFMError, FloatingPointError):
    """The training loss became NaN or infinite (learning rate too high, bad input); earlier checkpoints are intact."""


class RunInterrupted(GeoFMError):
    """A run stopped on request (SIGINT/SIGTERM) after checkpointing the step it reached."""


class LayoutMismatchError(GeoFMError, ValueError):
    """A parameter vector, tensor list or module does not match the expected parameter layout."""


class CodecError(GeoFMError, ValueError):
    """An encoded model update or a client's stored codec state is malformed, or an update to encode holds NaN or Inf."""


class FederatedRunError(GeoFMError, RuntimeError):
    """A federated run cannot go on: too few nodes connected or replied, or a program broke the runtime contract."""


class MissingDependencyError(GeoFMError, ImportError):
    """A command needs an optional package that is not installed; the message names the extra to install."""


class ExportError(GeoFMError, RuntimeError):
    """A model could not be written in a portable format (an operator the exporter cannot translate)."""
