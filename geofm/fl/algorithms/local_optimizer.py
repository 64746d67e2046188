"""The clients' local optimiser: the one the algorithm's analysis assumes, unless the config chooses another.

SCAFFOLD's and FedDC's control variates, FedNova's normalisation and FedGloSS's inner loop are
derived for local SGD: option II's ``(x - y_i) / (K eta)`` is the mean corrected gradient only when
each step moves the model by ``eta`` times its gradient. Under AdamW a step moves each coordinate
by about ``eta`` whatever its gradient's size, so that estimate becomes the mean normalised step
direction, about 1 per coordinate, and the correction built from it swamps the loss's own gradient.
Each algorithm therefore declares its paper's local optimiser
(:attr:`~geofm.fl.algorithms.base.Algorithm.local_optimizer`); a run uses it unless
``train.optimizer`` is set, and then warns (:class:`LocalOptimizerWarning`) naming the algorithm,
what its analysis assumes and what the config chose. ``rounds.jsonl`` records the optimiser used
(``local_optimizer``).
"""

from __future__ import annotations

import warnings
from typing import Any

from geofm.config.federated import LocalOptimizerConfig, LocalTrainConfig
from geofm.errors import ConfigError
from geofm.fl.algorithms import ALGORITHMS

ADAMW = LocalOptimizerConfig(name="adamw")
"""The local optimiser of algorithms that assume none: AdamW with ``train``'s settings."""


class LocalOptimizerWarning(UserWarning):
    """The config overrides the local optimiser an algorithm's analysis assumes."""


def _filled(spec: LocalOptimizerConfig, train: LocalTrainConfig, where: str) -> LocalOptimizerConfig:
    """``spec`` with ``base_lr`` and ``weight_decay`` taken from ``train`` where it leaves them null."""
    if spec.base_lr is None and spec.name != "adamw":
        raise ConfigError(
            f"{where}: {spec.name} needs base_lr (train.base_lr is AdamW's, and SGD's rate is orders of "
            "magnitude larger)"
        )
    return spec.model_copy(
        update={
            "base_lr": train.base_lr if spec.base_lr is None else spec.base_lr,
            "weight_decay": train.weight_decay if spec.weight_decay is None else spec.weight_decay,
        }
    )


def declared(algorithm: str) -> LocalOptimizerConfig | None:
    """The local optimiser algorithm ``algorithm`` declares (None: it assumes none)."""
    return ALGORITHMS.get(algorithm).local_optimizer


def resolve(train: LocalTrainConfig, algorithm: str) -> LocalOptimizerConfig:
    """The local optimiser of a run, every field set: ``train.optimizer``'s explicit fields over the
    algorithm's declaration when both name the same optimiser, else over ``train``'s AdamW settings.

    Raises:
        ConfigError: an SGD chosen without a learning rate of its own.
    """
    own = declared(algorithm)
    chosen = train.optimizer
    if chosen is None:
        return _filled(own or ADAMW, train, f"algorithm {algorithm}'s local optimiser")
    base = own if own is not None and own.name == chosen.name else LocalOptimizerConfig(name=chosen.name)
    explicit = {key: getattr(chosen, key) for key in chosen.model_fields_set}
    return _filled(LocalOptimizerConfig(**{**base.model_dump(), **explicit}), train, "train.optimizer")


def override(train: LocalTrainConfig, algorithm: str) -> str | None:
    """What a warning says when ``train.optimizer`` departs from the algorithm's declared optimiser; None
    when the algorithm declares none, the config sets none, or it sets the declared one."""
    own = declared(algorithm)
    if own is None or train.optimizer is None:
        return None
    assumed, chosen = _filled(own, train, algorithm), resolve(train, algorithm)
    if assumed == chosen:
        return None
    source = ALGORITHMS.get(algorithm).local_optimizer_source
    return (
        f"algorithm {algorithm}: its analysis assumes local {assumed.describe()}"
        f"{f' ({source})' if source else ''}; train.optimizer chooses {chosen.describe()}"
    )


def warn_override(train: LocalTrainConfig, algorithm: str) -> None:
    """Warn (:class:`LocalOptimizerWarning`) if ``train.optimizer`` overrides the algorithm's declared optimiser."""
    note = override(train, algorithm)
    if note is not None:
        warnings.warn(note, LocalOptimizerWarning, stacklevel=2)


def record(spec: LocalOptimizerConfig) -> dict[str, Any]:
    """The optimiser as ``rounds.jsonl`` records it: name, base_lr, momentum (SGD), weight_decay."""
    fields = spec.model_dump()
    if spec.name != "sgd":
        fields.pop("momentum")
    return fields


def check_resumed(last_round: dict[str, Any] | None, current: dict[str, Any], algorithm: str, where: str) -> None:
    """Refuse to resume a run under another local optimiser than its rounds trained with.

    ``last_round`` is the run's last ``rounds.jsonl`` record (None: no round yet); a record without
    ``local_optimizer`` was written before algorithms declared theirs, when every client used AdamW.

    Raises:
        ConfigError: the optimiser's name differs, naming the setting that continues the run as it began.
    """
    if last_round is None:
        return
    before = last_round.get("local_optimizer", {"name": ADAMW.name})
    if before.get("name") == current["name"]:
        return
    raise ConfigError(
        f"{where}: this run's clients trained with local {before.get('name')}, and algorithm {algorithm} now "
        f"trains them with {current['name']}; set train.optimizer: {{name: {before.get('name')}}} to continue the "
        "run as it began, or start a new run (another run.output_dir)"
    )


def with_weight_decay(groups: list[dict] | None, weight_decay: float) -> list[dict] | None:
    """Parameter groups whose decayed groups take ``weight_decay`` (groups without decay keep none); None
    (the engine's default groups, which take the optimiser's weight decay) stays None."""
    if groups is None:
        return None
    return [{**group, "weight_decay": weight_decay if group.get("weight_decay") else 0.0} for group in groups]


__all__ = ["ADAMW", "LocalOptimizerWarning", "declared", "override", "record", "resolve", "warn_override"]
