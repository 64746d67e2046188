"""Typed configuration: one schema per program, built from shared sections.

A config is a YAML file plus optional ``key.path=value`` overrides, read and validated by the
program's schema (``PretrainConfig.from_file(path, overrides)``). Unknown keys, wrong types and
impossible combinations raise a single :class:`~geofm.errors.ConfigError` naming the file and every
offending field, before any work starts.
"""

from geofm.config.base import ProgramConfig, Section, config_to_dict, parse_overrides, read_config_tree, set_dotted
from geofm.config.pretrain import PretrainConfig
from geofm.config.sections import (
    BackboneConfig,
    MaskingConfig,
    OptimizerConfig,
    RunConfig,
    StudentConfig,
    TeacherConfig,
    TrainConfig,
)
from geofm.config.sources import DataConfig, SourceConfig
from geofm.data.bands import RGB

__all__ = [
    "RGB",
    "BackboneConfig",
    "DataConfig",
    "MaskingConfig",
    "OptimizerConfig",
    "PretrainConfig",
    "ProgramConfig",
    "RunConfig",
    "Section",
    "SourceConfig",
    "StudentConfig",
    "TeacherConfig",
    "TrainConfig",
    "config_to_dict",
    "parse_overrides",
    "read_config_tree",
    "set_dotted",
]
