"""The ``algorithm`` section of every federated config: what each side does and what travels each way.

``AlgorithmConfig`` names a registered algorithm (``geofm list algorithms``) and holds what every
algorithm shares: the codecs of each payload (``uplink``, ``downlink``), the server's upload
screening, its optimiser and aggregator, local SAM steps and client-level differential privacy; an
algorithm's own settings are its ``options``, checked by its ``Options`` model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from geofm.config.base import Section, checks_architecture
from geofm.registry import REGISTRIES

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
    """``name`` if the registry named ``registry`` (:data:`~geofm.registry.REGISTRIES`) has it, else ValueError
    with the nearest names.

    The registries' modules import torch, so names are checked with the architecture (second pass).
    """
    if not checks_architecture(info):
        return name
    return REGISTRIES.get(registry).check(name)


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
        return _registered(name, info, "server-optimizers")

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
        return _registered(name, info, "aggregators")

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
    (``adaptive``: ASAM); see :mod:`geofm.federated.local.sharpness`. It composes with every algorithm."""

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
    """Client-level differential privacy of the model updates (see :mod:`geofm.federated.privacy.client_level`).

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
        return REGISTRIES.get("algorithms").check(name)

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
