from pathlib import Path

import pytest

from geofm.config.base import read_config_tree
from geofm.config.federated import FederatedConfig, read_federated_config
from geofm.errors import ConfigError

CONFIGS = sorted(Path(__file__).parents[2].joinpath("configs", "federated").glob("*.yaml"))
DEMO = Path(__file__).parents[2] / "configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_federated_configs_validate_and_are_named_after_their_run(path):
    cfg = read_federated_config(read_config_tree(path), str(path))  # pretraining or finetuning, by task
    assert cfg.run.output_dir.name == path.stem


def test_the_paper_setting_and_its_baselines_differ_only_in_their_algorithm():
    folder = DEMO.parent
    fedavg = FederatedConfig.from_file(folder / "fedavg_swin_tiny__10clients__100rounds.yaml")
    fedsense = FederatedConfig.from_file(folder / "fedsense_swin_tiny__10clients__100rounds__1bit_ef.yaml")
    assert (fedavg.model.arch, fedavg.num_clients, fedavg.federation.rounds) == (
        "swin_tiny_patch4_window7_224",
        10,
        100,
    )
    assert (fedavg.train.local_epochs, fedavg.train.base_lr, fedavg.train.lr_reference_batch) == (1, 1e-4, 64)
    for section in ("model", "task", "task_options", "data", "train", "federation"):
        assert getattr(fedavg, section) == getattr(fedsense, section), section
    assert (fedsense.algorithm.uplink.bits, fedsense.algorithm.uplink.error_feedback) == (1, True)
    assert fedsense.algorithm.uplink.scale_norm == "linf", "L-infinity scales by default (L2 diverges with feedback)"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm.name=fedavg",
            r"algorithm\.options: fedavg takes no options, got \['clusters', 'distill_batch_size'",
        ),
        ("federation.clients=5", "by_source makes one client per private source"),
        ("federation.partition=dirichlet", "federation.partition dirichlet needs federation.clients"),
        ("federation.public_sources=[archive_x]", r"public_sources \['archive_x'\] are not sources"),
        ("federation.public_sources=[]", r"algorithm\.options\.distill_steps: .* trains on the server's public images"),
        ("train.local_steps=4", "set exactly one of train.local_epochs and train.local_steps"),
        ("algorithm.uplink.bits=3", r"algorithm\.uplink\.bits"),
        ("federation.min_clients=4", "min_clients 4 exceeds the 3 clients"),
        ("algorithm.name=scafold", r"unknown algorithm 'scafold'; did you mean 'scaffold'\?"),
        (
            "algorithm.server_lr=0.5",
            r"server_lr: an algorithm's own settings go in algorithm\.options; write options: \{server_lr: \.\.\.\}",
        ),
        ("algorithm.options={keep: 1}", r"algorithm\.options\.keep: unknown key"),
        (
            "algorithm.options={proximal_beta: -1}",
            r"algorithm\.options\.proximal_beta: Input should be greater than or equal to 0",
        ),
        (
            "algorithm.uplink_payloads={delta_c: {bits: 8}}",
            r"algorithm\.uplink_payloads names \['delta_c'\]; fedsense sends \['update'\]",
        ),
        (
            "algorithm.downlink_payloads={model: {bits: 3}}",
            r": algorithm\.downlink_payloads\.model\.bits: Input should be 1, 2, 4, 8 or 32",
        ),
        ("algorithm.server_optimizer.name=fedadm", r"algorithm\.server_optimizer\.name.*did you mean 'fedadam'"),
        ("algorithm.aggregator.name=medain", r"algorithm\.aggregator\.name.*did you mean 'median'"),
        ("algorithm.server_optimizer.name=fedyogi", "fedyogi needs lr"),
        (
            "algorithm.server_optimizer={name: fedadam, lr: 0.01, options: {momentum: 0.5}}",
            r"fedadam, lr: 0\.01, options: \{momentum: 0\.5\}\}: algorithm\.server_optimizer\.options\.momentum: unknown key",
        ),
        (
            "algorithm.aggregator.trim_fraction=0.2",
            r"trim_fraction: the aggregator's own settings go in its options; write options: \{trim_fraction: \.\.\.\}",
        ),
        (
            "algorithm.aggregator.options={trim_fraction: 0.2}",
            r"options=\{trim_fraction: 0\.2\}: mean takes no options, got \['trim_fraction'\]",
        ),
        (
            "algorithm.aggregator={name: trimmed_mean, options: {trim_fraction: 0.5}}",
            r"options\.trim_fraction: Input should be less than 0\.5",
        ),
        (
            "algorithm.aggregator={name: krum, options: {byzantine_clients: 1}}",
            r"byzantine_clients 1 needs federation\.min_clients above 2f \+ 2 = 4, got 2",
        ),
        ("federation.partition=by_regoin", "unknown partitioner 'by_regoin'; did you mean 'by_region'"),
        ("task=mimm", "unknown task 'mimm'; did you mean 'mim'"),
        (
            "algorithm.options.perturbaton_radius=0.1",
            r"\n  override algorithm\.options\.perturbaton_radius=0\.1: unknown key \(did you mean perturbation_radius\?\)",
        ),
        (
            "algorithm.server_optimizer={name: fedadam, options: {beta: 1}}",
            r": algorithm\.server_optimizer\.options\.beta: unknown key \(did you mean beta2 or beta1\?\)",
        ),
    ],
)
def test_federated_config_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        FederatedConfig.from_file(DEMO, [override])
    assert str(DEMO) in str(info.value)


def test_partitions_other_than_by_source_name_their_clients():
    cfg = FederatedConfig.from_file(DEMO, ["federation.partition=dirichlet", "federation.clients=4"])
    assert cfg.client_names == ["client0", "client1", "client2", "client3"]


def test_server_rules_default_to_fedavg_and_take_their_keys():
    cfg = FederatedConfig.from_file(DEMO)
    assert (cfg.algorithm.server_optimizer.name, cfg.algorithm.aggregator.name) == ("sgd", "mean")
    cfg = FederatedConfig.from_file(
        DEMO,
        [
            "algorithm.server_optimizer={name: fedyogi, lr: 0.03, options: {tau: 0.01}}",
            "algorithm.aggregator={name: krum, options: {byzantine_clients: 0, multi_krum: 2}}",
            "federation.min_clients=3",
        ],
    )
    assert (cfg.algorithm.server_optimizer.lr, cfg.algorithm.server_optimizer.options_of().tau) == (0.03, 0.01)
    assert cfg.algorithm.aggregator.options_of().multi_krum == 2
