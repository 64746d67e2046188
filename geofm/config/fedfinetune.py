"""The config of federated finetuning: a finetuning config whose clients train it together.

Every section of :class:`~geofm.config.finetune.FinetuneConfig` (task, backbone checkpoint, model,
head, data, finetune: layer decay, label mixing, validation split, best metric) keeps its meaning;
``train`` is a client's local optimisation each round (:class:`~geofm.config.federated.LocalTrainConfig`),
``federation`` says how the train split's samples are dealt to ``federation.clients`` clients (a
sample partitioner of :mod:`geofm.fl.partitions.samples`: ``iid`` by default) and how rounds run, and
``algorithm`` is the federated algorithm (FedAvg by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator, model_validator

from geofm.config.algorithm import AlgorithmConfig
from geofm.config.base import CONFIG_FILE, read_config_tree
from geofm.config.federated import FederatedProgramConfig, FederationConfig, LocalTrainConfig, check_federation
from geofm.config.finetune import FinetuneConfig
from geofm.errors import ConfigError
from geofm.objective_settings import MIM_TASK
from geofm.registry import REGISTRIES
from geofm.tasks import TASKS


def client_names(count: int) -> list[str]:
    """``client00``, ``client01``, ... (zero-padded so that names sort as numbers)."""
    width = max(2, len(str(count - 1)))
    return [f"client{i:0{width}d}" for i in range(count)]


class FinetuneFederationConfig(FederationConfig):
    """Who the clients are (a partition of the train split's samples) and how rounds run."""

    partition: str = Field(
        default="iid", description="a registered sample partitioner (geofm list sample-partitioners)"
    )
    metadata: Path | None = Field(
        default=None, description="CSV of per-sample fields: a 'sample' column, one per field"
    )
    partition_field: str | None = Field(
        default=None,
        description="by_field: the metadata field whose values clients hold; dirichlet: the field holding each "
        "sample's class (default: its label)",
    )
    where: dict[str, list[str]] = Field(
        default_factory=dict, description="metadata field -> accepted values; other samples are held by no client"
    )

    @field_validator("partition")
    @classmethod
    def _registered_partitioner(cls, name: str) -> str:
        return REGISTRIES.get("sample-partitioners").check(name)


class FederatedFinetuneConfig(FederatedProgramConfig, FinetuneConfig):
    """Federated finetuning of a backbone on one downstream task (see the module docstring)."""

    train: LocalTrainConfig
    federation: FinetuneFederationConfig
    algorithm: AlgorithmConfig = AlgorithmConfig(name="fedavg")

    @model_validator(mode="after")
    def _check_federation(self, info: ValidationInfo) -> FederatedFinetuneConfig:
        fed = self.federation
        if fed.clients is None:
            raise ValueError(f"federation.partition {fed.partition} needs federation.clients")
        if fed.partition == "by_field" and not fed.partition_field:
            raise ValueError("federation.partition by_field needs federation.partition_field (a metadata field)")
        if (fed.partition == "by_field" or fed.where or fed.partition_field) and fed.metadata is None:
            raise ValueError(
                "federation.partition by_field, federation.partition_field and federation.where need "
                "federation.metadata (a CSV file)"
            )
        if fed.public_sources:
            raise ValueError("federation.public_sources: finetuning has no public pretraining source")
        check_federation(fed, self.algorithm, self.client_names, False, info)
        return self

    @property
    def client_names(self) -> list[str]:
        """``client00``, ``client01``, ... (``federation.clients`` of them)."""
        return client_names(self.federation.clients)


def read_finetune_config(tree: dict, source: str = "<config>", overrides: Sequence[str] = ()) -> FinetuneConfig:
    """A finetuning run's config tree validated as what it is: federated when it has a ``federation``
    section (a run of ``geofm fed simulate``), else central; ``geofm eval`` and ``geofm predict`` read both.
    ``overrides`` are those applied to the tree (errors name them)."""
    if isinstance(tree, dict) and "federation" in tree:
        return FederatedFinetuneConfig.from_tree(tree, source, overrides)
    return FinetuneConfig.from_tree(tree, source, overrides)


def check_finetuning_run(run_dir: Path) -> None:
    """Refuse a pretraining run (central or federated) where a finetuning run is read (``geofm eval``,
    ``geofm predict``): the kind of its ``config.yaml``'s task (a run saved before configs named a
    task pretrained). A folder without ``config.yaml``, or whose task is not registered here, is left
    to the caller's own error.

    Raises:
        ConfigError: naming the run, what it is, and how to finetune from it.
    """
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return
    tree = read_config_tree(path)
    task = tree.get("task", MIM_TASK)
    if task not in TASKS or getattr(TASKS.get(task), "kind", None) != "pretraining":
        return
    kind = "federated" if "federation" in tree else "central"
    raise ConfigError(
        f"{run_dir} is a {kind} pretraining run, not a finetuning run: geofm eval and geofm predict take a geofm "
        f"finetune run; finetune its backbone first with geofm finetune --config CONFIG checkpoint={run_dir} "
        "(or checkpoint: in CONFIG)"
    )


__all__ = ["FederatedFinetuneConfig", "FinetuneFederationConfig", "check_finetuning_run", "read_finetune_config"]
