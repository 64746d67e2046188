"""A benchmark's work folder that keeps its finished parts, so that a rerun skips them (long runs resume in parts).

Everything a run writes goes below ``<work_dir>/<fingerprint>``, the fingerprint a hash of the settings
that shape a part's figures: a rerun with other such settings starts afresh next to it, a rerun that
only adds seeds, arms or settings (the ``growing`` keys) finds the parts it already has. A part is one
JSON file, written when it is finished.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def work_folder(work_dir: str | Path, settings: Mapping[str, Any], growing: Iterable[str]) -> Path:
    """``work_dir``'s folder for ``settings``, less the ``growing`` keys (and ``work_dir`` itself)."""
    shaping = {k: v for k, v in settings.items() if k not in {*growing, "work_dir"}}
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return Path(work_dir) / digest


class Parts:
    """Finished parts under ``folder / "parts"``, each a JSON mapping named by its key."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder / "parts"

    def get(self, key: str) -> dict[str, Any] | None:
        """The part ``key`` (None until it is put)."""
        path = self.folder / f"{key}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def put(self, key: str, part: dict[str, Any]) -> dict[str, Any]:
        """Keep ``part`` as ``key`` (written whole, then renamed: a stopped run leaves no half part)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{key}.json"
        path.with_suffix(".tmp").write_text(json.dumps(part))
        path.with_suffix(".tmp").replace(path)
        return part
