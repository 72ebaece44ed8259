"""The config tree: typed sections, YAML and dotted overrides, checks, veRL aliases and --help.

    from fastcredit.config import TrainConfig, load_config
    cfg = load_config("configs/criticsearch.yaml", ["credit.estimator=cwgrpo"])

Sections are declared in ``schema`` (and ``credit``, ``loss``, ``toy``), each field with its help
and, for a number, its range (``fields.opt``, ``ranges``); loaded by ``load``, checked by ``checks``;
``aliases`` maps veRL / Search-R1 keys, ``command_line`` builds every command's parser (argparse),
``help`` prints ``--help``. This package imports nothing else of fastcredit, so every command can
read its config first; what the chosen estimator needs is checked by ``fastcredit.credit.needs``.
"""
from fastcredit.config.credit import CreditConfig
from fastcredit.config.errors import ConfigError, ConfigPathError
from fastcredit.config.command_line import command_parser
from fastcredit.config.load import all_keys, config_drift, dump_yaml, load_config, save_config, to_dict, validate
from fastcredit.config.loss import LossConfig
from fastcredit.config.schema import (DataConfig, DistributedConfig, EvalConfig, GuardConfig, JudgesConfig,
                                      LoggingConfig, ModelConfig, OptimConfig, ProceedRolloutConfig,
                                      RetrievalConfig, RolloutConfig, TrainConfig, WarmStartConfig)
from fastcredit.config.toy import ToyWorldConfig

__all__ = ["ConfigError", "ConfigPathError", "CreditConfig", "DataConfig", "DistributedConfig",
           "EvalConfig", "GuardConfig", "JudgesConfig", "LoggingConfig", "LossConfig", "ModelConfig", "OptimConfig",
           "ProceedRolloutConfig", "RetrievalConfig", "RolloutConfig", "ToyWorldConfig", "TrainConfig",
           "WarmStartConfig", "all_keys", "command_parser", "config_drift", "dump_yaml", "load_config", "save_config",
           "to_dict", "validate"]
