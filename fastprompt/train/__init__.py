"""Training: Trainer, configs, checkpoints, large-batch machinery, distributed helpers."""
