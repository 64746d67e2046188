"""Dense packing of 1, 2 and 4-bit codes into bytes, and back, eight codes per 64-bit word."""

from __future__ import annotations

import torch
from torch import Tensor

from geofm.fl.communication.codec.packet import payload_nbytes


def _lane_mask(bits: int, lane: int) -> int:
    """An int64 mask keeping the lowest ``bits`` bits of every ``lane``-bit lane of a 64-bit word."""
    return sum(((1 << bits) - 1) << offset for offset in range(0, 64, lane))


class BitPacker:
    """Reused buffers of one chunk for packing codes of 1, 2 or 4 bits into bytes, and back.

    Eight codes, one per byte of an int64 word, are merged in three shift-or-mask steps that halve
    the number of lanes each time (SWAR), leaving ``bits`` packed bytes at the bottom of the word;
    unpacking runs the steps backwards. Bytes are read in little-endian order.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.codes = torch.empty(size, dtype=torch.uint8, device=device)
        self.shifted = torch.empty(size // 8, dtype=torch.int64, device=device)

    def _words(self, length: int) -> tuple[Tensor, Tensor]:
        words = -(-length // 8)
        return self.codes[: 8 * words].view(torch.int64), self.shifted[:words]

    def pack(self, payload: Tensor, start: int, stop: int, bits: int) -> None:
        """Pack :attr:`codes` ``[:stop - start]`` (values ``start:stop``) into their payload bytes."""
        length = stop - start
        word, shifted = self._words(length)
        self.codes[length : 8 * word.numel()] = 0
        for step in range(3):
            held = bits << step  # bits of each half-lane before this step
            torch.bitwise_right_shift(word, (8 << step) - held, out=shifted)
            word.bitwise_or_(shifted).bitwise_and_(_lane_mask(2 * held, 16 << step))
        packed = word.view(torch.uint8).view(-1, 8)[:, :bits]
        first, count = start * bits // 8, payload_nbytes(length, bits)
        if count == packed.numel():
            payload[first : first + count].view(-1, bits).copy_(packed)
        else:
            payload[first : first + count].copy_(packed.reshape(-1)[:count])

    def unpack(self, payload: Tensor, start: int, stop: int, bits: int) -> Tensor:
        """Codes of values ``start:stop``, one per byte, unpacked from the payload into :attr:`codes`."""
        length = stop - start
        word, shifted = self._words(length)
        first, count = start * bits // 8, payload_nbytes(length, bits)
        word.zero_()
        spread = word.view(torch.uint8).view(-1, 8)[:, :bits]
        if count == spread.numel():
            spread.copy_(payload[first : first + count].view(-1, bits))
        else:
            tail = torch.zeros(spread.numel(), dtype=torch.uint8, device=payload.device)
            tail[:count] = payload[first : first + count]
            spread.copy_(tail.view(-1, bits))
        for step in reversed(range(3)):
            held = bits << step
            torch.bitwise_left_shift(word, (8 << step) - held, out=shifted)
            word.bitwise_or_(shifted).bitwise_and_(_lane_mask(held, 8 << step))
        return self.codes[:length]
