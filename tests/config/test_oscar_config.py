from pathlib import Path

import pytest

from geofm.config.oscar import OscarConfig

CONFIGS = sorted(Path(__file__).parents[2].joinpath("configs", "oscar").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_oscar_configs_validate_and_are_named_after_their_run(path, archive):
    cfg = OscarConfig.from_file(path)
    assert cfg.run.output_dir.name == path.stem
    assert cfg.federation.rounds == 1 and cfg.client_names
    # the public imagery `geofm demo-data --out data/demo` writes (the archive fixture: the same generator)
    assert cfg.oscar.public == Path("data/demo") / archive["public_rgb"].name and archive["public_rgb"].is_dir()
