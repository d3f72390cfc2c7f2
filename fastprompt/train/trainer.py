"""The training loop: deep prompts on a frozen encoder, trained with an in-batch contrastive objective.

One optimisation step is four separable stages so the large-batch machinery can replace the middle two::

    seed_step(step)            # torch RNG := f(seed, step): dropout of a step is replayable
    emb = embed(batch)         # (n_views, B, hidden) pooled embeddings, with graph
    out = compute_loss(emb)    # objective on embeddings only (no model inside)
    backward(out.loss)         # then optimizer_step(): unscale, clip, step, schedule

With ``micro_batch_size`` / ``max_tokens_per_micro_batch`` the middle stages run as a gradient-cache step
(:mod:`fastprompt.train.grad_cache`); under ``torchrun`` every process trains on its shard of each global
batch with negatives gathered from all processes (:mod:`fastprompt.train.distributed`).

Checkpoints: ``<output_dir>/last/`` (prompt + optimizer/scheduler/scaler/RNG/data position, written every
``save_steps`` and on SIGINT/SIGTERM) and ``<output_dir>/best/`` (prompt of the best STS-B dev score). Both
are prompt checkpoints loadable with :meth:`PromptEncoder.load`, written into a temporary folder and renamed
into place. ``train()`` returns the summary also written to ``<output_dir>/summary.json``.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fastprompt.data import Batch, Collator, TrainExamples, UniqueBatchSampler, load_train_file, sentence_keys
from fastprompt.io import atomic_directory, recover_directory, write_json_atomic
from fastprompt.objectives import ObjectiveOutput, build_objective
from fastprompt.train.config import TrainConfig, load_config, save_config
from fastprompt.train.distributed import GlobalBatchObjective, init_distributed
from fastprompt.train.grad_cache import grad_cache_step
from fastprompt.train.logs import MetricsLog, add_file_handler, remove_file_handler
from fastprompt.train.signals import GracefulInterrupt
from fastprompt.train.state import has_training_state, load_training_state, save_training_state

logger = logging.getLogger(__name__)

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Keys whose change makes a checkpoint in output_dir belong to another run (resuming would mix two runs).
_RUN_IDENTITY_KEYS = ("model", "pooler", "mlp", "prompt_length", "prefix_projection", "projection_hidden_size",
                      "shared_across_layers", "input_layer_only", "cls_prompt", "objective", "train_file",
                      "batch_size", "seed", "max_length")


class TrainingDiverged(RuntimeError):
    """Raised after ``max_nonfinite_steps`` consecutive non-finite losses/gradients (checkpoints are intact)."""


@dataclass
class TrainerState:
    """Counters saved with ``last``; ``(epoch, batch_in_epoch)`` is the data position of the next step."""

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    best_score: float | None = None
    best_step: int | None = None
    nonfinite_streak: int = 0
    nonfinite_total: int = 0
    train_seconds: float = 0.0
    dev_history: list = field(default_factory=list)  # [[step, stsb_dev], ...]


@dataclass
class StepOutput:
    loss: float
    stats: dict[str, float]
    grad_norm: float | None
    skipped: bool
    tokens: int
    seconds: float = 0.0


def step_seed(seed: int, step: int) -> int:
    """The torch seed of one optimisation step (a pure function, so any step's dropout can be replayed)."""
    return int(np.random.SeedSequence([int(seed), int(step)]).generate_state(1, dtype=np.uint64)[0] >> 1)


def linear_schedule(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Linear warmup from 0 to 1 over ``warmup_steps``, then linear decay to 0 at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


class _NullLog:
    """Metrics sink of the non-main processes (only the main process writes logs)."""

    def write(self, row):
        pass

    def close(self):
        pass


class Trainer:
    """``Trainer(config).train()`` trains deep prompts; see the module docstring for the step structure.

    Args:
        config: a :class:`TrainConfig`, a dict of its keys, or a YAML path.
        encoder: an already-built :class:`~fastprompt.model.PromptEncoder` to train (default: built from the
            config; on resume its prompt is reloaded from ``last``).
        examples: training rows (default: read from ``config.train_file``).
        callbacks: functions ``fn(trainer, step_output)`` called after every step (for monitoring/tests).
    """

    def __init__(self, config: TrainConfig | dict | str | Path, *, encoder=None,
                 examples: TrainExamples | None = None,
                 callbacks: list[Callable[["Trainer", StepOutput], None]] | None = None):
        if isinstance(config, (str, Path)):
            config = load_config(config)
        elif isinstance(config, dict):
            config = TrainConfig.from_dict(config)
        self.config = config.validate()
        self.output_dir = Path(config.output_dir)
        self.encoder = encoder
        self.examples = examples
        self.callbacks = list(callbacks or [])
        self.state = TrainerState()
        self.interrupt: GracefulInterrupt | None = None
        self._setup_done = False

    # ------------------------------------------------------------------ paths
    @property
    def last_dir(self) -> Path:
        return self.output_dir / "last"

    @property
    def best_dir(self) -> Path:
        return self.output_dir / "best"

    @property
    def log_path(self) -> Path:
        return self.output_dir / "train_log.csv"

    @property
    def summary_path(self) -> Path:
        return self.output_dir / "summary.json"

    # ------------------------------------------------------------------ setup
    def _device(self) -> torch.device:
        dev = self.config.device
        if dev == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={dev!r} but CUDA is not available; use device=cpu or auto")
        return torch.device(dev)

    def _resume_dir(self) -> Path | None:
        """``last`` when this run continues a previous one, None for a fresh start (validating output_dir)."""
        cfg = self.config
        last = recover_directory(self.last_dir)
        has_last = last.is_dir() and has_training_state(last)
        if has_last and cfg.resume:
            return last
        if has_last or (self.best_dir.exists() and not cfg.resume):
            if not cfg.overwrite_output_dir:
                raise ValueError(
                    f"{self.output_dir} already holds a training run; set resume=true to continue it, "
                    "overwrite_output_dir=true to start over, or choose another output_dir")
            for d in (self.last_dir, self.best_dir):
                shutil.rmtree(d, ignore_errors=True)
            for f in (self.log_path, self.summary_path):
                f.unlink(missing_ok=True)
        return None

    def setup(self) -> None:
        """Load data, model, objective, optimizer and schedule; restore ``last`` when resuming."""
        if self._setup_done:
            return
        cfg = self.config
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._log_handler = add_file_handler(self.output_dir / "train.log")
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.dist = init_distributed(self.config.device if self.config.device != "auto" else None)
        self.device = self.dist.device if self.dist.enabled else self._device()
        if self.dist.enabled and cfg.batch_size % self.dist.world_size:
            raise ValueError(f"batch_size={cfg.batch_size} (the global batch) must be divisible by the "
                             f"{self.dist.world_size} processes")
        resume_dir = self._resume_dir()
        if resume_dir is not None:
            self._check_same_run(resume_dir)

        if self.examples is None:
            self.examples = load_train_file(cfg.train_file, fmt=cfg.train_format,
                                            on_decode_error=cfg.on_decode_error)
        ex = self.examples
        logger.info("training data: %d rows of %s from %s", len(ex), "/".join(ex.columns), ex.source or "memory")
        # Every process plans the same global batches and trains on its own equal shard of each.
        self.sampler = UniqueBatchSampler(sentence_keys(ex.rows), cfg.batch_size, seed=cfg.seed,
                                          drop_last=cfg.drop_last or self.dist.enabled)
        if self.sampler.num_batches(0) == 0:
            raise ValueError(f"{len(ex)} training rows make no batch of batch_size={cfg.batch_size} "
                             f"(drop_last={cfg.drop_last}); use a smaller batch_size or more data")

        torch.manual_seed(cfg.seed)  # prompt initialisation
        if self.encoder is None:
            self.encoder = self._build_encoder(resume_dir)
        elif resume_dir is not None:
            from fastprompt.model.checkpoint import load_checkpoint_weights, read_checkpoint_config

            load_checkpoint_weights(self.encoder, resume_dir, read_checkpoint_config(resume_dir))
        self.encoder.to(self.device).train()
        if cfg.gradient_checkpointing:
            self.encoder.gradient_checkpointing_enable()
        self.model = self.dist.wrap(self.encoder)  # DDP under torchrun, the encoder itself otherwise
        self.params = [p for p in self.encoder.trainable_parameters()]
        if not self.params:
            raise ValueError("the encoder has no trainable parameters (no prompt and no pooler head)")
        logger.info("trainable parameters: %d (%.3f%% of %d)", sum(p.numel() for p in self.params),
                    100.0 * sum(p.numel() for p in self.params) / sum(p.numel() for p in self.encoder.parameters()),
                    sum(p.numel() for p in self.encoder.parameters()))
        self.collator = Collator(self.encoder.tokenize, cfg.max_length)
        obj_params = {k: v for k, v in cfg.to_dict().items() if v is not None}
        obj_params["backend"] = cfg.loss_backend
        self.objective = build_objective(cfg.objective, **obj_params)
        self.global_objective = GlobalBatchObjective(self.objective, self.dist)

        self.total_steps = self._total_steps()
        warmup = cfg.warmup_steps or int(math.ceil(cfg.warmup_ratio * self.total_steps))
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, linear_schedule(warmup, self.total_steps))
        self.scaler = (torch.amp.GradScaler(self.device.type) if cfg.precision == "fp16" else None)
        self.autocast_dtype = _AUTOCAST_DTYPES.get(cfg.precision)

        self.dev_data = None
        if cfg.sts_dir is not None:
            from fastprompt.eval.sts import load_sts_tasks

            self.dev_data = load_sts_tasks(cfg.sts_dir, ["stsb"], stsb_split="dev")
        else:
            logger.warning("no sts_dir: no STS-B dev evaluation, best/ will hold the final prompt")

        if resume_dir is not None:
            saved = load_training_state(resume_dir, optimizer=self.optimizer, scheduler=self.scheduler,
                                        scaler=self.scaler)
            self.state = TrainerState(**saved["state"])
            logger.info("resumed from %s at step %d (epoch %d, batch %d)", resume_dir, self.state.global_step,
                        self.state.epoch, self.state.batch_in_epoch)
        if self.dist.is_main:
            save_config(cfg, self.output_dir / "config.yaml")
        self.metrics = _NullLog() if not self.dist.is_main else MetricsLog(self.output_dir, resume_step=self.state.global_step if resume_dir else None,
                                  tensorboard=cfg.tensorboard)
        self._setup_done = True

    def _build_encoder(self, resume_dir: Path | None):
        from fastprompt.model import PromptEncoder

        cfg = self.config
        if resume_dir is not None:
            return PromptEncoder.from_pretrained(cfg.model, prompt=resume_dir, attn_backend=cfg.attn_backend,
                                                 prefix_mode=cfg.prefix_mode)
        return PromptEncoder.from_pretrained(cfg.model, prompt_config=cfg.prompt_config_dict(), pooler=cfg.pooler,
                                             mlp=cfg.mlp, attn_backend=cfg.attn_backend, prefix_mode=cfg.prefix_mode)

    def _check_same_run(self, resume_dir: Path) -> None:
        from fastprompt.train.state import read_training_state

        _, meta = read_training_state(resume_dir)
        before = meta["trainer"].get("config", {})
        now = self.config.to_dict()
        changed = [k for k in _RUN_IDENTITY_KEYS if k in before and before[k] != now[k]]
        if changed:
            diffs = ", ".join(f"{k}: {before[k]!r} -> {now[k]!r}" for k in changed)
            raise ValueError(f"{resume_dir} was written by a run with a different configuration ({diffs}); "
                             "use another output_dir, or resume=false overwrite_output_dir=true to start over")
        other = [k for k in now if k in before and before[k] != now[k] and k not in ("resume", "overwrite_output_dir")]
        if other:
            logger.warning("resuming with changed settings: %s", ", ".join(f"{k}={now[k]!r}" for k in other))

    def _total_steps(self) -> int:
        cfg = self.config
        if cfg.max_steps > 0:
            return cfg.max_steps
        full, frac = int(cfg.epochs), cfg.epochs - int(cfg.epochs)
        total = sum(self.sampler.num_batches(e) for e in range(full))
        if frac > 0:
            total += int(frac * self.sampler.num_batches(full))
        if total == 0:
            raise ValueError(f"epochs={cfg.epochs} of {self.sampler.num_batches(0)} batches is less than one step")
        return total

    # ------------------------------------------------------------------ one step
    def seed_step(self, step: int) -> None:
        seed = step_seed(self.config.seed, step)
        if self.dist.enabled:  # each process draws its own dropout masks
            seed = step_seed(seed, self.dist.rank)
        torch.manual_seed(seed)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def embed(self, batch: Batch) -> torch.Tensor:
        """Pooled embeddings of every view, (n_views, B, hidden), with graph."""
        with self.autocast():
            emb = self.model(**batch.model_inputs())
        return emb.view(batch.n_views, batch.batch_size, -1)

    def compute_loss(self, embeddings: torch.Tensor) -> ObjectiveOutput:
        """The objective on (n_views, local batch, hidden) embeddings; columns span all processes."""
        return self.global_objective(embeddings.float())

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def training_step(self, batch: Batch) -> ObjectiveOutput:
        """Forward, loss and backward of one batch; leaves gradients in ``.grad`` (not applied).

        A non-finite loss is returned without a backward pass.
        """
        cfg = self.config
        if cfg.gradient_cache:
            res = grad_cache_step(
                self.model, batch.model_inputs(),
                lambda reps: self.compute_loss(reps.view(batch.n_views, batch.batch_size, -1)),
                micro_batch_size=cfg.micro_batch_size or None, max_tokens=cfg.max_tokens_per_micro_batch or None,
                loss_scale=self.scaler.scale if self.scaler is not None else None, autocast=self.autocast,
                no_sync=self.dist.no_sync(self.model))
            return res.output
        out = self.compute_loss(self.embed(batch))
        if torch.isfinite(out.loss):
            self.backward(out.loss)
        return out

    def optimizer_step(self) -> tuple[float | None, bool]:
        """Unscale, clip, step. Returns (gradient norm, applied); a non-finite gradient skips the update."""
        cfg = self.config
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if cfg.max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None])))
        if self.scaler is not None:
            # the scaler skips the update itself on inf/nan (a normal event while it calibrates its scale)
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            return norm, self.scaler.get_scale() >= scale
        if not math.isfinite(norm):
            return norm, False
        self.optimizer.step()
        return norm, True

    def _run_step(self, batch: Batch) -> StepOutput:
        self.seed_step(self.state.global_step)
        self.optimizer.zero_grad(set_to_none=True)
        out = self.training_step(batch)
        loss = float(self.dist.mean(out.loss.detach()))  # the global-batch loss, the same on every process
        grad_norm, applied = None, False
        if math.isfinite(loss):
            grad_norm, applied = self.optimizer_step()
        nonfinite = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)
                                               and self.scaler is None)
        self.scheduler.step()  # the learning rate follows the step count even over a skipped step
        self.optimizer.zero_grad(set_to_none=True)
        if nonfinite:
            self.state.nonfinite_streak += 1
            self.state.nonfinite_total += 1
            logger.warning("step %d: non-finite %s (%s); skipped the update (%d in a row, limit %d)",
                           self.state.global_step + 1, "loss" if not math.isfinite(loss) else "gradient",
                           loss if not math.isfinite(loss) else grad_norm, self.state.nonfinite_streak,
                           self.config.max_nonfinite_steps)
        else:
            self.state.nonfinite_streak = 0
        return StepOutput(loss, out.stats, grad_norm, skipped=not applied, tokens=batch.num_tokens)

    # ------------------------------------------------------------------ evaluation and checkpoints
    def evaluate_dev(self) -> float | None:
        """STS-B dev Spearman x 100 of the current prompt (None without ``sts_dir``)."""
        if self.dev_data is None:
            return None
        from fastprompt.eval.sts import score_sts

        with self.autocast():
            result = score_sts(self.encoder, self.dev_data, batch_size=self.config.eval_batch_size,
                               show_progress_bar=False)
        self.encoder.train()
        return float(result["stsb"])

    def _local_rows(self, rows: list[int]) -> list[int]:
        """This process's shard of a global batch (all of it in a single process)."""
        if not self.dist.enabled:
            return rows
        n = len(rows) // self.dist.world_size
        return rows[self.dist.rank * n:(self.dist.rank + 1) * n]

    def _trainer_state_dict(self) -> dict[str, Any]:
        return {"state": self.state.__dict__.copy(), "config": self.config.to_dict(),
                "total_steps": self.total_steps}

    def save_last(self) -> Path:
        """Write ``last/``: prompt checkpoint + everything needed to resume exactly (main process only)."""
        self._last_saved_step = self.state.global_step
        if not self.dist.is_main:
            return self.last_dir
        with atomic_directory(self.last_dir) as tmp:
            self.encoder.save(tmp)
            save_training_state(tmp, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                                trainer=self._trainer_state_dict())
        self._last_saved_step = self.state.global_step
        return self.last_dir

    def save_best(self, score: float | None) -> Path:
        if not self.dist.is_main:
            return self.best_dir
        with atomic_directory(self.best_dir) as tmp:
            self.encoder.save(tmp)
            write_json_atomic(tmp / "train_info.json", {"step": self.state.global_step, "stsb_dev": score,
                                                        "config": self.config.to_dict()})
        return self.best_dir

    def _evaluate_and_select(self, bar) -> float | None:
        score = self.evaluate_dev() if self.dist.is_main else None
        if score is None:
            return None
        st = self.state
        st.dev_history.append([st.global_step, score])
        improved = st.best_score is None or score > st.best_score
        if improved:
            st.best_score, st.best_step = score, st.global_step
            self.save_best(score)
        logger.info("step %d: STS-B dev %.2f (best %.2f at step %d)%s", st.global_step, score, st.best_score,
                    st.best_step, " -> saved best/" if improved else "")
        self.metrics.write({"step": st.global_step, "epoch": st.epoch, "stsb_dev": score,
                            "elapsed_s": st.train_seconds})
        bar.set_postfix_str(self._postfix(None, score), refresh=False)
        self._last_dev = score
        return score

    def _postfix(self, loss: float | None, dev: float | None) -> str:
        parts = []
        if loss is not None:
            parts.append(f"loss={loss:.4f}")
        dev = dev if dev is not None else getattr(self, "_last_dev", None)
        if dev is not None:
            parts.append(f"dev={dev:.2f}")
        return " ".join(parts)

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Train to ``max_steps``/``epochs``; returns the summary (also written to ``summary.json``)."""
        self.setup()
        cfg, st = self.config, self.state
        status = "completed"
        self._last_saved_step = st.global_step if st.global_step else None
        save_every = cfg.save_steps or cfg.eval_steps
        show = cfg.progress_bar if cfg.progress_bar is not None else sys.stderr.isatty()
        bar = tqdm(total=self.total_steps, initial=st.global_step, desc="train", disable=not show,
                   dynamic_ncols=True)
        window: list[StepOutput] = []
        try:
            with GracefulInterrupt() as self.interrupt:
                if cfg.eval_at_start and st.global_step == 0:
                    self._evaluate_and_select(bar)
                while st.global_step < self.total_steps and status == "completed":
                    for b_idx, rows in self.sampler.iter_from(st.epoch, st.batch_in_epoch):
                        t0 = time.perf_counter()
                        rows = self._local_rows(rows)
                        batch = self.collator([self.examples.rows[i] for i in rows]).to(self.device)
                        out = self._run_step(batch)
                        st.global_step += 1
                        st.batch_in_epoch = b_idx + 1
                        out.seconds = time.perf_counter() - t0
                        st.train_seconds += out.seconds
                        window.append(out)
                        bar.update(1)
                        for cb in self.callbacks:
                            cb(self, out)
                        if st.global_step % cfg.log_every == 0 or st.global_step == self.total_steps:
                            self._log_window(window)
                            bar.set_postfix_str(self._postfix(np.mean([w.loss for w in window]), None),
                                                refresh=False)
                            window = []
                        if st.nonfinite_streak >= cfg.max_nonfinite_steps:
                            status = "diverged"
                        elif st.global_step % cfg.eval_steps == 0 or st.global_step == self.total_steps:
                            self._evaluate_and_select(bar)
                        if st.global_step % save_every == 0 and status == "completed":
                            self.save_last()
                        if self.interrupt.requested:
                            status = "interrupted"
                        if status != "completed" or st.global_step >= self.total_steps:
                            break
                    else:  # epoch finished
                        st.epoch += 1
                        st.batch_in_epoch = 0
                if window:
                    self._log_window(window)
                # a skipped (non-finite) step never changes the prompt, so last/ stays a valid resume point
                if self._last_saved_step != st.global_step:
                    self.save_last()
        except BaseException:  # a second Ctrl-C or an error: release the log files, keep the checkpoints
            self._close_logs()
            raise
        finally:
            bar.close()
        if status == "interrupted":
            logger.warning("training interrupted at step %d; resume with the same command (last checkpoint: %s)",
                           st.global_step, self.last_dir)
        summary = self._finish(status)
        if status == "diverged":
            raise TrainingDiverged(
                f"stopped at step {st.global_step} after {st.nonfinite_streak} consecutive non-finite losses or "
                f"gradients (try a lower learning_rate or precision=fp32); checkpoints in {self.output_dir} "
                "hold the last finite prompt")
        return summary

    def _log_window(self, window: list[StepOutput]) -> None:
        st = self.state
        finite = [w for w in window if math.isfinite(w.loss)]
        row: dict[str, Any] = {"step": st.global_step, "epoch": st.epoch, "lr": self.scheduler.get_last_lr()[0],
                               "skipped": sum(w.skipped for w in window), "elapsed_s": st.train_seconds,
                               "tokens_per_s": sum(w.tokens for w in window) / max(1e-9, sum(w.seconds for w in window))}
        if finite:
            row["loss"] = float(np.mean([w.loss for w in finite]))
            norms = [w.grad_norm for w in finite if w.grad_norm is not None and math.isfinite(w.grad_norm)]
            if norms:
                row["grad_norm"] = float(np.mean(norms))
            for key in finite[0].stats:
                row[key] = float(np.mean([w.stats[key] for w in finite]))
        self.metrics.write(row)
        logger.debug("step %d: %s", st.global_step, row)

    def _finish(self, status: str) -> dict[str, Any]:
        cfg, st = self.config, self.state
        if self.dev_data is None and status == "completed":
            self.save_best(None)  # no dev set: the final prompt is the one we have
        test = None
        if (status == "completed" and cfg.sts_dir is not None and cfg.final_eval and self.dist.is_main
                and self.best_dir.is_dir()):
            test = self.evaluate_test(self.best_dir)
        summary = {
            "status": status,
            "global_step": st.global_step,
            "total_steps": self.total_steps,
            "epoch": st.epoch,
            "best_stsb_dev": st.best_score,
            "best_step": st.best_step,
            "dev_history": st.dev_history,
            "test": test,
            "nonfinite_steps": st.nonfinite_total,
            "train_seconds": round(st.train_seconds, 2),
            "output_dir": str(self.output_dir),
            "best_checkpoint": str(self.best_dir) if self.best_dir.is_dir() else None,
            "last_checkpoint": str(self.last_dir),
            "log_csv": str(self.log_path),
            "config": cfg.to_dict(),
        }
        if self.dist.is_main:
            write_json_atomic(self.summary_path, summary)
        self.dist.barrier()
        self._release_distributed()
        self._close_logs()
        logger.info("training %s at step %d/%d; best: %s; last: %s; log: %s; summary: %s", status, st.global_step,
                    self.total_steps, summary["best_checkpoint"], self.last_dir, self.log_path, self.summary_path)
        return summary

    def _release_distributed(self) -> None:
        """Drop the DDP wrapper, then the process group init_distributed created (in that order: see
        DistributedContext.shutdown). The encoder stays usable, e.g. for evaluation."""
        if self.model is not self.encoder:
            self.model = self.encoder
            gc.collect()
        self.dist.shutdown()

    def _close_logs(self) -> None:
        if self._setup_done:
            self.metrics.close()
            remove_file_handler(self._log_handler)
            self._setup_done = False

    def evaluate_test(self, checkpoint: str | Path) -> dict[str, float]:
        """The seven-task STS test table of a prompt checkpoint (loaded into a copy of the current prompt)."""
        from fastprompt.eval.sts import evaluate_sts
        from fastprompt.model.checkpoint import load_checkpoint_weights, read_checkpoint_config

        current = {k: v.detach().clone() for k, v in self.encoder.prompt_state_dict().items()}
        load_checkpoint_weights(self.encoder, checkpoint, read_checkpoint_config(checkpoint))
        try:
            with self.autocast():
                results = evaluate_sts(self.encoder, self.config.sts_dir, batch_size=self.config.eval_batch_size)
        finally:
            self.encoder.load_state_dict(current, strict=False)
            self.encoder.train()
        return results
