"""Training: Trainer, configs, checkpoints, large-batch machinery, distributed helpers.

- :class:`TrainConfig`, :func:`load_config` — the flat config (YAML + ``--set key=value`` overrides)
- :class:`Trainer` — ``Trainer(config).train()``: prompts, optimizer, schedule, eval, checkpoints, resume

Imported lazily, so that ``fastprompt -h`` (which registers ``fastprompt.train.cli``) loads no torch.
"""
import importlib

_LAZY = {
    "TrainConfig": "fastprompt.train.config",
    "load_config": "fastprompt.train.config",
    "parse_overrides": "fastprompt.train.config",
    "StepOutput": "fastprompt.train.trainer",
    "Trainer": "fastprompt.train.trainer",
    "TrainerState": "fastprompt.train.trainer",
    "TrainingDiverged": "fastprompt.train.trainer",
    "step_seed": "fastprompt.train.trainer",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fastprompt.train' has no attribute {name!r}")
