import pytest
from torch.utils.data import DataLoader, Dataset

from geofm.errors import DatasetNotFoundError, RasterReadError


class _Failing(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index):
        try:
            raise OSError("TIFFReadEncodedStrip() failed")  # a chained cause, as rasterio's errors have
        except OSError as cause:
            raise RasterReadError("/archive/scene_7.tif", "cannot read raster\nsecond line") from cause


@pytest.mark.slow
def test_an_error_raised_in_a_loader_worker_keeps_its_type_and_only_its_own_message():
    with pytest.raises(RasterReadError) as info:
        next(iter(DataLoader(_Failing(), num_workers=1)))
    assert str(info.value) == "/archive/scene_7.tif: cannot read raster\nsecond line"
    assert "TIFFReadEncodedStrip" in info.value.worker_traceback and "__getitem__" in info.value.worker_traceback


def test_plain_errors_are_left_alone():
    err = DatasetNotFoundError("Caught nothing: a message that merely starts like a wrapper")
    assert err.worker_traceback is None and str(err).startswith("Caught nothing")
