"""The training loop: deep prompts on a frozen encoder, trained with a method (an objective + token terms).

:meth:`Trainer.setup` builds the run from its config (:mod:`fastprompt.train.build`) and restores ``last/``
when resuming (:mod:`fastprompt.train.checkpoints`). One optimisation step::

    seed = seed_step(step)                 # torch RNG := f(seed, step, rank): a step's dropout is replayable
    batch = collate(rows) + term extras    # this process's shard of the global batch
    losses = training_step(batch, seed)    # PlainStep or CachedStep (fastprompt.train.steps), chosen at setup
    all_reduce_gradients(params)           # several processes: the sum of every process's share
    optimizer_step()                       # unscale, clip, step (skipped when non-finite); then the schedule

Under ``torchrun`` every process trains on its shard of each global batch (:mod:`fastprompt.train.distributed`).
Checkpoints: ``<output_dir>/last/`` (written every ``save_steps`` and on SIGINT/SIGTERM; resuming from it
continues bit for bit) and ``<output_dir>/best/`` (the prompt of the best STS-B dev score). ``train()`` returns
the summary also written to ``<output_dir>/summary.json``. Structure: ``docs/training.md``; objectives:
``docs/objectives.md``.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fastprompt.data import Batch, TrainExamples
from fastprompt.objectives.base import TokenTerm
from fastprompt.train import build, preflight
from fastprompt.train.backbone import check_resume_mode
from fastprompt.train.checkpoints import RunDirectory
from fastprompt.train.collapse import SPREAD_STAT, CollapseMonitor, embedding_spread
from fastprompt.train.config import TrainConfig, load_config, save_config
from fastprompt.train.distributed import init_distributed
from fastprompt.train.logs import MetricsLog, add_file_handler, csv_columns, remove_file_handler
from fastprompt.train.memory import ModelShape, available_bytes, check_step_memory
from fastprompt.train.progress import LoggedEncoder
from fastprompt.train.run_lock import RunLock
from fastprompt.train.signals import GracefulInterrupt
from fastprompt.train.state import load_training_state
from fastprompt.train.steps import LossSide, StepLosses, extras_generators, step_seed

logger = logging.getLogger(__name__)

__all__ = ["StepOutput", "Trainer", "TrainerState", "TrainingCollapsed", "TrainingDiverged", "step_seed"]

#: Distinct training sentences embedded at every log row to watch for collapse (fastprompt.train.collapse).
PROBE_SENTENCES = 32


class TrainingDiverged(RuntimeError):
    """Raised after ``max_nonfinite_steps`` consecutive non-finite losses/gradients (checkpoints are intact)."""


class TrainingCollapsed(TrainingDiverged):
    """Raised after ``collapse_patience`` consecutive log rows whose probe sentences all embed alike."""


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
    probe_spread_start: float | None = None  # emb_spread of the collapse probe before the first step


@dataclass
class StepOutput:
    loss: float
    stats: dict[str, float]
    grad_norm: float | None
    skipped: bool
    tokens: int
    seconds: float = 0.0


class _NullLog:
    """Metrics sink of the non-main processes (only the main process writes logs)."""

    def write(self, row):
        pass

    def close(self):
        pass


class Trainer:
    """``Trainer(config).train()`` trains deep prompts; see the module docstring for the step structure.

    Args:
        config: a :class:`TrainConfig`, a dict of its flat keys, or a YAML path.
        encoder: an already-built :class:`~fastprompt.model.PromptEncoder` to train (default: built from the
            config; on resume its prompt is reloaded from ``last``).
        examples: training rows (default: read from ``config.train_file``).
        terms: token-level objective terms (:class:`~fastprompt.objectives.TokenTerm`) added to the config's
            sentence-level objective.
        callbacks: functions ``fn(trainer, step_output)`` called after every step (for monitoring/tests).
    """

    def __init__(self, config: TrainConfig | dict | str | Path, *, encoder=None,
                 examples: TrainExamples | None = None, terms: Sequence[TokenTerm] = (),
                 callbacks: list[Callable[["Trainer", StepOutput], None]] | None = None):
        if isinstance(config, (str, Path)):
            config = load_config(config)
        elif isinstance(config, dict):
            config = TrainConfig.from_dict(config)
        self.config = config.validate()
        self.run_dir = RunDirectory(config.run.output_dir)
        self.output_dir = self.run_dir.root
        self.encoder = encoder
        self.examples = examples
        self.terms = list(terms)
        self.callbacks = list(callbacks or [])
        self.state = TrainerState()
        self.interrupt: GracefulInterrupt | None = None
        self.metrics = None
        self._log_handler: logging.Handler | None = None
        self._lock: RunLock | None = None
        self._setup_done = False

    @property
    def last_dir(self) -> Path:
        return self.run_dir.last

    @property
    def best_dir(self) -> Path:
        return self.run_dir.best

    @property
    def log_path(self) -> Path:
        return self.run_dir.log_csv

    @property
    def summary_path(self) -> Path:
        return self.run_dir.summary

    @property
    def objective(self):
        """The method's sentence-level objective."""
        return self.method.sentence

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Load data, model, method, optimizer and schedule; restore ``last`` when resuming."""
        if self._setup_done:
            return
        cfg = self.config
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        self.dist = init_distributed(cfg.run.device)  # a device this machine lacks fails here, before any loading
        if self.dist.is_main:  # one run per output_dir: a second one is refused before it writes anything
            preflight.check_output_dir(self.output_dir)
            self._lock = RunLock(self.output_dir).acquire()
        try:
            self._setup(cfg)
        except BaseException:
            self._release_run()
            raise
        self._setup_done = True

    def _setup(self, cfg: TrainConfig) -> None:
        # train.log is the main process's (the output folder is only made by it, in setup)
        self._log_handler = add_file_handler(self.run_dir.log_text) if self.dist.is_main else None
        self.device = self.dist.device
        resume_dir = self.run_dir.resume_point(resume=cfg.run.resume, overwrite=cfg.run.overwrite_output_dir)
        if resume_dir is not None:
            check_resume_mode(resume_dir, cfg)
            self.run_dir.check_same_run(resume_dir, cfg.to_dict())

        if self.examples is None:
            self.examples = build.load_examples(cfg)
        self.sampler = build.build_sampler(cfg, self.examples, self.dist)
        self.probe = list(dict.fromkeys(row[0] for row in self.examples.rows))[:PROBE_SENTENCES]
        self.total_steps = build.count_total_steps(cfg, self.sampler)

        torch.manual_seed(cfg.run.seed)  # prompt initialisation
        self._build_model(resume_dir)
        preflight.check_max_length(cfg, self.encoder)
        self.collator = build.build_collator(cfg, self.encoder, self.examples, self.method)
        if cfg.large_batch.check_memory:
            self._check_memory()
        opt = build.build_optimization(cfg, self.params, self.total_steps, self.device, encoder=self.encoder)
        self.optimizer, self.scheduler, self.scaler = opt.optimizer, opt.scheduler, opt.scaler
        self.autocast = build.autocast_factory(cfg, self.device)
        loss_side = LossSide(self.method, self.encoder, self.dist, autocast=self.autocast,
                             loss_scale=self.scaler.scale if self.scaler is not None else None,
                             embed=build.build_embed(cfg, self.encoder, self.examples, self.method))
        self.step = build.build_step(cfg, loss_side)
        self.dev_data = build.load_dev_data(cfg)
        preflight.check_sts_files(cfg)  # the final evaluation's files, read now rather than after training

        if resume_dir is not None:
            saved = load_training_state(resume_dir, optimizer=self.optimizer, scheduler=self.scheduler,
                                        scaler=self.scaler)
            self.state = TrainerState(**saved["state"])
            logger.info("resumed from %s at step %d (epoch %d, batch %d)", resume_dir, self.state.global_step,
                        self.state.epoch, self.state.batch_in_epoch)
            self._warn_if_schedule_moved()
        if self.dist.is_main:
            save_config(cfg, self.run_dir.config_yaml)
            self.metrics = MetricsLog(self.output_dir, resume_step=self.state.global_step if resume_dir else None,
                                      tensorboard=cfg.run.tensorboard,
                                      columns=csv_columns(self.method.log_columns()))
        else:
            self.metrics = _NullLog()

    def _build_model(self, resume_dir: Path | None) -> None:
        """The encoder and the method on the device, their trainable parameters the same on every process."""
        if self.encoder is None:
            self.encoder = build.build_encoder(self.config, resume_dir)
        elif resume_dir is not None:
            from fastprompt.model.checkpoint import load_checkpoint_weights, read_checkpoint_config

            load_checkpoint_weights(self.encoder, resume_dir, read_checkpoint_config(resume_dir))
        self.encoder.to(self.device).train()
        if self.config.backbone.train_backbone:
            self.encoder.train_backbone()
        if self.config.large_batch.gradient_checkpointing:
            self.encoder.gradient_checkpointing_enable()
        if self.config.run.compile:  # in place: parameter names, checkpoints and the module stay as they are
            self.encoder.compile()
        self.method = build.build_method(self.config, self.encoder, self.terms).to(self.device).train()
        if resume_dir is not None:
            RunDirectory.load_method(self.method, resume_dir)
        self.params = self.encoder.trainable_parameters() + [p for p in self.method.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the encoder has no trainable parameters (no prompt and no pooler head)")
        # Frozen term parameters are loaded from the same source on every process: only the rest is broadcast.
        self.dist.broadcast_from_main([*self.encoder.prompt_state_dict().values(),
                                       *self.method.resume_state().values()])
        total = sum(p.numel() for p in self.encoder.parameters())
        trained = sum(p.numel() for p in self.params)
        logger.info("trainable parameters: %d (%.3f%% of %d)", trained, 100.0 * trained / total, total)

    def _warn_if_schedule_moved(self) -> None:
        """The learning-rate schedule is a function of the total step count: resuming with another max_steps or
        epochs moves it, and the next step's rate would jump (up, when the run was lengthened) silently."""
        sched = self.scheduler
        saved = sched.get_last_lr()  # the rates last/ was saved with
        now = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        if any(abs(a - b) > 1e-6 * max(abs(a), abs(b), 1e-30) for a, b in zip(saved, now)):
            logger.warning("the learning-rate schedule now spans %d steps: at step %d the learning rate becomes "
                           "%.3g (it was %.3g when the checkpoint was saved); the change of max_steps or epochs "
                           "stretches the decay from here on", self.total_steps, sched.last_epoch, now[0], saved[0])

    def _check_memory(self) -> None:
        """Refuse a batch whose activations cannot fit in memory (:mod:`fastprompt.train.memory`)."""
        cfg, lb = self.config, self.config.large_batch
        rows = min(cfg.optim.batch_size, len(self.examples)) // self.dist.world_size
        micro = lb.micro_batch_size or (lb.max_tokens_per_micro_batch // cfg.data.max_length) or None
        check_step_memory(ModelShape.of(self.encoder), rows=rows,
                          views=len(self.method.sentence.views_for(self.examples.columns)),
                          max_length=cfg.data.max_length, element_size=4 if cfg.run.precision == "fp32" else 2,
                          micro_batch_rows=micro, gradient_checkpointing=lb.gradient_checkpointing,
                          available=available_bytes(self.device))

    # ------------------------------------------------------------------ one step
    def seed_step(self, step: int) -> int:
        """Seed torch's generator for ``step`` (each process its own stream); returns the seed."""
        seed = step_seed(self.config.run.seed, step)
        if self.dist.enabled:  # each process draws its own dropout masks
            seed = step_seed(seed, self.dist.rank)
        torch.manual_seed(seed)
        return seed

    def make_batch(self, rows: list[int], seed: int) -> Batch:
        """This process's shard of a global batch, collated with the token terms' extras, on the device."""
        batch = self.collator([self.examples.rows[i] for i in self._local_rows(rows)])
        return self.method.add_extras(batch, extras_generators(self.method, seed)).to(self.device)

    def training_step(self, batch: Batch, seed: int) -> StepLosses:
        """Forward, loss and backward of one batch; leaves this process's gradients in ``.grad`` (not applied).

        A non-finite sentence loss is returned without a backward pass."""
        return self.step(batch, self.state.global_step, seed)

    def optimizer_step(self) -> tuple[float | None, bool]:
        """Unscale, clip, step. Returns (gradient norm, applied); a non-finite gradient skips the update."""
        cfg = self.config.optim
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if cfg.max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params
                                                               if p.grad is not None])))
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

    def _run_step(self, rows: list[int]) -> StepOutput:
        seed = self.seed_step(self.state.global_step)
        batch = self.make_batch(rows, seed)
        self.optimizer.zero_grad(set_to_none=True)
        out = self.training_step(batch, seed)
        loss = out.loss  # the global-batch loss, the same on every process
        grad_norm, applied = None, False
        if math.isfinite(loss):
            self.dist.all_reduce_gradients(self.params)
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
                           self.config.run.max_nonfinite_steps)
        else:
            self.state.nonfinite_streak = 0
        return StepOutput(loss, out.stats, grad_norm, skipped=not applied, tokens=batch.num_tokens)

    def _local_rows(self, rows: list[int]) -> list[int]:
        """This process's shard of a global batch (all of it in a single process)."""
        if not self.dist.enabled:
            return rows
        n = len(rows) // self.dist.world_size
        return rows[self.dist.rank * n:(self.dist.rank + 1) * n]

    # ------------------------------------------------------------------ evaluation and checkpoints
    def probe_spread(self) -> float | None:
        """``emb_spread`` of the probe sentences embedded as a user would (eval mode, no gradient); None when
        the check is off. Reads no random numbers and changes no state, so resuming stays bit for bit."""
        if not self.config.run.collapse_ratio or len(self.probe) < 2:
            return None
        with self.autocast():
            z = self.encoder.encode(self.probe, batch_size=len(self.probe), normalize=False, convert_to_numpy=False,
                                    show_progress_bar=False, max_length=self.config.data.max_length)
        return embedding_spread(z)

    def _agree(self, flag: bool) -> bool:
        """A stop decision every process takes together (true if any process's is)."""
        if not self.dist.enabled:
            return flag
        return bool(self.dist.sum(torch.tensor(float(flag), device=self.device)) > 0)

    def evaluate_dev(self) -> float | None:
        """STS-B dev Spearman x 100 of the current prompt (None without ``sts_dir``)."""
        if self.dev_data is None:
            return None
        from fastprompt.eval.sts import score_sts

        with self.autocast():
            result = score_sts(self.encoder, self.dev_data, batch_size=self.config.evaluation.eval_batch_size,
                               show_progress_bar=False)
        self.encoder.train()
        return float(result["stsb"])

    def evaluate_test(self, checkpoint: str | Path) -> dict[str, float]:
        """The seven-task STS test table of a prompt checkpoint, evaluated in this encoder (whose own weights
        are back in place afterwards)."""
        from fastprompt.eval.sts import evaluate_sts

        show = self.config.run.progress_bar if self.config.run.progress_bar is not None else sys.stderr.isatty()
        logger.info("final evaluation of %s on the STS test sets", checkpoint)
        # without a progress bar (a log file, a batch job) the minutes of encoding are logged instead
        model = self.encoder if show else LoggedEncoder(self.encoder, "final evaluation")
        with self.encoder.using_weights(checkpoint), self.autocast():
            return evaluate_sts(model, self.config.evaluation.sts_dir,
                                batch_size=self.config.evaluation.eval_batch_size, show_progress_bar=show)

    def evaluate_frozen_baseline(self) -> dict[str, Any]:
        """STS-B dev and the seven test tasks of the base model as a user gets it: same pooler, no prompt, no
        trained head (a pooler that exists only with a trained head falls back to [CLS])."""
        from fastprompt.eval.sts import evaluate_sts, score_sts
        from fastprompt.model import PromptEncoder

        enc = self.config.encoder
        pooler = "cls" if enc.pooler in ("bn_mlp", "topk") else enc.pooler
        frozen = PromptEncoder.from_pretrained(enc.model, pooler=pooler, mlp="none", attn_backend=enc.attn_backend)
        frozen.to(self.device).eval()
        batch_size = self.config.evaluation.eval_batch_size
        with self.autocast():
            dev = score_sts(frozen, self.dev_data, batch_size=batch_size, show_progress_bar=False)
            test = evaluate_sts(frozen, self.config.evaluation.sts_dir, batch_size=batch_size)
        logger.info("frozen %s (%s pooling): STS-B dev %.2f, seven-task average %.2f", enc.model, pooler,
                    dev["stsb"], test["avg"])
        return {"pooler": pooler, "stsb_dev": float(dev["stsb"]), "test": test}

    def save_last(self) -> Path:
        """Write ``last/``: prompt checkpoint + everything needed to resume exactly (main process only)."""
        self._last_saved_step = self.state.global_step
        if self.dist.is_main:
            self.run_dir.save_last(self.encoder, self.method, optimizer=self.optimizer, scheduler=self.scheduler,
                                   scaler=self.scaler, trainer={"state": self.state.__dict__.copy(),
                                                                "config": self.config.to_dict(),
                                                                "total_steps": self.total_steps})
        return self.last_dir

    def save_best(self, score: float | None) -> Path:
        if self.dist.is_main:
            self.run_dir.save_best(self.encoder, {"step": self.state.global_step, "stsb_dev": score,
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
        save_every = cfg.run.save_steps or cfg.evaluation.eval_steps
        show = cfg.run.progress_bar if cfg.run.progress_bar is not None else sys.stderr.isatty()
        bar = tqdm(total=self.total_steps, initial=st.global_step, desc="train", disable=not show,
                   dynamic_ncols=True)
        window: list[StepOutput] = []
        if st.probe_spread_start is None:  # a fresh run (or one saved before the probe existed)
            st.probe_spread_start = self.probe_spread()
        self.collapse = CollapseMonitor(cfg.run.collapse_ratio, cfg.run.collapse_patience, st.probe_spread_start)
        self._collapsed = False
        try:
            with GracefulInterrupt() as self.interrupt:
                if cfg.evaluation.eval_at_start and st.global_step == 0:
                    self._evaluate_and_select(bar)
                while st.global_step < self.total_steps and status == "completed":
                    for b_idx, rows in self.sampler.iter_from(st.epoch, st.batch_in_epoch):
                        t0 = time.perf_counter()
                        out = self._run_step(rows)
                        st.global_step += 1
                        st.batch_in_epoch = b_idx + 1
                        out.seconds = time.perf_counter() - t0
                        st.train_seconds += out.seconds
                        window.append(out)
                        bar.update(1)
                        for cb in self.callbacks:
                            cb(self, out)
                        if st.global_step % cfg.run.log_every == 0 or st.global_step == self.total_steps:
                            self._log_window(window)
                            bar.set_postfix_str(self._postfix(np.mean([w.loss for w in window]), None),
                                                refresh=False)
                            window = []
                        if st.nonfinite_streak >= cfg.run.max_nonfinite_steps:
                            status = "diverged"
                        elif self._collapsed:
                            status = "collapsed"
                        elif st.global_step % cfg.evaluation.eval_steps == 0 or st.global_step == self.total_steps:
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
        if status == "collapsed":
            raise TrainingCollapsed(self.collapse.message(st.global_step))
        if status == "diverged":
            raise TrainingDiverged(
                f"stopped at step {st.global_step} after {st.nonfinite_streak} consecutive non-finite losses or "
                f"gradients (try a lower learning_rate or precision=fp32); checkpoints in {self.output_dir} "
                "hold the last finite prompt")
        return summary

    def _log_window(self, window: list[StepOutput]) -> None:
        st = self.state
        finite = [w for w in window if math.isfinite(w.loss)]
        seconds = max(1e-9, sum(w.seconds for w in window))
        row: dict[str, Any] = {"step": st.global_step, "epoch": st.epoch, "lr": self.scheduler.get_last_lr()[0],
                               "skipped": sum(w.skipped for w in window), "elapsed_s": st.train_seconds,
                               "tokens_per_s": sum(w.tokens for w in window) / seconds}
        if finite:
            row["loss"] = float(np.mean([w.loss for w in finite]))
            norms = [w.grad_norm for w in finite if w.grad_norm is not None and math.isfinite(w.grad_norm)]
            if norms:
                row["grad_norm"] = float(np.mean(norms))
            for key in finite[0].stats:
                row[key] = float(np.mean([w.stats[key] for w in finite]))
        row[SPREAD_STAT] = self.probe_spread()
        self._collapsed = self._collapsed or self._agree(self.collapse.update(st.global_step, row[SPREAD_STAT]))
        self.metrics.write(row)
        logger.debug("step %d: %s", st.global_step, row)

    def _finish(self, status: str) -> dict[str, Any]:
        cfg, st = self.config, self.state
        if self.dev_data is None and status == "completed":
            self.save_best(None)  # no dev set: the final prompt is the one we have
        test = None
        if (status == "completed" and cfg.evaluation.sts_dir is not None and cfg.evaluation.final_eval
                and self.dist.is_main and self.best_dir.is_dir()):
            test = self.evaluate_test(self.best_dir)
        frozen = self.evaluate_frozen_baseline() if test is not None and cfg.evaluation.frozen_baseline else None
        summary = {
            "status": status,
            "global_step": st.global_step,
            "total_steps": self.total_steps,
            "epoch": st.epoch,
            "best_stsb_dev": st.best_score,
            "best_step": st.best_step,
            "dev_history": st.dev_history,
            "test": test,
            "frozen_baseline": frozen,
            "nonfinite_steps": st.nonfinite_total,
            "train_seconds": round(st.train_seconds, 2),
            "output_dir": str(self.output_dir),
            "best_checkpoint": str(self.best_dir) if self.best_dir.is_dir() else None,
            "last_checkpoint": str(self.last_dir),
            "log_csv": str(self.log_path),
            "config": cfg.to_dict(),
        }
        if self.dist.is_main:
            self.run_dir.write_summary(summary)
        self.dist.barrier()
        self.dist.shutdown()  # the encoder stays usable, e.g. for evaluation
        self._close_logs()
        logger.info("training %s at step %d/%d; best: %s; last: %s; log: %s; summary: %s", status, st.global_step,
                    self.total_steps, summary["best_checkpoint"], self.last_dir, self.log_path, self.summary_path)
        return summary

    def _close_logs(self) -> None:
        if self._setup_done:
            self._release_run()
            self._setup_done = False

    def _release_run(self) -> None:
        """Close the logs and release the output_dir lock (also after a setup that failed half-way)."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self._log_handler is not None:
            remove_file_handler(self._log_handler)
            self._log_handler = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
