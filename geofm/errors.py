"""Typed errors. Each names the file or field at fault and what was expected."""


class GeoFMError(Exception):
    """Base class of every error geofm raises on purpose."""


class ConfigError(GeoFMError, ValueError):
    """A configuration file or override is invalid: unknown key, wrong type, impossible combination."""


class RasterReadError(GeoFMError, OSError):
    """An image file could not be read, or holds other bands/dtype than its source declares."""

    def __init__(self, path, reason: str | None = None) -> None:
        # With one argument it is a finished message: DataLoader workers re-raise errors that way.
        self.path = str(path) if reason is not None else None
        self.reason = reason
        super().__init__(f"{self.path}: {reason}" if reason is not None else str(path))


class DatasetNotFoundError(GeoFMError, FileNotFoundError):
    """A data source points at a folder that is missing or holds no matching image."""


class CheckpointNotFoundError(GeoFMError, FileNotFoundError):
    """A weights file named in a config is missing."""


class CheckpointFormatError(GeoFMError, ValueError):
    """A checkpoint's layout is not one geofm knows, or it is unsafe to load."""


class RunInterrupted(GeoFMError):
    """A run stopped on request (SIGINT/SIGTERM) after checkpointing the step it reached."""


class FederatedRunError(GeoFMError, RuntimeError):
    """A federated run cannot go on: too few nodes connected or replied, or a program broke the runtime contract."""
