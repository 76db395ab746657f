"""Typed configuration: one dataclass schema per Hydra group (`schema`), their composition from `conf/` and the
command line (`compose`). A mistake raises `ConfigError`, one line naming the key, the value and what is valid."""

from ..errors import ConfigError
from .compose import (
                      CONF_DIR,
                      available_models,
                      compose_config,
                      compose_run_config,
                      load_model_config,
                      model_config_from_dict,
                      replace,
                      schema_keys,
                      split_tool_args,
)
from .schema import (
                      RUNTIME_MODEL_KEYS,
                      CheckpointConfig,
                      ClusterConfig,
                      DataConfig,
                      LoggingConfig,
                      ModelConfig,
                      MoEConfig,
                      OptimConfig,
                      ParallelConfig,
                      PeftConfig,
                      PrecisionConfig,
                      RunConfig,
                      TrainConfig,
                      VisionConfig,
                      WandbConfig,
                      parse_split,
)

__all__ = ["RunConfig", "ClusterConfig", "ParallelConfig", "TrainConfig", "DataConfig", "OptimConfig", "MoEConfig",
           "PrecisionConfig", "LoggingConfig", "WandbConfig", "CheckpointConfig", "ModelConfig", "VisionConfig",
           "PeftConfig", "ConfigError", "RUNTIME_MODEL_KEYS", "load_model_config", "model_config_from_dict",
           "available_models", "CONF_DIR", "replace", "compose_run_config", "compose_config", "parse_split",
           "schema_keys", "split_tool_args"]
