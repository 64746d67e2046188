"""Reading checkpoint files safely: safetensors, or torch pickles restricted to tensors and containers.

Torch files are read with ``torch.load(weights_only=True)``. Released SimMIM/GFM checkpoints also
pickle their yacs ``CfgNode`` under ``config``, which the weights-only loader refuses; for those,
the load is retried with a short list of tolerated data-only classes allow-listed through
``torch.serialization.safe_globals``. Each tolerated class is replaced by a stand-in that only
builds a dict (its module is never imported, none of its code runs) and comes back as a plain
``dict``. Any other global (a function such as ``os.system``, an arbitrary class) is refused with
:class:`~geofm.errors.CheckpointFormatError`; nothing named in the file is imported or called
(zip-format files are scanned for globals before unpickling, legacy files are stopped at the first
refused global by the weights-only unpickler).
"""

from __future__ import annotations

import pickle
import re
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors

from geofm.errors import CheckpointFormatError, CheckpointNotFoundError

TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
SAFETENSORS_SUFFIX = ".safetensors"
EXPORT_WEIGHTS = "backbone.safetensors"
DEEPSPEED_MODEL_STATES = "mp_rank_00_model_states.pt"
LAST_CHECKPOINT = "last"  # a training run's pointer to its newest checkpoint tag

# Data-only classes tolerated in torch pickles, and which part of each object is kept:
# "items" keeps the mapping entries (a yacs CfgNode is a dict subclass; its bookkeeping
# attributes are dropped), "attributes" keeps the instance attributes (a dataclass record).
TOLERATED_GLOBALS: dict[str, str] = {
    "yacs.config.CfgNode": "items",
    # DeepSpeed's bf16 optimiser state records parameter slices with this dataclass.
    "deepspeed.utils.tensor_fragment.fragment_address": "attributes",
}


