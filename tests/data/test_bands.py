import pytest

from geofm.data.bands import ALIASES, CANONICAL_BANDS, UnknownBandError, canonical_band, canonical_bands


def test_aliases_resolve_to_canonical_names_case_insensitively():
    assert canonical_band("B08") == "nir" and canonical_band("b8A") == "nir08" and canonical_band("SR_B5") == "nir"
    assert canonical_band("Swir1") == "swir16" and canonical_band(" red ") == "red"
    assert set(ALIASES.values()) <= set(CANONICAL_BANDS), "every alias points at a canonical band"


def test_unknown_band_suggests_the_nearest_names():
    with pytest.raises(UnknownBandError, match="unknown band 'nri': did you mean nir"):
        canonical_band("nri")
    with pytest.raises(UnknownBandError, match="unknown band 'b5'"):
        canonical_band("b5")  # Landsat's nir but Sentinel-2's red edge: ambiguous, not an alias


def test_custom_bands_pass_and_duplicates_after_aliasing_are_refused():
    assert canonical_bands(["red", "DEM"], custom=["dem"]) == ["red", "dem"]
    with pytest.raises(UnknownBandError, match=r"model bands: .* names nir more than once"):
        canonical_bands(["nir", "b08"], where="model bands")
