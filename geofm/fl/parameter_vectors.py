"""The trainable parameters of a module as one flat float32 vector, and back."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from geofm.errors import LayoutMismatchError


@dataclass(frozen=True)
class ParameterLayout:
    """An ordered set of named tensors: the trainable parameters of a module.

    The flat vector of a layout concatenates its tensors in order, each flattened row-major and
    cast to float32, whatever the parameters' own dtype.

    Attributes:
        names: parameter names as :meth:`torch.nn.Module.named_parameters` gives them.
        shapes: the shape of each parameter.
        dtypes: the dtype of each parameter.
        part: the layout holds some of a module's trainable parameters only (:meth:`select`).
        norms: ``(name, kind)`` of each parameter that belongs to a normalisation module, in layout
            order; ``kind`` is one of :data:`NORM_KINDS` (:meth:`of` fills it; see :func:`norm_kind`).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    part: bool = False
    norms: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.shapes) == len(self.dtypes):
            raise LayoutMismatchError(
                f"a layout needs one shape and one dtype per name: got {len(self.names)} names, "
                f"{len(self.shapes)} shapes and {len(self.dtypes)} dtypes"
            )

    @classmethod
    def of(cls, module: nn.Module) -> ParameterLayout:
        """The layout of a module's parameters that require gradients, in registration order, with the
        kind of normalisation module each normalisation parameter belongs to."""
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        kinds = {
            f"{prefix}.{name}" if prefix else name: kind
            for prefix, m in module.named_modules()
            if (kind := norm_kind(m)) is not None
            for name, _ in m.named_parameters(recurse=False)
        }
        return cls(
            names=tuple(name for name, _ in named),
            shapes=tuple(tuple(p.shape) for _, p in named),
            dtypes=tuple(p.dtype for _, p in named),
            norms=tuple((name, kinds[name]) for name, _ in named if name in kinds),
        )

    @classmethod
    def vector(cls, n: int) -> ParameterLayout:
        """The layout of one float32 vector of ``n`` values, for callers that hold no module."""
        return cls(names=("vector",), shapes=((n,),), dtypes=(torch.float32,))

    def select(self, keep: Callable[[str], bool]) -> ParameterLayout:
        """The part of the layout whose names ``keep`` accepts, in the same order."""
        kept = [i for i, name in enumerate(self.names) if keep(name)]
        return ParameterLayout(
            names=tuple(self.names[i] for i in kept),
            shapes=tuple(self.shapes[i] for i in kept),
            dtypes=tuple(self.dtypes[i] for i in kept),
            part=True,
            norms=tuple((name, kind) for name, kind in self.norms if keep(name)),
        )

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of values of each tensor."""
        return tuple(torch.Size(shape).numel() for shape in self.shapes)

    @property
    def numel(self) -> int:
        """Length of the flat vector."""
        return sum(self.sizes)

    def parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """The module's trainable parameters in layout order.

        Raises:
            LayoutMismatchError: if the module's trainable parameters differ from the layout in
                name, order or shape.
        """
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if self.part:
            wanted = set(self.names)
            named = [(name, p) for name, p in named if name in wanted]
        names = tuple(name for name, _ in named)
        if names != self.names:
            missing = sorted(set(self.names) - set(names))
            extra = sorted(set(names) - set(self.names))
            raise LayoutMismatchError(
                f"module's trainable parameters do not match the layout: missing {missing[:5]}, "
                f"unexpected {extra[:5]}" + (" (same names, other order)" if not missing and not extra else "")
            )
        params = [p for _, p in named]
        self.check_tensors(params)
        return params

    def check_tensors(self, tensors: Sequence[Tensor]) -> None:
        """Check that a list of tensors has the layout's count and shapes.

        Raises:
            LayoutMismatchError: naming the first tensor whose shape differs, or both counts.
        """
        if len(tensors) != len(self.names):
            raise LayoutMismatchError(f"expected {len(self.names)} tensors for the layout, got {len(tensors)}")
        for name, shape, tensor in zip(self.names, self.shapes, tensors, strict=True):
            if tuple(tensor.shape) != shape:
                raise LayoutMismatchError(f"tensor {name!r} has shape {tuple(tensor.shape)}, layout expects {shape}")

    def check_vector(self, vector: Tensor) -> None:
        """Check that a vector is one-dimensional and as long as the layout.

        Raises:
            LayoutMismatchError: naming the expected and the actual length (or shape).
        """
        if vector.dim() != 1:
            raise LayoutMismatchError(f"expected a 1-D vector of {self.numel} values, got shape {tuple(vector.shape)}")
        if vector.numel() != self.numel:
            raise LayoutMismatchError(
                f"vector has {vector.numel()} values, the layout of {len(self.names)} tensors expects {self.numel}"
            )

    def _ordered(self, tensors: Sequence[Tensor] | Mapping[str, Tensor]) -> list[Tensor]:
        """The tensors in layout order, from a list or from a name -> tensor mapping."""
        if isinstance(tensors, Mapping):
            missing = [name for name in self.names if name not in tensors]
            extra = sorted(set(tensors) - set(self.names))
            if missing or extra:
                raise LayoutMismatchError(
                    f"tensors do not match the layout: missing {missing[:5]}, unexpected {extra[:5]}"
                )
            tensors = [tensors[name] for name in self.names]
        self.check_tensors(tensors)
        return list(tensors)

    def flatten(self, tensors: Sequence[Tensor] | Mapping[str, Tensor]) -> Tensor:
        """Concatenate tensors into a new float32 vector on the first tensor's device.

        Args:
            tensors: one tensor per layout entry, in order, or a mapping from layout names.

        Returns:
            A detached float32 vector of length :attr:`numel`.

        Raises:
            LayoutMismatchError: if the tensors' count, names or shapes differ from the layout.
        """
        ordered = self._ordered(tensors)
        device = ordered[0].device if ordered else torch.device("cpu")
        vector = torch.empty(self.numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for piece, tensor in zip(self.split(vector), ordered, strict=True):
                piece.copy_(tensor)
        return vector

    def flatten_module(self, module: nn.Module) -> Tensor:
        """The module's trainable parameters as a new float32 vector (see :meth:`flatten`)."""
        return self.flatten(self.parameters(module))

    def split(self, vector: Tensor) -> list[Tensor]:
        """Views of a vector, one per layout entry and shaped like it, in the vector's dtype.

        Raises:
            LayoutMismatchError: if the vector's length differs from :attr:`numel`.
        """
        self.check_vector(vector)
        pieces = torch.split(vector, list(self.sizes))
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes, strict=True)]

    def unflatten(self, vector: Tensor) -> dict[str, Tensor]:
        """A name -> tensor mapping of a vector, in the layout's dtypes.

        Entries whose dtype is the vector's are views of it; the others are cast copies. The
        mapping suits :func:`torch.func.functional_call` and ``load_state_dict(strict=False)``.

        Raises:
            LayoutMismatchError: if the vector's length differs from :attr:`numel`.
        """
        return {
            name: piece.to(dtype)
            for name, piece, dtype in zip(self.names, self.split(vector), self.dtypes, strict=True)
        }

    def assign(self, module: nn.Module, vector: Tensor) -> None:
        """Copy a vector into the module's trainable parameters in place (cast to their dtypes).

        Raises:
            LayoutMismatchError: if the module or the vector does not match the layout.
        """
        params = self.parameters(module)
        with torch.no_grad():
            for param, piece in zip(params, self.split(vector), strict=True):
                param.copy_(piece)


