"""The config of federated pretraining (``geofm fed simulate``, ``geofm fed launch``).

It reuses central pretraining's sections (``run``, ``model``, ``data``, the objective's ``task`` and
``task_options``) with the same meaning; ``train`` is the clients' local optimisation (AdamW, clipping, precision)
with a learning-rate schedule over rounds; ``federation`` says who the clients are and how rounds
run; ``algorithm`` says what each side does and what travels each way. Every registered algorithm
(``geofm list algorithms``; FedSense with every component switchable, for its ablations and the
quantised baselines), a plug-in's included, is a run of the same program with another ``algorithm`` section.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, ValidationInfo, field_validator, model_validator

from geofm.config.algorithm import AlgorithmConfig
from geofm.config.base import Section, checks_architecture
from geofm.config.pretrain import PretrainingConfig
from geofm.config.sections import (
    OptimizerConfig,
)
from geofm.errors import ConfigError
from geofm.registry import REGISTRIES
from geofm.tasks import FEDERATED_CONFIGS, TASKS


class LocalOptimizerConfig(Section):
    """A client's local optimiser: ``adamw`` (with ``train``'s betas and eps) or ``sgd`` (torch's, optional
    heavy-ball momentum). Fields left out take the algorithm's declared values where the config names
    the algorithm's own optimiser, else ``train``'s (``base_lr``, ``weight_decay``).

    An algorithm whose analysis assumes a local optimiser declares it (SCAFFOLD, FedDC, FedNova and
    FedGloSS: SGD); with ``train.optimizer`` null the run uses it, set it overrides the declaration
    with a warning naming both.
    """

    name: Literal["adamw", "sgd"]
    base_lr: float | None = Field(
        default=None,
        gt=0.0,
        description="per train.lr_reference_batch images, like train.base_lr; null: the algorithm's declared rate "
        "for its own optimiser, else train.base_lr (adamw); SGD's rate is orders of magnitude above AdamW's",
    )
    momentum: float = Field(default=0.0, ge=0.0, lt=1.0, description="sgd: heavy-ball momentum (0: plain SGD)")
    weight_decay: float | None = Field(
        default=None,
        ge=0.0,
        description="sgd: L2 added to the gradient, adamw: decoupled; null: the algorithm's for its own optimiser, "
        "else train.weight_decay",
    )

    @model_validator(mode="after")
    def _check_momentum(self) -> LocalOptimizerConfig:
        if self.name == "adamw" and self.momentum:
            raise ValueError("momentum is SGD's; AdamW's first-moment decay is train.betas[0]")
        return self

    def describe(self) -> str:
        """One line naming the optimiser and its settings (``sgd lr 0.05 momentum 0 weight_decay 0``)."""
        momentum = f" momentum {self.momentum:g}" if self.name == "sgd" else ""
        lr = "train.base_lr" if self.base_lr is None else f"{self.base_lr:g}"
        decay = "train.weight_decay" if self.weight_decay is None else f"{self.weight_decay:g}"
        return f"{self.name} base_lr {lr}{momentum} weight_decay {decay}"


class LocalTrainConfig(OptimizerConfig):
    """A client's local optimisation each round; the learning rate follows a schedule over rounds.

    ``base_lr``, ``betas``, ``eps`` and ``weight_decay`` are AdamW's; ``optimizer`` picks another local
    optimiser (null: the algorithm's declared one, AdamW for algorithms that declare none).
    """

    local_epochs: float | None = Field(default=1.0, gt=0.0, description="passes over the client's images per round")
    local_steps: int | None = Field(
        default=None, gt=0, description="a fixed number of optimizer steps per round instead"
    )
    optimizer: LocalOptimizerConfig | None = Field(
        default=None,
        description="the local optimiser; null: the one the algorithm's paper assumes where it declares one (SGD "
        "for the drift-correcting methods), else AdamW with this section's base_lr, betas, eps and weight_decay",
    )
    lr_schedule: Literal["constant", "cosine"] = Field(default="constant", description="over rounds, after the warm-up")
    warmup_rounds: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check_budget(self) -> LocalTrainConfig:
        if (self.local_epochs is None) == (self.local_steps is None):
            raise ValueError("set exactly one of train.local_epochs and train.local_steps (the other to null)")
        return self


class FederationConfig(Section):
    """Who the clients are and how rounds run.

    Clients: ``by_source`` makes each private source one client (an institution's or a sensor's
    archive; deployed SuperNodes name their source as their institution); ``by_region`` and
    ``dirichlet`` split the private sources' files among ``clients`` clients (simulations of other
    splits). ``public_sources`` stay with the server for its similarity distillation.
    """

    rounds: int = Field(gt=0)
    partition: str = Field(default="by_source", description="a registered partitioner (geofm list partitioners)")
    clients: int | None = Field(default=None, gt=0, description="by_region, dirichlet: number of clients")
    dirichlet_alpha: float = Field(default=0.5, gt=0.0)
    public_sources: list[str] = Field(default_factory=list, description="source names held by the server only")
    fraction: float = Field(default=1.0, gt=0.0, le=1.0, description="share of the clients selected each round")
    min_clients: int = Field(default=1, gt=0, description="fewest replies a round needs")
    round_timeout_s: float | None = Field(
        default=None,
        gt=0.0,
        description="the longest a round waits for replies; null: derived from the observed round times",
    )
    connect_timeout_s: float = Field(default=600.0, gt=0.0, description="how long to wait for the clients to connect")
    round_retries: int = Field(default=2, ge=0, description="attempts after a round below min_clients")
    stop_after_rounds: int | None = Field(
        default=None,
        gt=0,
        description="run at most this many rounds in one invocation, counted from where it resumes "
        "(as run.stop_after_steps counts steps); a rerun continues",
    )
    local_processes: int = Field(
        default=1,
        gt=0,
        description="processes (GPUs; gloo on a CPU) of its node each client trains its local steps on, data "
        "parallel: a step's global batch is train.micro_batch_size x train.grad_accum_steps x local_processes, as in "
        "central runs; a deployed node's local-processes overrides it",
    )
    declared_examples: dict[str, int] = Field(
        default_factory=dict,
        description="institution -> the most training examples it may claim; a larger claim is weighted as this",
    )

    @field_validator("partition")
    @classmethod
    def _registered_partitioner(cls, name: str) -> str:
        return REGISTRIES.get("partitioners").check(name)


def check_federation(
    fed: FederationConfig, algorithm: AlgorithmConfig, clients: list[str], public_images: bool, info: ValidationInfo
) -> None:
    """The rules every federated config keeps: the algorithm's own (with the architecture's checks,
    importing torch; ``public_images``: whether the server holds public images for it), enough
    clients for a round, declared examples of real clients, Krum's quorum.

    Raises:
        ValueError: naming the field.
    """
    if checks_architecture(info):
        algorithm_class = REGISTRIES.get("algorithms").get(algorithm.name)
        try:
            algorithm_class.check_config(algorithm)
            algorithm_class.check_public_images(algorithm, public_images)
        except ValueError as err:
            raise ValueError(f"algorithm.{err}") from None
    if fed.min_clients > len(clients):
        raise ValueError(f"federation.min_clients {fed.min_clients} exceeds the {len(clients)} clients")
    undeclared = sorted(set(fed.declared_examples) - set(clients))
    if undeclared:
        raise ValueError(f"federation.declared_examples names {undeclared}, not clients of this run {clients}")
    byzantine = algorithm.aggregator.options.get("byzantine_clients", 0)  # validated by krum's options model
    if algorithm.aggregator.name == "krum" and isinstance(byzantine, int) and fed.min_clients <= 2 * byzantine + 2:
        raise ValueError(
            f"algorithm.aggregator krum with byzantine_clients {byzantine} needs "
            f"federation.min_clients above 2f + 2 = {2 * byzantine + 2}, got {fed.min_clients}"
        )


class FederatedProgramConfig:
    """What a federated program's config offers besides its sections (mixed into a config with ``data``,
    ``federation`` and ``client_names``; ``task_options.teacher`` where its objective distils): how many clients it has
    and the config as one institution's machine sees it."""

    @property
    def num_clients(self) -> int:
        return len(self.client_names)

    def for_node(self, institution: str, data_root: str | None, teacher: str | None) -> Self:
        """The config as one institution's machine sees it: its ``data_root`` and ``teacher`` paths.

        ``data_root`` is where the institution holds its data (the data section's ``at_node``: the root of its
        own source under ``by_source``, else the folder relative source roots are resolved against; a
        finetuning dataset's root); ``teacher`` replaces the frozen teacher's weights file where the objective has
        one (``task_options.teacher.checkpoint`` of masked image modelling).
        """
        update = {}
        if data_root:
            own_source = institution if self.federation.partition == "by_source" else None
            update["data"] = self.data.at_node(Path(data_root), own_source)
        options = getattr(self, "task_options", None) or {}
        if teacher and options.get("teacher"):
            update["task_options"] = {**options, "teacher": {**options["teacher"], "checkpoint": str(teacher)}}
        return self.model_copy(update=update) if update else self


