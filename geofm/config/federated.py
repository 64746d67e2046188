"""The config of federated pretraining (``geofm fed simulate``, ``geofm fed launch``).

It reuses central pretraining's sections (``run``, ``model``, ``masking``, ``teacher``, ``data``)
with the same meaning; ``train`` is the clients' local optimisation (AdamW, clipping, precision)
with a learning-rate schedule over rounds; ``federation`` says who the clients are and how rounds
run; ``algorithm`` says what each side does and what travels each way. Every registered algorithm
(``geofm list algorithms``; FedSense with every component switchable, for its ablations and the
quantised baselines), a plug-in's included, is a run of the same program with another ``algorithm`` section.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from geofm.config.base import ProgramConfig, Section, checks_architecture, config_to_dict
from geofm.config.sections import (
    DataConfig,
    MaskingConfig,
    OptimizerConfig,
    RunConfig,
    StudentConfig,
    TeacherConfig,
    check_masked_pretraining,
)
from geofm.errors import ConfigError
from geofm.tasks import FEDERATED_CONFIGS, TASKS

MOVED_TO_OPTIONS = (
    "perturbation_radius",
    "proximal_beta",
    "clusters",
    "distill_steps",
    "distill_lr",
    "distill_batch_size",
    "server_lr",
)
"""Keys of the ``algorithm`` section of configs written before every algorithm kept its settings in
``options`` (FedSense's, FedProx's, SCAFFOLD's); a config that still sets one is told where it went."""


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
        description="the local optimiser; null: the one the algorithm's paper assumes (sgd for scaffold, feddc, "
        "fednova, fedgloss), else AdamW with this section's base_lr, betas, eps and weight_decay",
    )
    lr_schedule: Literal["constant", "cosine"] = Field(default="constant", description="over rounds, after the warm-up")
    warmup_rounds: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check_budget(self) -> LocalTrainConfig:
        if (self.local_epochs is None) == (self.local_steps is None):
            raise ValueError("set exactly one of train.local_epochs and train.local_steps (the other to null)")
        return self


class CodecConfig(Section):
    """Quantisation of what travels: ``bits`` 32 sends raw float32 (no compression)."""

    bits: Literal[1, 2, 4, 8, 32] = 32
    bucket_size: int | None = Field(
        default=512, gt=0, description="values sharing one scale; null: one scale per update"
    )
    scale_norm: Literal["linf", "l2"] = Field(
        default="linf",
        description="the norm scaling each bucket (b >= 2); l2 is the paper's literal choice, kept for ablations: "
        "with error feedback it diverges at low bit widths",
    )
    stochastic: bool = Field(default=True, description="unbiased stochastic rounding; false: round to nearest")


class UplinkConfig(CodecConfig):
    """The clients' uploads: quantisation plus optional error feedback."""

    error_feedback: bool = False
    feedback_alpha: float = Field(default=0.0, ge=0.0, lt=1.0, description="e <- alpha e + (1 - alpha)(G - deq(Q))")
    feedback_reset_every: int | None = Field(default=None, gt=0, description="reset the error buffer every T rounds")
    feedback_guard: float = Field(
        default=10.0, gt=1.0, description="reset (and log) when ||e|| exceeds this multiple of the update's norm"
    )


def _registered(name: str, info: ValidationInfo, registry: str) -> str:
    """``name`` if the registry ``"module:ATTRIBUTE"`` has it, else ValueError with the nearest names.

    The registries' modules import torch, so names are checked with the architecture (second pass).
    """
    if not checks_architecture(info):
        return name
    module, attribute = registry.split(":")
    return getattr(importlib.import_module(module), attribute).check(name)


def _foreign_keys(section: Section, used: dict[str, set[str]]) -> None:
    """Refuse a built-in ``section.name`` given a non-default value of a key only other built-ins use."""
    if section.name not in used:
        return
    defaults = type(section).model_fields
    keys = set().union(*used.values()) - used[section.name]
    foreign = sorted(key for key in keys if getattr(section, key) != defaults[key].default)
    if foreign:
        owners = sorted(name for name, own in used.items() if set(foreign) & own)
        raise ValueError(f"{section.name} has no {', '.join(foreign)} (used by {', '.join(owners)})")


