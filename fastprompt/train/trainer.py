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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fastprompt.data import Batch, TrainExamples
from fastprompt.host_sync import checks_stay_on_device
from fastprompt.objectives.base import TokenTerm
from fastprompt.train import build, preflight
from fastprompt.train.checkpoints import RunDirectory, data_fingerprint
from fastprompt.train.collapse import SPREAD_STAT, CollapseMonitor
from fastprompt.train.compile import check_cuda_graphs, mark_step
from fastprompt.train.config import TrainConfig, load_config, save_config
from fastprompt.train.distributed import init_distributed
from fastprompt.train.evaluation import Evaluator, frozen_summary, probe_sentences
from fastprompt.train.logs import (
    MetricsLog,
    NullLog,
    add_file_handler,
    csv_columns,
    remove_file_handler,
    run_summary,
    window_row,
)
from fastprompt.train.memory import check_run_memory
from fastprompt.train.progress import bar_postfix
from fastprompt.train.run_lock import RunLock
from fastprompt.train.signals import GracefulInterrupt
from fastprompt.train.state import TrainerState
from fastprompt.train.steps import LossSide, StepLosses, extras_generators, step_seed

logger = logging.getLogger(__name__)

__all__ = ["StepOutput", "Trainer", "TrainerState", "TrainingCollapsed", "TrainingDiverged", "step_seed"]


class TrainingDiverged(RuntimeError):
    """Raised after ``max_nonfinite_steps`` consecutive non-finite losses/gradients (checkpoints are intact)."""


class TrainingCollapsed(TrainingDiverged):
    """Raised after ``collapse_patience`` consecutive log rows whose probe sentences all embed alike."""


class StepOutput:
    """What one optimisation step reports (the callbacks' argument, a row of ``train_log.csv`` averages them).

    A step leaves its values on the device (a CUDA step never waits for the GPU: docs/gpu.md, "The host path"); the
    first read of ``loss``, ``stats``, ``grad_norm``, ``skipped`` or ``nonfinite`` copies them all to the host at
    once, waiting for the step's kernels. The trainer reads them at its log rows (every ``log_every`` steps), and at
    every step only where that costs nothing (on the CPU). ``tokens`` (real tokens of the batch, from the collator)
    and ``seconds`` are host values."""

    def __init__(self, loss: torch.Tensor | float, stats: dict[str, torch.Tensor | float],
                 grad_norm: torch.Tensor | float | None, applied: torch.Tensor | bool, nonfinite: torch.Tensor | bool,
                 tokens: int, seconds: float = 0.0):
        self._device = {"loss": loss, "grad_norm": grad_norm, "applied": applied, "nonfinite": nonfinite,
                        **{f"stats.{k}": v for k, v in stats.items()}}
        self._host: dict[str, Any] | None = None
        self.tokens, self.seconds = tokens, seconds

    @staticmethod
    def read_all(outputs: Sequence["StepOutput"]) -> None:
        """Copy the device values of every output in ``outputs`` to the host in one read (one sync)."""
        pending = [o for o in outputs if o._host is None]
        tensors = [(o, k, v) for o in pending for k, v in o._device.items() if isinstance(v, torch.Tensor)]
        values = (torch.stack([v.detach().reshape(()).to(torch.float64) for _, _, v in tensors]).tolist()
                  if tensors else [])
        for o in pending:
            o._host = {k: v for k, v in o._device.items() if not isinstance(v, torch.Tensor)}
        for (o, k, _), value in zip(tensors, values):
            o._host[k] = value
        for o in pending:
            o._device = {}

    def _get(self, key: str):
        if self._host is None:
            StepOutput.read_all([self])
        return self._host[key]

    @property
    def loss(self) -> float:
        """The global-batch loss (NaN or inf when the step's loss was not finite)."""
        return float(self._get("loss"))

    @property
    def stats(self) -> dict[str, float]:
        """The method's statistics of this step (:class:`~fastprompt.train.steps.StepLosses`)."""
        self._get("loss")
        return {k[6:]: float(v) for k, v in self._host.items() if k.startswith("stats.")}

    @property
    def grad_norm(self) -> float | None:
        """The gradient norm before clipping (None: no gradient)."""
        norm = self._get("grad_norm")
        return None if norm is None else float(norm)

    @property
    def skipped(self) -> bool:
        """Whether the update was skipped (a non-finite loss or gradient, or GradScaler's calibration)."""
        return not bool(self._get("applied"))

    @property
    def nonfinite(self) -> bool:
        """Whether the step counts as non-finite (``max_nonfinite_steps``): its loss, or without GradScaler its
        gradient, was not finite."""
        return bool(self._get("nonfinite"))


