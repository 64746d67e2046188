from pathlib import Path

import pytest

from geofm.config.feddiff import FedDiffConfig

CONFIGS = sorted(Path(__file__).parents[2].joinpath("configs", "feddiff").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_feddiff_configs_validate_and_are_named_after_their_run(path):
    cfg = FedDiffConfig.from_file(path)
    assert cfg.run.output_dir.name == path.stem
    assert cfg.federation.rounds == 1 and cfg.client_names
