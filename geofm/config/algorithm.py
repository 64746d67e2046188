"""The ``algorithm`` section of every federated config: what each side does and what travels each way.

``AlgorithmConfig`` names a registered algorithm (``geofm list algorithms``) and holds what every
algorithm shares: the codecs of each payload (``uplink``, ``downlink``), the server's upload
screening, its optimiser and aggregator, local SAM steps and client-level differential privacy; an
algorithm's own settings are its ``options``, checked by its ``Options`` model.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from geofm.config.base import MovedKeys, Section, checks_architecture, refuse_moved_keys
from geofm.registry import REGISTRIES, validated

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


class _RegisteredEntry(Section):
    """A section naming an entry of a registry whose module imports torch: the name, and the entry's own
    settings (``options``, checked by its ``Options`` model and its ``check``) with the architecture."""

    registry: ClassVar[str]
    """The registry's name in :data:`~geofm.registry.REGISTRIES` (its module imports torch)."""
    kind: ClassVar[str]
    """What the entries are, for messages."""
    moved: ClassVar[MovedKeys] = {}
    """Keys of configs written before the entries kept their settings in ``options``: the entries that
    read each, its name in their ``options`` and its default then."""

    name: str
    options: dict[str, Any] = Field(
        default_factory=dict, description="the entry's own settings, checked by the entry (geofm list ...)"
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str, info: ValidationInfo) -> str:
        return REGISTRIES.get(cls.registry).check(name) if checks_architecture(info) else name

    @model_validator(mode="before")
    @classmethod
    def _moved_to_options(cls, data: Any) -> Any:
        moved = {key: option for key, (_, option, _) in cls.moved.items()}
        return refuse_moved_keys(data, moved, f"the {cls.kind}'s own settings go in its options")

    @model_validator(mode="after")
    def _check_entry(self, info: ValidationInfo) -> _RegisteredEntry:
        if checks_architecture(info):
            registry = REGISTRIES.get(self.registry)
            registry.options(self.name, self.options, "options")
            entry = registry.get(self.name)
            if hasattr(entry, "check"):
                entry.check(self)
        return self

    def options_of(self) -> Any:
        """The entry's own settings: ``options`` validated by its ``Options`` model (None: it takes none)."""
        return REGISTRIES.get(self.registry).options(self.name, self.options, "options")


class ServerOptimizerConfig(_RegisteredEntry):
    """How the round's combined update ``Delta`` moves the global model (Reddi et al. 2021, Algorithm 2):
    a registered server optimiser (``geofm list server-optimizers`` prints each with its options)."""

    registry = "server-optimizers"
    kind = "server optimiser"
    moved: ClassVar[MovedKeys] = {
        "momentum": (("fedavgm",), "momentum", 0.9),
        "beta1": (("fedadam", "fedyogi"), "beta1", 0.9),
        "beta2": (("fedadam", "fedyogi"), "beta2", 0.99),
        "tau": (("fedadam", "fedyogi"), "tau", 1e-3),
    }

    name: str = Field(default="sgd", description="a registered server optimiser (geofm list server-optimizers)")
    lr: float | None = Field(
        default=None, gt=0.0, description="server learning rate; null: the optimiser's default (1.0 for sgd)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="the server optimiser's own settings (geofm list server-optimizers)"
    )


class AggregatorConfig(_RegisteredEntry):
    """How the server combines the accepted client updates: a registered aggregator (``geofm list
    aggregators`` prints each with its options), the weighted mean by default."""

    registry = "aggregators"
    kind = "aggregator"
    moved: ClassVar[MovedKeys] = {
        "trim_fraction": (("trimmed_mean",), "trim_fraction", 0.1),
        "byzantine_clients": (("krum",), "byzantine_clients", 0),
        "multi_krum": (("krum",), "multi_krum", None),
    }

    name: str = Field(default="mean", description="a registered aggregator (geofm list aggregators)")
    options: dict[str, Any] = Field(
        default_factory=dict, description="the aggregator's own settings (geofm list aggregators)"
    )


class SamConfig(Section):
    """The client optimiser's sharpness-aware step: each local gradient is taken at ``w + e`` and applied
    at ``w``, with ``e = rho g / ||g||`` (SAM) or ``e = rho T_w^2 g / ||T_w g||``, ``T_w = |w| + eta``
    (``adaptive``: ASAM); see :mod:`geofm.fl.local.sharpness`. It composes with every algorithm."""

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
    """Client-level differential privacy of the model updates (see :mod:`geofm.fl.privacy.client_level`).

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

    ``name`` picks a registered algorithm (``geofm list algorithms`` prints each with its summary and
    its options); its own settings are ``options``, checked by its ``Options`` model. What every
    algorithm shares lives here: ``sam`` makes any algorithm's local steps sharpness-aware;
    ``privacy`` clips and noises the clients' model updates (algorithms whose only upload is
    ``update`` and whose server averages it); ``aggregator`` and ``server_optimizer`` combine the
    uploads and step the global model (algorithms without a server rule of their own). Every
    payload can be quantised: ``uplink`` and ``downlink`` apply to each payload of their direction,
    ``uplink_payloads`` and ``downlink_payloads`` change fields for one named payload.
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
    server_optimizer: ServerOptimizerConfig = Field(default_factory=ServerOptimizerConfig.model_construct)
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig.model_construct)
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
        moved = {key: key for key in MOVED_TO_OPTIONS}
        return refuse_moved_keys(data, moved, "an algorithm's own settings go in algorithm.options")

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