class ServerOptimizerConfig(Section):
    """How the round's combined update ``Delta`` moves the global model (Reddi et al. 2021, Algorithm 2).

    ``sgd``: ``x + lr Delta`` (lr 1: FedAvg). ``fedavgm``: server momentum. ``fedadam``, ``fedyogi``:
    adaptive steps ``lr m / (sqrt(v) + tau)``. A plug-in's optimiser reads the keys it needs.
    """

    name: str = Field(default="sgd", description="a registered server optimiser (geofm list server-optimizers)")
    lr: float | None = Field(
        default=None, gt=0.0, description="server learning rate; null: 1.0 (sgd, fedavgm); fedadam and fedyogi need it"
    )
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0, description="fedavgm: server momentum")
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0, description="fedadam, fedyogi: decay of the first moment")
    beta2: float = Field(default=0.99, ge=0.0, lt=1.0, description="fedadam, fedyogi: decay of the second moment")
    tau: float = Field(default=1e-3, gt=0.0, description="fedadam, fedyogi: adaptivity, added to sqrt(v)")

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str, info: ValidationInfo) -> str:
        return _registered(name, info, "geofm.federated.server_optimizers:SERVER_OPTIMIZERS")

    @model_validator(mode="after")
    def _check_keys(self) -> ServerOptimizerConfig:
        _foreign_keys(
            self,
            {
                "sgd": set(),
                "fedavgm": {"momentum"},
                "fedadam": {"beta1", "beta2", "tau"},
                "fedyogi": {"beta1", "beta2", "tau"},
            },
        )
        if self.name in ("fedadam", "fedyogi") and self.lr is None:
            raise ValueError(f"{self.name} needs lr (Reddi et al. tune it between 1e-3 and 1)")
        return self


class AggregatorConfig(Section):
    """How the server combines the accepted client updates: the weighted mean, or a Byzantine-robust rule."""

    name: str = Field(default="mean", description="a registered aggregator (geofm list aggregators)")
    trim_fraction: float = Field(
        default=0.1, ge=0.0, lt=0.5, description="trimmed_mean: share of the values dropped at each end, per coordinate"
    )
    byzantine_clients: int = Field(default=0, ge=0, description="krum: f, the assumed number of Byzantine clients")
    multi_krum: int | None = Field(
        default=None, gt=0, description="krum: average the m updates of lowest score; null: Krum's single best"
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str, info: ValidationInfo) -> str:
        return _registered(name, info, "geofm.federated.robust:AGGREGATORS")

    @model_validator(mode="after")
    def _check_keys(self) -> AggregatorConfig:
        _foreign_keys(
            self,
            {
                "mean": set(),
                "median": set(),
                "trimmed_mean": {"trim_fraction"},
                "krum": {"byzantine_clients", "multi_krum"},
            },
        )
        return self


class SamConfig(Section):
    """The client optimiser's sharpness-aware step: each local gradient is taken at ``w + e`` and applied
    at ``w``, with ``e = rho g / ||g||`` (SAM) or ``e = rho T_w^2 g / ||T_w g||``, ``T_w = |w| + eta``
    (``adaptive``: ASAM); see :mod:`geofm.federated.sharpness`. It composes with every algorithm."""

    rho: float | None = Field(
        default=None, gt=0.0, description="the ascent's radius; null: the algorithm's (fedsam, fedasam, fedgloss)"
    )
    adaptive: bool | None = Field(
        default=None, description="ASAM: the neighbourhood scaled by |w| + eta; null: the algorithm's, else false"
    )
    eta: float | None = Field(
        default=None, ge=0.0, description="ASAM: the offset of T_w = |w| + eta; null: the algorithm's, else 0.01"
    )


NOISE_SEED = Field(
    default=None,
    ge=0,
    description="null: noise from OS entropy, the only private choice; an integer makes the noise "
    "reproducible (experiments, tests) and gives no privacy against anyone who knows it",
)
"""The seed field of every differential-privacy section."""


class PrivacyConfig(Section):
    """Client-level differential privacy of the model updates (see :mod:`geofm.federated.privacy`).

    ``central``: the server clips each decoded update to ``clip``, averages them with equal weights
    and adds Gaussian noise of std ``noise_multiplier * clip / m`` (DP-FedAvg). ``local``: each client
    clips its update and adds noise of std ``noise_multiplier * clip`` before quantising it.
    """

    mode: Literal["central", "local"]
    clip: float = Field(gt=0.0, description="S: the L2 norm each client's update is clipped to")
    noise_multiplier: float = Field(
        ge=0.0, description="z: the noise std in units of clip (0: clipping only, no guarantee)"
    )
    delta: float = Field(default=1e-5, gt=0.0, lt=1.0, description="the delta the logged epsilon is for")
    seed: int | None = NOISE_SEED


