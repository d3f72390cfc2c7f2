"""Training: Trainer, configs, checkpoints, large-batch machinery, distributed helpers.

- :class:`TrainConfig`, :func:`load_config` — the flat config (YAML + ``--set key=value`` overrides)
- :class:`Trainer` — ``Trainer(config).train()``: prompts, optimizer, schedule, eval, checkpoints, resume
"""
from fastprompt.train.config import TrainConfig, load_config, parse_overrides
from fastprompt.train.trainer import StepOutput, Trainer, TrainerState, TrainingDiverged, step_seed

__all__ = ["StepOutput", "TrainConfig", "Trainer", "TrainerState", "TrainingDiverged", "load_config",
           "parse_overrides", "step_seed"]
