"""What a training run evaluates: STS-B dev for model selection, the final test table, the frozen baseline, and
the collapse probe.

:class:`Evaluator` is built once at setup from the run's config, its encoder and its autocast; the trainer calls
:meth:`Evaluator.evaluate_and_select` every ``eval_steps`` (on the main process), :meth:`Evaluator.probe_spread`
at every log row, and :meth:`Evaluator.final` at the end of a completed run. Protocol: ``docs/evaluation.md``.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastprompt.train.collapse import embedding_spread
from fastprompt.train.progress import LoggedEncoder

logger = logging.getLogger(__name__)

#: Distinct training sentences embedded at every log row to watch for collapse (fastprompt.train.collapse).
PROBE_SENTENCES = 32


def probe_sentences(rows: list[tuple[str, ...]]) -> list[str]:
    """The collapse probe: the first :data:`PROBE_SENTENCES` distinct anchors of the training rows."""
    return list(dict.fromkeys(row[0] for row in rows))[:PROBE_SENTENCES]


class Evaluator:
    """The evaluations of one run. ``autocast``: the training forwards' (the collapse probe watches what training
    computes); ``eval_autocast``: STS-B dev, the test table and the frozen baseline's (``eval_precision``: fp32
    by default, whatever the training precision, as the papers evaluate); ``dev_data``: the STS-B dev pairs (None
    without ``sts_dir``); ``probe``: the collapse probe's sentences."""

    def __init__(self, config, encoder, autocast: Callable, *, eval_autocast: Callable, device, dev_data,
                 probe: list[str]):
        self.config, self.encoder, self.autocast, self.device = config, encoder, autocast, device
        self.eval_autocast = eval_autocast
        self.dev_data, self.probe = dev_data, probe

    def probe_spread(self) -> float | None:
        """``emb_spread`` of the probe sentences embedded as a user would (eval mode, no gradient); None when
        the check is off. Reads no random numbers and changes no state, so resuming stays bit for bit."""
        if not self.config.run.collapse_ratio or len(self.probe) < 2:
            return None
        with self.autocast():
            z = self.encoder.encode(self.probe, batch_size=len(self.probe), normalize=False, convert_to_numpy=False,
                                    show_progress_bar=False, max_length=self.config.data.max_length)
        return embedding_spread(z)

    def dev(self) -> float | None:
        """STS-B dev Spearman x 100 of the current prompt (None without ``sts_dir``)."""
        if self.dev_data is None:
            return None
        from fastprompt.eval.sts import score_sts

        with self.eval_autocast():
            result = score_sts(self.encoder, self.dev_data, batch_size=self.config.evaluation.eval_batch_size,
                               show_progress_bar=False)
        self.encoder.train()
        return float(result["stsb"])

    def evaluate_and_select(self, state, *, save_best: Callable[[float], Any], metrics) -> float | None:
        """Score the current prompt on STS-B dev, record it in ``state`` (the trainer's counters), call
        ``save_best(score)`` when it is the best so far, and write the log row. None without dev data."""
        score = self.dev()
        if score is None:
            return None
        state.dev_history.append([state.global_step, score])
        improved = state.best_score is None or score > state.best_score
        if improved:
            state.best_score, state.best_step = score, state.global_step
            save_best(score)
        logger.info("step %d: STS-B dev %.2f (best %.2f at step %d)%s", state.global_step, score, state.best_score,
                    state.best_step, " -> saved best/" if improved else "")
        metrics.write({"step": state.global_step, "epoch": state.epoch, "stsb_dev": score,
                       "elapsed_s": state.train_seconds})
        return score

    def test(self, checkpoint: str | Path) -> dict[str, float]:
        """The seven-task STS test table of a prompt checkpoint, evaluated in this encoder (whose own weights
        are back in place afterwards)."""
        from fastprompt.eval.sts import evaluate_sts

        run, ev = self.config.run, self.config.evaluation
        show = run.progress_bar if run.progress_bar is not None else sys.stderr.isatty()
        logger.info("final evaluation of %s on the STS test sets", checkpoint)
        # without a progress bar (a log file, a batch job) the minutes of encoding are logged instead
        model = self.encoder if show else LoggedEncoder(self.encoder, "final evaluation")
        with self.encoder.using_weights(checkpoint), self.eval_autocast():
            return evaluate_sts(model, ev.sts_dir, batch_size=ev.eval_batch_size, show_progress_bar=show)

    def frozen_baseline(self) -> dict[str, Any]:
        """STS-B dev and the seven test tasks of the base model as a user gets it: the run's pooler and template
        (with its evaluation denoising and top-k), no prompt, no trained head (the BatchNorm-MLP pooler, which
        exists only with a trained head, falls back to [CLS])."""
        from fastprompt.eval.sts import evaluate_sts, score_sts
        from fastprompt.model import PromptEncoder

        enc, tpl = self.config.encoder, self.config.templates
        pooler = "cls" if enc.pooler == "bn_mlp" else enc.pooler
        frozen = PromptEncoder.from_pretrained(enc.model, pooler=pooler, mlp="none", attn_backend=enc.attn_backend,
                                               template=tpl.template, denoise=tpl.resolved_eval_denoise,
                                               topk=tpl.topk, trust_remote_code=enc.trust_remote_code)
        frozen.to(self.device).eval()
        batch_size = self.config.evaluation.eval_batch_size
        with self.eval_autocast():
            dev = score_sts(frozen, self.dev_data, batch_size=batch_size, show_progress_bar=False)
            test = evaluate_sts(frozen, self.config.evaluation.sts_dir, batch_size=batch_size)
        logger.info("frozen %s (%s pooling): STS-B dev %.2f, seven-task average %.2f", enc.model, pooler,
                    dev["stsb"], test["avg"])
        return {"pooler": pooler, "stsb_dev": float(dev["stsb"]), "test": test}

    def final(self, best_dir: Path) -> tuple[dict[str, float] | None, dict[str, Any] | None]:
        """The end of a completed run: the test table of ``best_dir`` and, with ``frozen_baseline``, the frozen
        model's scores; (None, None) when the config asks for no final evaluation or there is no best/."""
        ev = self.config.evaluation
        if ev.sts_dir is None or not ev.final_eval or not best_dir.is_dir():
            return None, None
        test = self.test(best_dir)
        return test, (self.frozen_baseline() if ev.frozen_baseline else None)
