"""Error feedback for compressed uploads: what quantisation dropped is sent in later rounds.

Each round a client with local update ``delta`` and residual ``e`` uploads ``Q = quantise(G)``
with ``G = delta + e``, then keeps ``e <- alpha * e + (1 - alpha) * (G - dequantise(Q))``
(``alpha = 0``, the default, is classic error feedback ``e = G - dequantise(Q)``). The residual
is dropped (set to zero) every ``reset_every`` rounds, and whenever it has grown beyond
``guard_factor`` times the norm of the round's update, which would otherwise let a stale residual
dominate the upload. :meth:`ErrorFeedback.uplink` does all of this in the right order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from geofm.errors import CodecError, ConfigError, LayoutMismatchError
from geofm.fl.communication.codec import Codec, Packet

# Updates and residuals whose norms sum below this encode without overflow in float32 (squares stay
# below its maximum), so the residual can be rewritten chunk by chunk.
_IN_PLACE_BOUND = 1e18


@dataclass(eq=False)
class FeedbackState:
    """A client's error-feedback state, kept between rounds.

    Attributes:
        error: the residual ``e`` (float32), or None before the first upload (zero).
        rounds: number of uploads made so far.
    """

    error: Tensor | None = None
    rounds: int = 0

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The state as new numpy arrays: ``error`` (float32, empty when None) and ``rounds`` (int64, one value).

        The arrays are copies: later uploads, which update the residual in place, leave them alone.
        """
        if self.error is None:
            error = np.zeros(0, dtype=np.float32)
        else:
            error = self.error.detach().to("cpu", copy=True).numpy()
        return {"error": error, "rounds": np.array([self.rounds], dtype=np.int64)}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> FeedbackState:
        """Rebuild a state from :meth:`to_arrays` output.

        Raises:
            CodecError: if an array is missing or has the wrong dtype or shape, or the round
                count is negative.
        """
        if set(arrays) != {"error", "rounds"}:
            raise CodecError(f"error-feedback state arrays are {sorted(arrays)}; expected ['error', 'rounds']")
        error, rounds = arrays["error"], arrays["rounds"]
        if error.dtype != np.float32 or error.ndim != 1:
            raise CodecError(f"error-feedback residual is {error.dtype} {error.shape}; expected a 1-D float32 array")
        if rounds.dtype != np.int64 or rounds.shape != (1,) or rounds[0] < 0:
            raise CodecError(f"error-feedback round count is {rounds!r}; expected one non-negative int64")
        return cls(error=torch.from_numpy(error.copy()) if error.size else None, rounds=int(rounds[0]))


@dataclass(frozen=True)
class UplinkReport:
    """What one upload did, for the client's log.

    Attributes:
        round: index of this upload among the client's uploads (0 for the first).
        update_norm: L2 norm of the local update ``delta``.
        error_norm: L2 norm of the residual kept for the next round.
        periodic_reset: the residual was dropped because the reset period came round.
        guard_reset: the residual was dropped because its norm exceeded ``guard_factor`` times
            the update's norm.
        packet_bytes: size of the upload on the wire.
    """

    round: int
    update_norm: float
    error_norm: float
    periodic_reset: bool
    guard_reset: bool
    packet_bytes: int