def resolve_checkpoint_path(path: str | Path) -> Path:
    """The weights file behind ``path``: the file itself, or the known file inside a folder.

    A folder may be a geofm export (holding ``backbone.safetensors``), a training run directory
    (its ``checkpoints/last``), a run's ``checkpoints`` folder (its ``last``), or one DeepSpeed
    checkpoint tag folder holding ``mp_rank_00_model_states.pt``.

    Raises:
        CheckpointNotFoundError: if nothing is there, or a folder holds none of these files.
    """
    path = Path(path).expanduser()
    if path.is_file():
        return path
    if not path.exists():
        raise CheckpointNotFoundError(
            f"checkpoint not found: {path.resolve()}. Pretrained weights are not downloaded by geofm: "
            "download them separately and place the file at this path (or point the config at it)."
        )
    candidates = [
        path / EXPORT_WEIGHTS,
        path / DEEPSPEED_MODEL_STATES,
        path / LAST_CHECKPOINT / DEEPSPEED_MODEL_STATES,
        path / "checkpoints" / LAST_CHECKPOINT / DEEPSPEED_MODEL_STATES,
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise CheckpointNotFoundError(
        f"no checkpoint file in folder {path}: expected {EXPORT_WEIGHTS}, {DEEPSPEED_MODEL_STATES}, "
        f"or a '{LAST_CHECKPOINT}' checkpoint (directly or under checkpoints/) holding {DEEPSPEED_MODEL_STATES}"
    )


def load_checkpoint_file(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint file onto the CPU without running code from it.

    Args:
        path: a ``.safetensors`` file, a torch file (``.pth``, ``.pt``, ``.bin``, ``.ckpt``), or a
            folder understood by :func:`resolve_checkpoint_path`.

    Returns:
        The top-level mapping stored in the file (for safetensors: name to tensor).

    Raises:
        CheckpointNotFoundError: if the file does not exist.
        CheckpointFormatError: on an unknown suffix, a corrupt file, a file that does not hold a
            mapping, or a pickle referring to globals that are neither weights-only safe nor tolerated.
    """
    path = resolve_checkpoint_path(path)
    suffix = path.suffix.lower()
    if suffix == SAFETENSORS_SUFFIX:
        try:
            obj: Any = load_safetensors(str(path), device="cpu")
        except Exception as err:  # safetensors raises its own untyped errors on corrupt headers
            raise CheckpointFormatError(f"{path}: not a readable safetensors file ({err})") from err
    elif suffix in TORCH_SUFFIXES:
        obj = _load_torch(path)
    else:
        raise CheckpointFormatError(
            f"{path}: unknown checkpoint suffix {path.suffix!r}; expected {SAFETENSORS_SUFFIX} or one of "
            f"{', '.join(TORCH_SUFFIXES)}"
        )
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{path}: holds a {type(obj).__name__}, expected a mapping of names to tensors")
    return obj


def _load_torch(path: Path) -> Any:
    created: dict[int, str] = {}
    stand_ins = [(_stand_in(name, created), name) for name in TOLERATED_GLOBALS]
    obj = _weights_only_load(path, "cpu", stand_ins, TOLERATED_GLOBALS)
    return _materialise(obj, created) if created else obj


def load_training_file(path: str | Path, map_location: Any, records: dict[str, type]) -> Any:
    """Load one file of a training checkpoint for resuming, by the same rules as :func:`load_checkpoint_file`.

    Weights-only unpickling, plus the data records DeepSpeed writes into its optimizer-state files
    (``records``: dotted name to the real class, needed to resume). Nothing else is unpickled.

    Raises:
        CheckpointFormatError: naming the file and what was refused; nothing from it was run.
    """
    return _weights_only_load(Path(path), map_location, list(records.values()), records)


def _weights_only_load(path: Path, map_location: Any, allowed: list, allowed_names: Any) -> Any:
    """``torch.load(weights_only=True)``, retried with ``allowed`` globals when the file refers to them.

    The globals of zip-format files are scanned before the retry, and any global outside
    ``allowed_names`` is refused without unpickling anything.
    """
    _check_torch_container(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError:
            pass  # refers to globals beyond the weights-only allow-list: scan them, then retry
        except Exception as err:
            raise CheckpointFormatError(f"{path}: not a readable torch checkpoint ({err})") from err

        refused = sorted(set(_unsafe_globals(path)) - set(allowed_names))
        if refused:
            raise CheckpointFormatError(_refusal(path, refused, allowed_names))
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointFormatError(_refusal(path, [_offending(err)], allowed_names)) from err


# Legacy torch files are a pickle (protocol 2 or higher starts with 0x80); newer ones a zip archive.
_PICKLE_PROTOCOL = b"\x80"


def _check_torch_container(path: Path) -> None:
    """Refuse a file that is neither a zip archive nor a pickle before handing it to ``torch.load``."""
    with path.open("rb") as f:
        head = f.read(4)
    if not head.startswith(_PICKLE_PROTOCOL) and not zipfile.is_zipfile(path):
        raise CheckpointFormatError(
            f"{path}: not a torch checkpoint (neither a zip archive nor a pickle; it starts with bytes {head.hex()})"
        )


def _unsafe_globals(path: Path) -> list[str]:
    """Globals a zip-format torch file refers to beyond the weights-only allow-list (static scan)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # legacy (non-zip) files cannot be scanned; the restricted load still guards them
        return []


def _refusal(path: Path, offending: list[str], allowed_names: Any) -> str:
    return (
        f"{path}: refused to unpickle {', '.join(offending)}: torch checkpoints may hold only tensors, "
        f"plain containers and the data classes {', '.join(allowed_names)}. Nothing from the file was run."
    )


def _offending(err: Exception) -> str:
    """What torch's refusal message names: the global, an unsupported instruction, or its last line."""
    text = str(err)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return found.group(1)
    found = re.search(r"Unsupported operand (\d+)", text)
    if found:
        return f"a pickle instruction the weights-only loader does not read (opcode {found.group(1)})"
    lines = [
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("Check the documentation")
    ]
    return lines[-1] if lines else "an unsupported object"


def _stand_in(name: str, created: dict[int, str]) -> type:
    """A class allow-listed under ``name`` whose construction yields an ``OrderedDict``.

    The weights-only unpickler fills only exact dict types with items and sets attributes through
    ``__dict__`` on ``OrderedDict``, so an ``OrderedDict`` receives both the entries and the
    attributes of the pickled object; ``created`` remembers which objects to materialise.
    """

    def __new__(cls, *args: Any) -> OrderedDict:
        node: OrderedDict = OrderedDict()
        created[id(node)] = TOLERATED_GLOBALS[name]
        return node

    return type(name.rpartition(".")[2], (), {"__new__": __new__, "__module__": __name__})


def _materialise(obj: Any, created: dict[int, str]) -> Any:
    """Replace stand-in objects by plain dicts, recursively through containers."""
    if isinstance(obj, dict):
        keep = created.get(id(obj))
        source = vars(obj) if keep == "attributes" else obj
        items = {k: _materialise(v, created) for k, v in source.items()}
        if keep is not None:
            return items
        obj.update(items)  # an ordinary mapping (e.g. a state dict) keeps its type and metadata
        return obj
    if type(obj) is list:
        return [_materialise(v, created) for v in obj]
    if type(obj) is tuple:
        return tuple(_materialise(v, created) for v in obj)
    return obj