class AlgorithmConfig(Section):
    """The federated algorithm: client update rule, server update rule and what travels each way.

    Each algorithm's own settings are ``options``, checked by its ``Options`` model
    (``geofm list algorithms`` names them). ``fedavg``: local AdamW steps, data-weighted averaging.
    ``fedprox``: plus the proximal term ``proximal_beta / 2 ||theta - Theta||^2`` (``options``:
    ``proximal_beta``). ``fedsense``: plus drift-aware perturbed local steps (``perturbation_radius``,
    server-to-client guidance), the proximal term if ``proximal_beta``, K-means of client models
    (``clusters``) and similarity distillation on the server's public data (``distill_steps``,
    ``distill_lr``, ``distill_batch_size``), all in ``options``; these combine the uploads with
    ``aggregator`` and step the global model with ``server_optimizer``. ``scaffold``: control variates
    correcting the client drift,
    the paper's plain means and server step ``options.server_lr``. ``pfedla``: each client trains from its own
    layer-wise mix of every client's model, weighted by a hypernetwork per client that the server learns
    from the client's updates (``options``: ``hn_lr``, ``embedding_dim``, ``hidden_dim``, ``layers``);
    the global model is the data-weighted mean of the clients' models; 32-bit downlink only. ``fedbn``:
    FedAvg whose normalisation layers (``options.layers``: ``all`` or the paper's ``batchnorm``) stay on
    each client. ``fednova``: each client's update normalised by its number of local steps, rescaled by
    their data-weighted mean ``tau_eff``. ``feddc``: a local drift variable per client, its penalty
    ``options.alpha / 2 ||theta + h - w||^2`` and a gradient correction, the server averaging the
    drift-corrected models. ``moon``: FedAvg plus the model-contrastive loss on the backbone's pooled
    features (``options``: ``mu``, ``temperature``). ``swa`` and ``wima``: FedAvg whose server validates and
    exports an average of its global models: SWA's running average of each cycle's last model under a
    cyclical server step (``options``: ``start``, ``cycle``, ``lr_max``, ``lr_min``), or the mean of the
    last ``window`` models (``options``: ``start``, ``window``, ``blocks``). ``fedsam`` and ``fedasam``:
    FedAvg whose local steps are SAM's or ASAM's (``sam``, with the FedSAM paper's radii by default).
    ``fedgloss``: SAM on the server along the previous round's update, with an ADMM dual on both sides
    (``options``: ``rho``, ``beta``, ``warmup_rounds``, ``rho0``) and local SAM. ``fedalign``: FedAvg plus the
    Lipschitz matching of the backbone's final stage with its MLPs pruned (``options``: ``mu``, ``width``,
    ``power_iterations``). ``sam`` makes any algorithm's local steps sharpness-aware; ``privacy`` clips and noises
    the clients' model updates (algorithms whose only upload is ``update`` and whose server averages it).
    Any registered algorithm (``geofm list algorithms``) takes its own settings from ``options``. Every payload can be
    quantised: ``uplink`` and ``downlink`` apply to each payload of their direction, ``uplink_payloads``
    and ``downlink_payloads`` change fields for one named payload.
    """

    name: str = Field(default="fedsense", description="a registered algorithm (geofm list algorithms)")
    sam: SamConfig | None = Field(
        default=None, description="sharpness-aware local steps (SAM, ASAM) under any algorithm; null: plain steps"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="a registered algorithm's own settings, checked by that algorithm"
    )
    uplink: UplinkConfig = UplinkConfig()
    downlink: CodecConfig = Field(
        default_factory=lambda: CodecConfig(bits=32),
        description="the global model's change since a client's last copy; bits 32 (default) sends the model as is",
    )
    uplink_payloads: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="payload name -> uplink fields that differ for that payload"
    )
    downlink_payloads: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="payload name -> downlink fields that differ for that payload"
    )
    norm_factor: float = Field(
        default=10.0, gt=1.0, description="reject uploads above this multiple of the median norm"
    )
    norm_history_rounds: int = Field(
        default=5,
        ge=1,
        description="rounds of accepted update norms the server keeps as the norm rule's reference "
        "when a round has fewer than three uploads",
    )
    examples_factor: float | None = Field(
        default=10.0,
        ge=1.0,
        description="a client's weight counts at most this multiple of the median example count of the "
        "round's other uploads; null: weights as claimed",
    )
    server_optimizer: ServerOptimizerConfig = ServerOptimizerConfig()
    aggregator: AggregatorConfig = AggregatorConfig()
    privacy: PrivacyConfig | None = Field(
        default=None, description="client-level differential privacy of the updates; null: off"
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        from geofm.federated.algorithms import ALGORITHMS  # the registry only: no torch

        return ALGORITHMS.check(name)

    @model_validator(mode="before")
    @classmethod
    def _moved_to_options(cls, data: Any) -> Any:
        moved = [key for key in MOVED_TO_OPTIONS if isinstance(data, dict) and key in data]
        if moved:
            raise ValueError(
                f"{', '.join(moved)}: an algorithm's own settings go in algorithm.options; write "
                f"options: {{{', '.join(f'{key}: ...' for key in moved)}}}"
            )
        return data

    @model_validator(mode="after")
    def _check_components(self) -> AlgorithmConfig:
        for name in self.uplink_payloads:
            self.uplink_for(name)
        for name in self.downlink_payloads:
            self.downlink_for(name)
        return self

    def uplink_for(self, payload: str) -> UplinkConfig:
        """The uplink codec of one payload: ``uplink`` with that payload's fields of ``uplink_payloads``."""
        return _merged(self.uplink, self.uplink_payloads.get(payload, {}), f"uplink_payloads.{payload}")

    def downlink_for(self, payload: str) -> CodecConfig:
        """The downlink codec of one payload: ``downlink`` with that payload's fields of ``downlink_payloads``."""
        return _merged(self.downlink, self.downlink_payloads.get(payload, {}), f"downlink_payloads.{payload}")


def _merged(section: Section, fields: dict[str, Any], where: str) -> Section:
    """``section`` with ``fields`` replaced and validated (see :func:`validated`)."""
    return validated(type(section), {**section.model_dump(), **fields}, where)


def validated(model: type[BaseModel], data: Any, where: str) -> BaseModel:
    """``data`` validated as ``model``; ValueError naming ``where``, the first bad field and what it expects."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{where}{'.' + loc if loc else ''}: {first['msg']}") from None


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
        from geofm.federated.partition import PARTITIONERS  # no deep-learning import: see geofm.federated

        return PARTITIONERS.check(name)


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
        from geofm.federated.algorithms import ALGORITHMS

        try:
            ALGORITHMS.get(algorithm.name).check_config(algorithm)
            ALGORITHMS.get(algorithm.name).check_public_images(algorithm, public_images)
        except ValueError as err:
            raise ValueError(f"algorithm.{err}") from None
    if fed.min_clients > len(clients):
        raise ValueError(f"federation.min_clients {fed.min_clients} exceeds the {len(clients)} clients")
    undeclared = sorted(set(fed.declared_examples) - set(clients))
    if undeclared:
        raise ValueError(f"federation.declared_examples names {undeclared}, not clients of this run {clients}")
    krum = algorithm.aggregator
    if krum.name == "krum" and fed.min_clients <= 2 * krum.byzantine_clients + 2:
        raise ValueError(
            f"algorithm.aggregator krum with byzantine_clients {krum.byzantine_clients} needs "
            f"federation.min_clients above 2f + 2 = {2 * krum.byzantine_clients + 2}, got {fed.min_clients}"
        )


class FederatedConfig(ProgramConfig):
    """Federated continual pretraining: GFM (SimMIM without a teacher) on every client, FedSense around it."""

    run: RunConfig
    model: StudentConfig
    masking: MaskingConfig = MaskingConfig()
    teacher: TeacherConfig | None = None
    data: DataConfig
    train: LocalTrainConfig
    federation: FederationConfig
    algorithm: AlgorithmConfig = AlgorithmConfig()
    task: str = Field(default="mim", description="the registered task every client trains (geofm list tasks)")

    @field_validator("task")
    @classmethod
    def _registered_task(cls, name: str) -> str:
        return TASKS.check(name)

    @model_validator(mode="after")
    def _check_combination(self, info: ValidationInfo) -> FederatedConfig:
        check_masked_pretraining(
            self.model, self.masking, self.teacher, self.data, architecture=checks_architecture(info)
        )
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

    @property
    def num_clients(self) -> int:
        return len(self.client_names)

    def for_node(self, institution: str, data_root: str | None, teacher: str | None) -> FederatedConfig:
        """The config as one institution's machine sees it: its ``data_root`` and ``teacher`` paths.

        ``data_root`` replaces the root of the institution's own source (``by_source``), or is the
        folder relative source roots are resolved against (other partitions); ``teacher`` replaces
        the teacher's weights file.
        """
        tree = config_to_dict(self)
        if data_root:
            for source in tree["data"]["sources"]:
                if self.federation.partition == "by_source":
                    if source["name"] == institution:
                        source["root"] = str(data_root)
                elif not Path(source["root"]).is_absolute():
                    source["root"] = str(Path(data_root) / source["root"])
        if teacher and tree.get("teacher"):
            tree["teacher"]["checkpoint"] = str(teacher)
        return FederatedConfig.from_tree(tree, f"the run's config at {institution}")


def read_federated_config(tree: dict, source: str = "<config>", overrides: Sequence[str] = ()) -> Any:
    """A federated config tree validated with its task's config class (:data:`geofm.tasks.FEDERATED_CONFIGS`):
    :class:`FederatedConfig` for pretraining, :class:`~geofm.config.fedfinetune.FederatedFinetuneConfig`
    for a finetuning task.

    Raises:
        ConfigError: an unknown task (with the nearest names) or an invalid config, naming ``source``.
    """
    task = tree.get("task", FederatedConfig.model_fields["task"].default) if isinstance(tree, dict) else None
    try:
        config_class = FEDERATED_CONFIGS.get(str(task))
    except ConfigError as err:
        raise ConfigError(f"{source}: task: {err}") from None
    return config_class.from_tree(tree, source, overrides)