class Trainer:
    """``Trainer(config).train()`` trains deep prompts; see the module docstring for the step structure.

    Args:
        config: a :class:`TrainConfig`, a dict of its flat keys, or a YAML path.
        encoder: an already-built :class:`~fastprompt.model.PromptEncoder` to train (default: built from the
            config; on resume its prompt is reloaded from ``last``).
        examples: training rows (default: read from ``config.train_file``), or a list of datasets' rows (as
            ``train_files``: each batch from one of them).
        terms: token-level objective terms (:class:`~fastprompt.objectives.TokenTerm`) added to the config's
            sentence-level objective.
        callbacks: functions ``fn(trainer, step_output)`` called after every step (for monitoring/tests).
    """

    def __init__(self, config: TrainConfig | dict | str | Path, *, encoder=None,
                 examples: TrainExamples | Sequence[TrainExamples] | None = None, terms: Sequence[TokenTerm] = (),
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
        self._last_dev: float | None = None  # the latest STS-B dev score, for the progress bar
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
        check_cuda_graphs(cfg, self.dist.device)
        if self.dist.is_main:  # one run per output_dir: a second one is refused before it writes anything
            preflight.check_output_dir(self.output_dir)
            self.run_dir.check_target(cfg.run.overwrite_output_dir)  # a user's own files are never replaced unasked
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
        resume_dir = self.run_dir.resume_point_for(cfg)  # None: a fresh start

        if self.examples is None:
            self.datasets = build.load_datasets(cfg)
        else:
            self.datasets = [self.examples] if isinstance(self.examples, TrainExamples) else list(self.examples)
        self.examples = self.datasets[0]
        # with several datasets, each one's loss gets a train_log.csv column
        self.dataset_names = build.dataset_names(self.datasets) if len(self.datasets) > 1 else []
        self._data = data_fingerprint(self.datasets)
        if resume_dir is not None:
            self.run_dir.check_same_data(resume_dir, self._data, ", ".join(ex.source for ex in self.datasets))
        self.sampler = build.build_sampler(cfg, self.datasets, self.dist)
        self.total_steps = build.count_total_steps(cfg, self.sampler)
        build.check_warmup(cfg, self.total_steps)

        torch.manual_seed(cfg.run.seed)  # prompt initialisation
        given_encoder = self.encoder  # a user's encoder gets last/'s weights in restore(); a built one has them
        self._build_model(resume_dir)
        preflight.check_max_length(cfg, self.encoder)
        self.collators = [build.build_collator(cfg, self.encoder, ex, self.method) for ex in self.datasets]
        self.collator = self.collators[0]
        if cfg.large_batch.check_memory:
            n_views = max(len(self.method.sentence.views_for(ex.columns)) for ex in self.datasets)
            check_run_memory(cfg, self.encoder, n_views, rows_available=max(len(ex) for ex in self.datasets),
                             world_size=self.dist.world_size, device=self.device)
        self.optimization = build.build_optimization(cfg, self.params, self.total_steps, self.device,
                                                     encoder=self.encoder)
        self.optimizer, self.scheduler, self.scaler = (self.optimization.optimizer, self.optimization.scheduler,
                                                       self.optimization.scaler)
        self.autocast = build.autocast_factory(cfg, self.device)
        loss_side = LossSide(self.method, self.encoder, self.dist, autocast=self.autocast,
                             loss_scale=self.scaler.scale if self.scaler is not None else None,
                             embed=build.build_embed(cfg, self.encoder, self.examples, self.method))
        self.step = build.build_step(cfg, loss_side)
        eval_autocast = build.autocast_factory(cfg, self.device, precision=cfg.evaluation.eval_precision)
        # the final evaluation's files are read now, so a missing or corrupt one fails before training
        self.evaluator = Evaluator(cfg, self.encoder, self.autocast, eval_autocast=eval_autocast, device=self.device,
                                   dev_data=build.load_dev_data(cfg), probe=probe_sentences(self.examples.rows),
                                   test_data=preflight.check_sts_files(cfg))

        if resume_dir is not None:
            self.state = self.run_dir.restore(resume_dir, method=self.method, optimizer=self.optimizer,
                                              scheduler=self.scheduler, scaler=self.scaler,
                                              total_steps=self.total_steps, encoder=given_encoder)
        # Frozen term parameters are loaded from the same source on every process: only the rest is broadcast.
        self.dist.broadcast_from_main([*self.encoder.prompt_state_dict().values(),
                                       *self.method.resume_state().values()])
        if self.dist.is_main:
            self.run_dir.clear_previous()  # a fresh start over an old run: only now that everything above worked
            save_config(cfg, self.run_dir.config_yaml)
            self.metrics = MetricsLog(self.output_dir, resume_step=self.state.global_step if resume_dir else None,
                                      tensorboard=cfg.run.tensorboard,
                                      columns=csv_columns(self.method.log_columns() + self._dataset_columns(),
                                                          backbone_lr=cfg.backbone.train_backbone or cfg.adapter.lora))
        else:
            self.metrics = NullLog()

    def _build_model(self, resume_dir: Path | None) -> None:
        """The encoder (built from ``last/`` when resuming) and the method on the device."""
        if self.encoder is None:
            self.encoder = build.build_encoder(self.config, resume_dir)
        build.prepare_encoder(self.config, self.encoder, self.device, self.total_steps)
        self.method = build.build_method(self.config, self.encoder, self.terms).to(self.device).train()
        self.params = self.encoder.trainable_parameters() + [p for p in self.method.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the encoder has no trainable parameters (no prompt, no pooler head, no trained "
                             "backbone or LoRA adapters)")
        total = sum(p.numel() for p in self.encoder.parameters())
        trained = sum(p.numel() for p in self.params)
        logger.info("trainable parameters: %d (%.3f%% of %d)", trained, 100.0 * trained / total, total)

    # ------------------------------------------------------------------ one step
    def seed_step(self, step: int) -> int:
        """Seed torch's generator for ``step`` (each process its own stream); returns the seed."""
        seed = step_seed(self.config.run.seed, step)
        if self.dist.enabled:  # each process draws its own dropout masks
            seed = step_seed(seed, self.dist.rank)
        torch.manual_seed(seed)
        return seed

    def _dataset_columns(self) -> tuple[str, ...]:
        return tuple(f"loss_data_{name}" for name in self.dataset_names)

    def make_batch(self, rows: list[int], seed: int, dataset: int = 0) -> Batch:
        """This process's shard of a global batch of ``dataset``, collated with the token terms' extras, on the
        device."""
        data = self.datasets[dataset].rows
        batch = self.collators[dataset]([data[i] for i in self.dist.local_rows(rows)])
        return self.method.add_extras(batch, extras_generators(self.method, seed)).to(self.device)

    def training_step(self, batch: Batch, seed: int) -> StepLosses:
        """Forward, loss and backward of one batch; leaves this process's gradients in ``.grad`` (not applied).

        A non-finite sentence loss is returned without a backward pass."""
        mark_step(self.config)  # cuda_graphs: a new step of the recorded graphs
        return self.step(batch, self.state.global_step, seed)

    def optimizer_step(self, finite_loss: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, clip, step, on the device. Returns (gradient norm, applied) as 0-d tensors; a non-finite
        gradient, or a loss ``finite_loss`` says is not finite, skips the update."""
        return self.optimization.step(self.params, self.config.optim.max_grad_norm, finite_loss)

    def _run_step(self, rows: list[int], dataset: int = 0) -> StepOutput:
        """One step, without reading a device tensor on the host: its values stay on the device (StepOutput)."""
        seed = self.seed_step(self.state.global_step)
        batch = self.make_batch(rows, seed, dataset)
        self.optimizer.zero_grad(set_to_none=True)
        out = self.training_step(batch, seed)
        finite = torch.isfinite(out.loss)  # the global-batch loss, the same on every process
        self.dist.all_reduce_gradients(self.params)
        grad_norm, applied = self.optimizer_step(finite)
        nonfinite = ~finite if self.scaler is not None else ~(finite & torch.isfinite(grad_norm))
        self.scheduler.step()  # the learning rate follows the step count even over a skipped step
        self.optimizer.zero_grad(set_to_none=True)
        stats = dict(out.stats)
        if self.dataset_names:
            stats[f"loss_data_{self.dataset_names[dataset]}"] = out.loss
        return StepOutput(out.loss, stats, grad_norm, applied, nonfinite, tokens=batch.num_tokens)

    def _account(self, outputs: Sequence[StepOutput], last_step: int) -> None:
        """Count the non-finite steps among ``outputs`` (the steps up to ``last_step``, in order), reading their
        values in one go; warn for each."""
        StepOutput.read_all(outputs)
        st = self.state
        for step, out in enumerate(outputs, start=last_step - len(outputs) + 1):
            if out.nonfinite:
                st.nonfinite_streak += 1
                st.nonfinite_total += 1
                bad = not math.isfinite(out.loss)
                logger.warning("step %d: non-finite %s (%s); skipped the update (%d in a row, limit %d)",
                               step, "loss" if bad else "gradient", out.loss if bad else out.grad_norm,
                               st.nonfinite_streak, self.config.run.max_nonfinite_steps)
            else:
                st.nonfinite_streak = 0

    # ------------------------------------------------------------------ evaluation and checkpoints
    def save_last(self) -> Path:
        """Write ``last/``: prompt checkpoint + everything needed to resume exactly (main process only)."""
        self._last_saved_step = self.state.global_step
        if self.dist.is_main:
            self.run_dir.save_last(self.encoder, self.method, optimizer=self.optimizer, scheduler=self.scheduler,
                                   scaler=self.scaler, trainer={"state": self.state.__dict__.copy(),
                                                                "config": self.config.to_dict(),
                                                                "total_steps": self.total_steps,
                                                                "data": self._data})
        return self.last_dir

    def save_best(self, score: float | None) -> Path:
        if self.dist.is_main:
            self.run_dir.save_best(self.encoder, {"step": self.state.global_step, "stsb_dev": score,
                                                  "config": self.config.to_dict()})
        return self.best_dir

    def _evaluate_and_select(self, bar) -> None:
        """STS-B dev on the main process (best/ when it improves; :mod:`fastprompt.train.evaluation`)."""
        score = (self.evaluator.evaluate_and_select(self.state, save_best=self.save_best, metrics=self.metrics)
                 if self.dist.is_main else None)
        if score is not None:
            self._last_dev = score
            bar.set_postfix_str(bar_postfix(None, score), refresh=False)

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
        unread: list[StepOutput] = []  # steps whose values are still on the device (see StepOutput)
        if st.probe_spread_start is None:  # a fresh run (or one saved before the probe existed)
            st.probe_spread_start = self.evaluator.probe_spread()
        self.collapse = CollapseMonitor(cfg.run.collapse_ratio, cfg.run.collapse_patience, st.probe_spread_start)
        self._collapsed = False
        try:
            with GracefulInterrupt() as self.interrupt:
                if (cfg.evaluation.frozen_baseline and st.frozen_dev is None and self.dist.is_main
                        and self.evaluator.dev_data is not None):  # the bar the dev scores are compared with
                    st.frozen_dev = self.evaluator.frozen_dev()
                if cfg.evaluation.eval_at_start and st.global_step == 0:
                    self._evaluate_and_select(bar)
                while st.global_step < self.total_steps and status == "completed":
                    for b_idx, (dataset, rows) in self.sampler.iter_from(st.epoch, st.batch_in_epoch):
                        t0 = time.perf_counter()
                        out = self._run_step(rows, dataset)
                        st.global_step += 1
                        st.batch_in_epoch = b_idx + 1
                        window.append(out)
                        unread.append(out)
                        log_row = st.global_step % cfg.run.log_every == 0 or st.global_step == self.total_steps
                        checkpoint = (st.global_step % save_every == 0 or st.global_step % cfg.evaluation.eval_steps
                                      == 0 or self.interrupt.requested)
                        # The values are read where that costs nothing (the CPU), else at log rows and before a
                        # checkpoint or evaluation (one sync for all the steps since the last read).
                        if log_row or checkpoint or not checks_stay_on_device(self.params[0]):
                            self._account(unread, st.global_step)
                            unread = []
                        out.seconds = time.perf_counter() - t0  # with the wait for the GPU where it was read
                        st.train_seconds += out.seconds
                        bar.update(1)
                        for cb in self.callbacks:
                            cb(self, out)
                        if log_row:
                            self._log_window(window)
                            bar.set_postfix_str(bar_postfix(np.mean([w.loss for w in window]), self._last_dev),
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
                if unread:
                    self._account(unread, st.global_step)
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
        row = window_row(window, step=st.global_step, epoch=st.epoch, lrs=self.scheduler.get_last_lr(),
                         backbone_lr=self.config.backbone.train_backbone or self.config.adapter.lora,
                         elapsed_s=st.train_seconds)
        row[SPREAD_STAT] = self.evaluator.probe_spread()
        self._collapsed = self._collapsed or self.dist.agree(self.collapse.update(st.global_step, row[SPREAD_STAT]))
        self.metrics.write(row)
        logger.debug("step %d: %s", st.global_step, row)

    def _finish(self, status: str) -> dict[str, Any]:
        st = self.state
        if self.evaluator.dev_data is None and status == "completed":
            self.save_best(None)  # no dev set: the final prompt is the one we have
        test, frozen = (self.evaluator.final(self.best_dir, st.frozen_dev) if status == "completed"
                        and self.dist.is_main else (None, None))
        if frozen is None and st.frozen_dev:  # no final evaluation: the frozen model's dev scores still count
            frozen = frozen_summary(st.frozen_dev)
        summary = run_summary(status, st, total_steps=self.total_steps, run_dir=self.run_dir, config=self.config,
                              test=test, frozen=frozen)
        if self.evaluator.matryoshka_test is not None:
            summary["test_matryoshka"] = {str(d): t for d, t in self.evaluator.matryoshka_test.items()}
        if self.dist.is_main:
            if summary["comparison"] is not None:
                log = logger.warning if summary["comparison"]["outcome"] == "worse" else logger.info
                log("trained prompt: %s", summary["comparison"]["message"])
            self.run_dir.write_summary(summary)
            if self.evaluator.dev_data is not None:  # a run with evaluation draws its report, then names it
                summary["report"] = self._write_report()
                if summary["report"] is not None:
                    self.run_dir.write_summary(summary)
        self.dist.barrier()
        self.dist.shutdown()  # the encoder stays usable, e.g. for evaluation
        self._close_logs()
        logger.info("training %s at step %d/%d; best: %s; last: %s; log: %s; summary: %s", status, st.global_step,
                    self.total_steps, summary["best_checkpoint"], self.last_dir, self.log_path, self.summary_path)
        return summary

    def _write_report(self) -> str | None:
        """``report.png`` from the run's summary.json and train_log.csv (:mod:`fastprompt.eval.report`, what
        ``fastprompt report`` draws). A report that cannot be drawn (matplotlib missing, a full disk) is a warning,
        not a failed run: the results are in summary.json already."""
        from fastprompt.eval.report import write_report

        try:
            path = write_report(self.output_dir)
        except Exception as exc:  # the results are in summary.json already; the picture is extra
            logger.warning("report.png not drawn: %s: %s", type(exc).__name__, exc)
            return None
        logger.info("report: %s", path)
        return str(path)

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
