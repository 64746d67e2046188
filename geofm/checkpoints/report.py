"""What happened to each tensor of a checkpoint loaded into a backbone, and a compact listing of keys."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

_BLOCK_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")  # the 0 and 1 of "layers.0.blocks.1.attn"


@dataclass
class LoadReport:
    """What happened to each tensor when a checkpoint was turned into backbone weights.

    Attributes:
        layout: the detected layout (see :data:`~geofm.checkpoints.layouts.CHECKPOINT_LAYOUTS`).
        used: model keys that receive weights from the checkpoint.
        dropped: checkpoint keys left out on purpose (other modules, classifier, buffers, mask token).
        missing: model keys the checkpoint does not provide.
        unexpected: converted keys the model does not have.
        adapted: notes on tensors that were changed to fit the model.
        path: the file the weights came from, when loaded from a file.
        fresh_bands: model bands the checkpoint has no kernel for (matched by name), left at their
            fresh initialisation.
    """

    layout: str
    used: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    adapted: list[str] = field(default_factory=list)
    path: str | None = None
    fresh_bands: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        source = f" from {self.path}" if self.path else ""
        lines = [f"{self.layout} checkpoint{source}: {len(self.used)} tensors loaded"]
        for name in ("dropped", "missing", "unexpected"):
            keys = getattr(self, name)
            if keys:
                lines.append(f"  {name} {len(keys)}: {summarise_keys(keys)}")
        notes: dict[str, int] = defaultdict(int)
        for note in self.adapted:  # one line for the same change in every block
            notes[_BLOCK_INDEX.sub("*", note)] += 1
        lines += [f"  adapted {note}" + (f" (x{n})" if n > 1 else "") for note, n in notes.items()]
        if self.fresh_bands:
            lines.append(f"  fresh bands (not in the checkpoint, newly initialised): {', '.join(self.fresh_bands)}")
        return "\n".join(lines)


def summarise_keys(keys: Sequence[str], per_prefix: int = 4) -> str:
    """Compact listing: block indices become ``*``; a prefix with many patterns becomes ``prefix.*``."""
    patterns: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        patterns[_BLOCK_INDEX.sub("*", key)].append(key)
    by_prefix: dict[str, list[str]] = defaultdict(list)
    for pattern in patterns:
        by_prefix[pattern.split(".", 1)[0]].append(pattern)
    parts = []
    for prefix, group in by_prefix.items():
        if len(group) > per_prefix:
            parts.append(f"{prefix}.* ({sum(len(patterns[p]) for p in group)})")
        else:
            parts += [patterns[p][0] if len(patterns[p]) == 1 else f"{p} ({len(patterns[p])})" for p in group]
    return ", ".join(parts)
