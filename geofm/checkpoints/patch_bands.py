"""A checkpoint's patch-embedding kernels placed into the bands of a model: RGB into an N-band model, or band by band."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from geofm.checkpoints.report import LoadReport
from geofm.errors import CheckpointFormatError, ConfigError

PATCH_EMBED_WEIGHT = "patch_embed.proj.weight"


def map_bands(
    state: dict[str, Tensor],
    target: dict[str, Tensor],
    band_sources: Sequence[int | None],
    report: LoadReport,
    where: str,
    note: str | None = None,
) -> None:
    """Rebuild the patch kernel band by band: checkpoint band ``band_sources[i]`` into model band ``i`` (in place).

    Model bands whose source is None keep the model's fresh initialisation.
    """
    if PATCH_EMBED_WEIGHT not in state or PATCH_EMBED_WEIGHT not in target:
        return
    weight, fresh = state[PATCH_EMBED_WEIGHT], target[PATCH_EMBED_WEIGHT]
    have, want = weight.shape[1], fresh.shape[1]
    sources = list(band_sources)
    if len(sources) != want or not all(s is None or 0 <= int(s) < have for s in sources):
        raise ConfigError(
            f"{where}band_sources {sources} must give, for each of the model's {want} bands, a checkpoint band "
            f"index in [0, {have}) or None"
        )
    if sources == list(range(have)):
        return
    adapted = fresh.detach().to("cpu", weight.dtype, copy=True)
    for band, source in enumerate(sources):
        if source is not None:
            adapted[:, band] = weight[:, int(source)]
    state[PATCH_EMBED_WEIGHT] = adapted
    report.adapted.append(f"{PATCH_EMBED_WEIGHT}: {have} -> {want} bands, {note or f'from checkpoint bands {sources}'}")


def place_rgb(
    state: dict[str, Tensor],
    target: dict[str, Tensor],
    rgb_positions: Sequence[int] | None,
    report: LoadReport,
    where: str,
) -> None:
    """Put a 3-band patch embedding into the RGB bands of an N-band model (in place)."""
    if PATCH_EMBED_WEIGHT not in state or PATCH_EMBED_WEIGHT not in target:
        return
    have, want = state[PATCH_EMBED_WEIGHT].shape[1], target[PATCH_EMBED_WEIGHT].shape[1]
    if have == want:
        return
    if have != 3:
        raise CheckpointFormatError(
            f"{where}the checkpoint's patch embedding takes {have} bands and the model {want}: only 3-band "
            "(RGB) checkpoints can be placed into a model with another band count"
        )
    positions = _check_rgb_positions(rgb_positions, want)
    sources: list[int | None] = [None] * want
    for rgb, position in enumerate(positions):
        sources[position] = rgb
    map_bands(state, target, sources, report, where, note=f"RGB into {positions}")


def _check_rgb_positions(rgb_positions: Sequence[int] | None, bands: int) -> list[int]:
    if rgb_positions is None:
        raise ConfigError(
            f"the checkpoint is RGB (3 bands) and the model takes {bands}: rgb_positions must say which "
            "model bands receive red, green and blue (e.g. data.bands naming red, green and blue)"
        )
    positions = [int(p) for p in rgb_positions]
    if len(positions) != 3 or len(set(positions)) != 3 or not all(0 <= p < bands for p in positions):
        raise ConfigError(
            f"rgb_positions {list(rgb_positions)} must be 3 distinct band indices in [0, {bands}) for red, green, blue"
        )
    return positions
