"""The job configuration: nested typed dataclasses (sections), TOML files, ``--section.key=value`` overrides,
presets (load), and the checks run before any worker starts (validate).

Resolution order (later wins): defaults -> model preset -> TOML file -> command-line overrides.
Every field's docstring is its ``--help`` text. ``validate`` names the bad setting together with a valid value.
"""

from plait.config.load import field_docs, from_dict, load_config, options_help, to_dict, to_toml
from plait.config.sections import (
    LORA_TARGETS,
    SECTIONS,
    CheckpointConfig,
    CompileConfig,
    Config,
    DataConfig,
    EvalConfig,
    FinetuneConfig,
    GuardConfig,
    LineageConfig,
    LogConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    SampleConfig,
    TrainConfig,
)
from plait.config.validate import validate

__all__ = [
    "LORA_TARGETS", "SECTIONS", "CheckpointConfig", "CompileConfig", "Config", "DataConfig", "EvalConfig",
    "FinetuneConfig", "GuardConfig", "LineageConfig", "LogConfig", "OptimConfig", "ParallelConfig", "RunConfig",
    "SampleConfig", "TrainConfig", "field_docs", "from_dict", "load_config", "options_help", "to_dict", "to_toml",
    "validate",
]  # fmt: skip
