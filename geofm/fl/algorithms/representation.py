"""Where algorithms that act on features (MOON, FedAlign, FedU², FedMKD) read a model: its representation
network (``backbone`` or ``encoder``), that network's final stage, and the pooled features of each of its calls
(:class:`Capture`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from geofm.errors import ConfigError
from geofm.fl.algorithms.rounds import LocalRound

REPRESENTATION_MODULES = ("backbone", "encoder")


def representation_module(module: nn.Module, algorithm: str) -> tuple[str, nn.Module]:
    """The name and module of a model's representation network: its ``backbone`` or ``encoder``.

    Raises:
        ConfigError: the model has neither (the message names ``algorithm``).
    """
    for name in REPRESENTATION_MODULES:
        found = getattr(module, name, None)
        if isinstance(found, nn.Module):
            return name, found
    raise ConfigError(
        f"algorithm {algorithm} reads the representation of a model's backbone or encoder; "
        f"{type(module).__name__} has no module named {' or '.join(REPRESENTATION_MODULES)}"
    )


def final_stage(backbone: nn.Module, algorithm: str) -> nn.Module:
    """The backbone's final stage as a module every forward path calls: a Swin's last stage's blocks
    (``layers[-1].blocks``, (B, H, W, C) in and out), or a ViT's last block (a ViT has no stages;
    (B, N, C) in and out).

    The blocks rather than the stage: GFM's tap after the last stage's patch merging runs the
    stage's merging and blocks apart, never the stage as a module.

    Raises:
        ConfigError: the backbone has neither (the message names ``algorithm``).
    """
    stages = getattr(backbone, "layers", None)
    if isinstance(stages, nn.Sequential) and len(stages) and isinstance(getattr(stages[-1], "blocks", None), nn.Module):
        return stages[-1].blocks
    blocks = getattr(backbone, "blocks", None)
    if isinstance(blocks, nn.Sequential) and len(blocks):
        return blocks[-1]
    raise ConfigError(
        f"algorithm {algorithm} reads the final stage of a Swin's layers[-1].blocks or a ViT's blocks; "
        f"{type(backbone).__name__} has neither"
    )


def pooled(features: Tensor, prefix_tokens: int = 0) -> Tensor:
    """One float32 vector per sample: the mean over a Swin stage's (B, H, W, C) positions or over a
    ViT's (B, N, C) patch tokens (the first ``prefix_tokens``, class and register tokens, left out)."""
    if features.ndim == 4:
        return features.float().mean((1, 2))
    return features[:, prefix_tokens:].float().mean(1)


@dataclass(eq=False)
class Capture:
    """Hooks on a model's representation network that keep, for each of its calls in a forward (DINO's
    global and local views are two calls), its input images and its final stage's output; a forward
    pre-hook on ``patch_embed`` and a forward hook on :func:`final_stage`, the parts every forward path runs.
    A copy of the network taken after :meth:`attach` carries the hooks: copy it before.

    Attributes:
        prefix: the network's name in the model (``backbone`` or ``encoder``).
        network: the network.
        prefix_tokens: a ViT's class and register tokens, left out of the pooling.
    """

    prefix: str
    network: nn.Module
    prefix_tokens: int = 0
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    handles: list[RemovableHandle] = field(default_factory=list)

    @classmethod
    def attach(cls, module: nn.Module, algorithm: str) -> Capture:
        """Hook the representation network of ``module`` (errors name ``algorithm``)."""
        prefix, network = representation_module(module, algorithm)
        capture = cls(prefix, network, int(getattr(network, "num_prefix_tokens", 0)))

        def take_output(_module, _args, output) -> None:
            if len(capture.outputs) < len(capture.inputs):  # one output per network input, none without one
                capture.outputs.append(output)

        capture.handles = [
            network.patch_embed.register_forward_pre_hook(lambda _, args: capture.inputs.append(args[0])),
            final_stage(network, algorithm).register_forward_hook(take_output),
        ]
        return capture

    def take(self, algorithm: str) -> list[tuple[Tensor, Tensor]]:
        """The (input images, pooled final-stage features) of each call since the last take.

        Raises:
            RuntimeError: a call did not reach the final stage, or the forward made none.
        """
        if not self.inputs or len(self.inputs) != len(self.outputs):
            raise RuntimeError(
                f"{algorithm} needs the {self.prefix} run to its final stage in every forward; this one gave "
                f"{len(self.inputs)} inputs and {len(self.outputs)} final-stage outputs"
            )
        taken = [
            (images, pooled(out, self.prefix_tokens)) for images, out in zip(self.inputs, self.outputs, strict=True)
        ]
        self.inputs.clear()
        self.outputs.clear()
        return taken

    def remove(self) -> None:
        """Remove the hooks and drop what they kept."""
        for handle in self.handles:
            handle.remove()
        for kept in (self.handles, self.inputs, self.outputs):
            kept.clear()


@dataclass(eq=False)
class CapturingRound(LocalRound):
    """A local round whose representation network's calls are captured until the round ends."""

    capture: Capture | None = None


__all__ = ["REPRESENTATION_MODULES", "Capture", "CapturingRound", "final_stage", "pooled", "representation_module"]