class FederatedConfig(FederatedProgramConfig, PretrainingConfig):
    """Federated continual pretraining: a registered objective on every client (GFM/SimMIM by default, or
    DINO), FedSense or another registered algorithm around it."""

    train: LocalTrainConfig
    federation: FederationConfig
    algorithm: AlgorithmConfig = AlgorithmConfig()

    @model_validator(mode="after")
    def _check_combination(self, info: ValidationInfo) -> FederatedConfig:
        fed, names = self.federation, [s.name for s in self.data.sources]
        unknown = [n for n in fed.public_sources if n not in names]
        if unknown:
            raise ValueError(f"federation.public_sources {unknown} are not sources of data.sources {names}")
        private = [n for n in names if n not in fed.public_sources]
        if not private:
            raise ValueError("every source is public: no imagery is left for the clients")
        if fed.partition == "by_source" and fed.clients not in (None, len(private)):
            raise ValueError(
                f"federation.clients {fed.clients}: by_source makes one client per private source ({len(private)})"
            )
        if fed.partition != "by_source" and fed.clients is None:
            raise ValueError(f"federation.partition {fed.partition} needs federation.clients")
        check_federation(self.federation, self.algorithm, self.client_names, bool(fed.public_sources), info)
        return self

    @property
    def client_names(self) -> list[str]:
        """The clients: private source names (``by_source``) or ``client0``, ``client1``, ..."""
        if self.federation.partition == "by_source":
            return [s.name for s in self.data.sources if s.name not in self.federation.public_sources]
        return [f"client{i}" for i in range(self.federation.clients)]


def read_federated_config(tree: dict, source: str = "<config>", overrides: Sequence[str] = ()) -> Any:
    """A federated config tree validated with the config class of its task's kind (:data:`geofm.tasks.FEDERATED_CONFIGS`):
    :class:`FederatedConfig` for a pretraining task, :class:`~geofm.config.fedfinetune.FederatedFinetuneConfig`
    for a finetuning task.

    Raises:
        ConfigError: an unknown task (with the nearest names) or an invalid config, naming ``source``.
    """
    task = tree.get("task", FederatedConfig.model_fields["task"].default) if isinstance(tree, dict) else None
    try:
        kind = getattr(TASKS.get(str(task)), "kind", None)
        config_class = FEDERATED_CONFIGS.get(str(kind))
    except ConfigError as err:
        raise ConfigError(f"{source}: task: {err}") from None
    return config_class.from_tree(tree, source, overrides)