@dataclass(frozen=True)
class ErrorFeedback:
    """The client side of a compressed upload with error feedback.

    Attributes:
        codec: the quantiser and packer of uploads.
        alpha: decay of the old residual, in [0, 1); 0 keeps only this round's quantisation error.
        reset_every: drop the residual before every ``reset_every``-th upload (uploads
            ``reset_every``, ``2 * reset_every``, ...); None or 0 never.
        guard_factor: drop the residual when its norm exceeds this multiple of the update's norm;
            None disables the guard.
    """

    codec: Codec
    alpha: float = 0.0
    reset_every: int | None = None
    guard_factor: float | None = 10.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha < 1.0:
            raise ConfigError(f"error-feedback alpha must lie in [0, 1), got {self.alpha}")
        if self.reset_every is not None and self.reset_every < 0:
            raise ConfigError(f"error-feedback reset_every must be >= 0 or None, got {self.reset_every}")
        if self.guard_factor is not None and self.guard_factor <= 0:
            raise ConfigError(f"error-feedback guard_factor must be positive or None, got {self.guard_factor}")

    def uplink(
        self, delta: Tensor, state: FeedbackState, generator: torch.Generator | None = None
    ) -> tuple[Packet, UplinkReport]:
        """Encode a local update with error feedback, updating ``state`` in place.

        The residual is updated chunk by chunk while the codec encodes ``G = delta + e`` (see
        :meth:`~geofm.fl.communication.codec.Codec.encode_chunks`): one pass over the update and the
        residual besides their norms, with no temporary vector of the update's size.

        Args:
            delta: the local update ``theta - Theta``, a 1-D float tensor on any device.
            state: the client's state from the previous round (fresh for the first); its
                residual is kept on ``delta``'s device.
            generator: random source of the codec's stochastic rounding, on ``delta``'s device.

        Returns:
            The packet to upload and a report of the round.

        Raises:
            LayoutMismatchError: if the stored residual's length differs from the update's.
            CodecError: if the update holds NaN or Inf; ``state`` is then left unchanged.
        """
        delta = delta.detach().to(torch.float32)
        error = state.error
        if error is not None and error.shape != delta.shape:
            raise LayoutMismatchError(
                f"stored error-feedback residual has {error.numel()} values, the update has {delta.numel()}"
            )
        if delta.dim() != 1 or delta.numel() == 0:
            raise CodecError(f"expected a non-empty 1-D update vector, got shape {tuple(delta.shape)}")
        update_norm = float(torch.linalg.vector_norm(delta))
        if not math.isfinite(update_norm):
            bad = int((~torch.isfinite(delta)).sum())
            if bad:
                raise CodecError(f"update holds {bad} NaN or Inf values out of {delta.numel()}")
        error = None if error is None else error.to(delta.device)
        periodic = bool(self.reset_every) and state.rounds > 0 and state.rounds % self.reset_every == 0
        old_norm = 0.0 if error is None else float(torch.linalg.vector_norm(error))
        guard = not periodic and self.guard_factor is not None and old_norm > self.guard_factor * update_norm
        kept = None if periodic or guard else error
        # Far inside float32's range no chunk can fail to encode, so the residual may be rewritten
        # in place as the chunks go; otherwise a failure must leave it untouched.
        in_place = error is not None and update_norm + old_norm < _IN_PLACE_BOUND
        new_error = error if in_place else torch.empty_like(delta)
        norms: list[Tensor] = []

        def values(start: int, stop: int, buffer: Tensor) -> Tensor:
            if kept is None:
                return delta[start:stop]
            return torch.add(delta[start:stop], kept[start:stop], out=buffer)

        def dropped(start: int, stop: int, g: Tensor, dequantised: Tensor) -> None:
            e = new_error[start:stop]
            if kept is None or self.alpha == 0.0:
                torch.sub(g, dequantised, out=e)  # G - deq(Q)
                if self.alpha:
                    e.mul_(1.0 - self.alpha)
            else:
                lost = torch.sub(g, dequantised, out=dequantised)
                if not in_place:
                    e.copy_(kept[start:stop])
                e.mul_(self.alpha).add_(lost, alpha=1.0 - self.alpha)
            norms.append(torch.linalg.vector_norm(e))

        packet = self.codec.encode_chunks(delta.numel(), values, generator, dropped, delta.device)
        report = UplinkReport(
            round=state.rounds,
            update_norm=update_norm,
            error_norm=float(torch.linalg.vector_norm(torch.stack(norms))),
            periodic_reset=periodic,
            guard_reset=guard,
            packet_bytes=packet.nbytes,
        )
        state.error, state.rounds = new_error, state.rounds + 1
        return packet, report