NORM_KINDS = ("batchnorm", "layernorm", "groupnorm")
"""The kinds of normalisation module a :class:`ParameterLayout` tells apart."""


def norm_kind(module: nn.Module) -> str | None:
    """The kind of normalisation ``module`` is (one of :data:`NORM_KINDS`, subclasses such as timm's
    ``LayerNorm2d`` or ``BatchNormAct2d`` included), or None for any other module."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batchnorm"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    if isinstance(module, nn.GroupNorm):
        return "groupnorm"
    return None


RUNNING_STATISTICS = "running_statistics"
"""The key under which batch-norm running statistics travel beside an algorithm's payloads."""


def _running_buffers(module: nn.Module) -> list[Tensor]:
    return [
        getattr(m, key)
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        for key in ("running_mean", "running_var")
    ]


def running_statistics(module: nn.Module) -> np.ndarray | None:
    """The running means and variances of a module's batch-norm layers as one float32 vector, or None
    without any (Swin and ViT backbones have none; UperNet heads do).

    They are buffers, not parameters: no algorithm trains them, yet a model evaluated without its
    clients' statistics normalises with its initial ones. The federated runtime therefore averages
    them by example count beside the algorithm's payloads, uncompressed.
    """
    buffers = _running_buffers(module)
    if not buffers:
        return None
    return torch.cat([b.detach().float().reshape(-1).cpu() for b in buffers]).numpy()


def load_running_statistics(module: nn.Module, vector: np.ndarray) -> None:
    """Copy a :func:`running_statistics` vector into the module's batch-norm buffers.

    Raises:
        LayoutMismatchError: the vector's length is not the module's.
    """
    buffers = _running_buffers(module)
    sizes = [b.numel() for b in buffers]
    if vector.ndim != 1 or vector.size != sum(sizes):
        raise LayoutMismatchError(f"{vector.size} running statistics for a module holding {sum(sizes)}")
    pieces = torch.split(torch.from_numpy(np.ascontiguousarray(vector, dtype=np.float32)), sizes)
    with torch.no_grad():
        for buffer, piece in zip(buffers, pieces, strict=True):
            buffer.copy_(piece.view(buffer.shape))
