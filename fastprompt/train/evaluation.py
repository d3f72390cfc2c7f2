"""What a training run evaluates: STS-B dev for model selection, the final test table, the frozen baseline, and
the collapse probe.

:class:`Evaluator` is built once at setup from the run's config, its encoder and its autocast; the trainer calls
:meth:`Evaluator.frozen_dev` before the first step (with ``frozen_baseline``), :meth:`Evaluator.evaluate_and_select`
every ``eval_steps`` (on the main process), :meth:`Evaluator.probe_spread` at every log row, and
:meth:`Evaluator.final` at the end of a completed run. Protocol: ``docs/evaluation.md``.

Nothing is encoded twice in one run: the final tables encode each distinct sentence once, and reuse the vectors
of the STS-B dev sentences that the dev evaluations already encoded with the same weights (the best checkpoint's,
the frozen model's); the STS-B dev scores of both are taken from those evaluations.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastprompt.choices import TEMPLATE_POOLERS
from fastprompt.train.collapse import embedding_spread
from fastprompt.train.compile import eager_outside_training
from fastprompt.train.progress import LoggedEncoder

logger = logging.getLogger(__name__)

#: Distinct training sentences embedded at every log row to watch for collapse (fastprompt.train.collapse).
PROBE_SENTENCES = 32
#: Gains smaller than this (in Spearman x 100 points) print as 0.00: neither better nor worse.
TIE = 0.005


def probe_sentences(rows: list[tuple[str, ...]]) -> list[str]:
    """The collapse probe: the first :data:`PROBE_SENTENCES` distinct anchors of the training rows."""
    return list(dict.fromkeys(row[0] for row in rows))[:PROBE_SENTENCES]


@dataclass(frozen=True)
class FrozenSetting:
    """One way to score the untouched base model. ``key``: ``"native"`` (its own pooling), ``"same_pooling"`` (the
    run's pooling and template, when they differ from its own) or ``"run_pooling"`` (the run's, when its own is not
    known); ``source``: why this pooling."""

    key: str
    pooler: str
    template: str | None
    denoise: bool
    topk: int
    source: str

    def describe(self) -> dict[str, Any]:
        return {"pooler": self.pooler, "template": self.template, "pooling_source": self.source}


def frozen_settings(config) -> list[FrozenSetting]:
    """The frozen model's settings a run compares with, the primary one first: the model's own pooling (its
    sentence-transformers configuration) and, when the run pools otherwise (another pooler, a template), the run's
    pooling too; only the run's when the model's own is not known (the source says why)."""
    from fastprompt.model.pooling import native_pooling

    enc, tpl = config.encoder, config.templates
    # no trained head on the frozen model: the BatchNorm-MLP pooler falls back to its [CLS] state
    run_pooler = "cls" if enc.pooler == "bn_mlp" else enc.pooler
    template = tpl.template
    if template is None and run_pooler in TEMPLATE_POOLERS:
        from fastprompt.model import DEFAULT_TEMPLATE

        template = DEFAULT_TEMPLATE
    denoise = tpl.resolved_eval_denoise if template is not None else False
    same = FrozenSetting("same_pooling", run_pooler, template, denoise, tpl.topk,
                         "the prompt's pooling" + (" and template" if template is not None else ""))
    native = native_pooling(enc.model)
    if native.pooler is None:
        return [FrozenSetting("run_pooling", run_pooler, template, denoise, tpl.topk,
                              f"the prompt's pooling; the model's own is not known: {native.source}")]
    own = FrozenSetting("native", native.pooler, None, False, tpl.topk, f"the model's own pooling ({native.source})")

    def vector(s: FrozenSetting):  # without a trained head, cls and cls_before_pooler take the same [CLS] state
        return "cls" if s.pooler == "cls_before_pooler" else s.pooler, s.template

    return [own] if vector(own) == vector(same) else [own, same]


def frozen_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's ``frozen_baseline`` from the settings' entries (the primary one first): the primary entry with
    the run's own pooling under ``same_pooling`` (None when there is no second setting). A run that ends before its
    final evaluation has the dev scores only (``test`` None)."""
    entries = [{"test": None, **e} for e in entries]
    return {**entries[0], "same_pooling": entries[1] if len(entries) > 1 else None}


def compare_with_frozen(test: Mapping[str, float], frozen: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The trained prompt's seven-task average against the frozen model's (primary setting, and the run's own
    pooling when it differs), with a sentence that says plainly which is better."""
    def gain(entry):
        g = test["avg"] - entry["test"]["avg"]
        return 0.0 if abs(g) < TIE else g

    primary = gain(frozen)
    outcome = "better" if primary > 0 else "worse" if primary < 0 else "equal"
    how = {"native": f"with its own {frozen['pooler']} pooling",
           "run_pooling": f"with the prompt's {frozen['pooler']} pooling; its own pooling is not known"}[frozen["key"]]
    bar = f"the frozen {model} ({frozen['test']['avg']:.2f}, {how})"
    avg = f"the trained prompt's seven-task average {test['avg']:.2f}"
    if outcome == "better":
        message = f"better than the frozen model: {avg} is {primary:.2f} points above {bar}"
    elif outcome == "worse":
        message = (f"WORSE than the frozen model: {avg} is {-primary:.2f} points below {bar}; the frozen model "
                   "alone embeds these sentences better")
    else:
        message = f"no better than the frozen model: {avg} equals {bar}"
    out = {"outcome": outcome, "gain": primary, "prompt_avg": test["avg"], "frozen_avg": frozen["test"]["avg"],
           "frozen_pooler": frozen["pooler"], "message": message}
    same = frozen.get("same_pooling")
    if same is not None:
        out["gain_same_pooling"] = gain(same)
        out["message"] += (f". Against the frozen model with the prompt's {same['pooler']} pooling "
                           f"({same['test']['avg']:.2f}): {gain(same):+.2f} points")
    return out


class Evaluator:
    """The evaluations of one run. ``autocast``: the training forwards' (the collapse probe watches what training
    computes); ``eval_autocast``: STS-B dev, the test table and the frozen baseline's (``eval_precision``: fp32
    by default, whatever the training precision, as the papers evaluate); ``dev_data``: the STS-B dev pairs (None
    without ``sts_dir``); ``test_data``: the seven test tasks (None without a final evaluation; loaded once, at
    setup); ``probe``: the collapse probe's sentences."""

    def __init__(self, config, encoder, autocast: Callable, *, eval_autocast: Callable, device, dev_data,
                 probe: list[str], test_data=None):
        self.config, self.encoder, self.autocast, self.device = config, encoder, autocast, device
        self.eval_autocast = eval_autocast
        self.dev_data, self.probe, self.test_data = dev_data, probe, test_data
        self._settings: list[FrozenSetting] | None = None
        self._dev_vectors: dict[str, np.ndarray] | None = None  # the latest dev evaluation's, sentence -> vector
        self._best_vectors: dict[str, np.ndarray] | None = None  # those of the evaluation that saved best/
        self._frozen_vectors: dict[str, dict[str, np.ndarray]] = {}  # setting key -> the frozen dev vectors
        #: with matryoshka_dims: the final test table at each dimension, {dim: {"sts12": ..., "avg": ...}}
        self.matryoshka_test: dict[int, dict[str, float]] | None = None

    @property
    def frozen_settings(self) -> list[FrozenSetting]:
        if self._settings is None:
            self._settings = frozen_settings(self.config)
        return self._settings

    def probe_spread(self) -> float | None:
        """``emb_spread`` of the probe sentences embedded as a user would (eval mode, no gradient); None when
        the check is off. Reads no random numbers and changes no state, so resuming stays bit for bit."""
        if not self.config.run.collapse_ratio or len(self.probe) < 2:
            return None
        with self.autocast(), eager_outside_training(self.config):
            z = self.encoder.encode(self.probe, batch_size=len(self.probe), normalize=False, convert_to_numpy=False,
                                    show_progress_bar=False, max_length=self.config.data.max_length)
        return embedding_spread(z)

    def _encode(self, model, datasets, known=None, what: str | None = None):
        """``encode_pairs`` under the evaluations' autocast; ``what``: a long encoding's name, shown as a progress
        bar on a terminal and logged as it goes elsewhere (a log file, a batch job)."""
        from fastprompt.eval.sts import encode_pairs

        run = self.config.run
        show = what is not None and (run.progress_bar if run.progress_bar is not None else sys.stderr.isatty())
        if what is not None and not show:
            model = LoggedEncoder(model, what)
        with self.eval_autocast(), eager_outside_training(self.config):
            return encode_pairs(model, datasets, batch_size=self.config.evaluation.eval_batch_size,
                                show_progress_bar=show, known=known)

    def dev(self) -> float | None:
        """STS-B dev Spearman x 100 of the current prompt (None without ``sts_dir``)."""
        if self.dev_data is None:
            return None
        from fastprompt.eval.sts import scores_from_pairs, sentence_vectors

        pairs = self._encode(self.encoder, self.dev_data)
        self.encoder.train()
        self._dev_vectors = sentence_vectors(pairs, self.dev_data)
        return float(scores_from_pairs(pairs, self.dev_data)["stsb"])

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
            self._best_vectors = self._dev_vectors
        logger.info("step %d: STS-B dev %.2f (best %.2f at step %d)%s", state.global_step, score, state.best_score,
                    state.best_step, " -> saved best/" if improved else "")
        metrics.write({"step": state.global_step, "epoch": state.epoch, "stsb_dev": score,
                       "elapsed_s": state.train_seconds})
        return score

    def test(self, checkpoint: str | Path, known: Mapping[str, np.ndarray] | None = None) -> dict[str, float]:
        """The seven-task STS test table of a prompt checkpoint, evaluated in this encoder (whose own weights
        are back in place afterwards). ``known``: vectors the checkpoint's weights already gave (its dev
        evaluation's), reused instead of encoded again."""
        from fastprompt.eval.sts import load_sts_tasks, scores_at_dims, scores_from_pairs

        ev = self.config.evaluation
        data = self.test_data if self.test_data is not None else load_sts_tasks(ev.sts_dir)
        logger.info("final evaluation of %s on the STS test sets", checkpoint)
        with self.encoder.using_weights(checkpoint):
            pairs = self._encode(self.encoder, data, known, what="final evaluation")
        dims = self.config.loss.matryoshka_dims
        if dims:  # the same vectors' prefixes: encode(..., dim=d) for each Matryoshka dimension
            self.matryoshka_test = scores_at_dims(pairs, data, dims)
            for dim, scores in self.matryoshka_test.items():
                logger.info("Matryoshka dimension %d: %s", dim, ", ".join(f"{k} {v:.2f}" for k, v in scores.items()))
        return scores_from_pairs(pairs, data)

    def _frozen_encoder(self, setting: FrozenSetting):
        from fastprompt.model import PromptEncoder

        enc = self.config.encoder
        frozen = PromptEncoder.from_pretrained(enc.model, pooler=setting.pooler, mlp="none",
                                               attn_backend=enc.attn_backend, template=setting.template,
                                               denoise=setting.denoise, topk=setting.topk,
                                               append_eos=enc.append_eos, trust_remote_code=enc.trust_remote_code)
        return frozen.to(self.device).eval()

    def _cached(self, frozen, setting: FrozenSetting, datasets) -> tuple[str, dict[str, Any] | None, Path | None]:
        """(cache key, cached entry or None, its file) of the frozen scores of ``setting`` on ``datasets``
        (:mod:`fastprompt.eval.frozen_cache`); the entry is None when the cache is off (``frozen_cache: false``)."""
        from fastprompt.eval import frozen_cache

        ev, enc = self.config.evaluation, self.config.encoder
        how = {"pooler": setting.pooler, "template": setting.template, "denoise": setting.denoise, "topk": setting.topk,
               "append_eos": enc.append_eos, "eval_precision": ev.eval_precision, "batch_size": ev.eval_batch_size}
        key = frozen_cache.entry_key(frozen_cache.weights_digest(frozen), how, frozen_cache.data_digest(datasets),
                                     str(getattr(self.device, "type", self.device)))
        if not ev.frozen_cache:
            return key, None, None
        entry, path = frozen_cache.load(key)
        return key, entry, path

    def _remember(self, key: str, entry: dict[str, Any], what: str) -> None:
        from fastprompt.eval import frozen_cache

        path = frozen_cache.store(key, {"model": self.config.encoder.model, **entry})
        if path is not None:
            logger.info("frozen %s, %s: computed, cached in %s", self.config.encoder.model, what, path)

    def frozen_dev(self) -> list[dict[str, Any]]:
        """STS-B dev of the base model as a user gets it, no prompt and no trained head, in each of
        :func:`frozen_settings` (the bar the dev curve is drawn against), from the frozen-score cache when it
        holds them (:mod:`fastprompt.eval.frozen_cache`). Computed vectors stay in memory for the final
        evaluation."""
        from fastprompt.eval.sts import scores_from_pairs, sentence_vectors

        out = []
        for setting in self.frozen_settings:
            frozen = self._frozen_encoder(setting)
            key, cached, path = self._cached(frozen, setting, self.dev_data)
            if cached is not None and "stsb_dev" in cached:
                score = float(cached["stsb_dev"])
                logger.info("frozen %s, %s: STS-B dev %.2f (from the cache: %s; --no-cache recomputes)",
                            self.config.encoder.model, setting.source, score, path)
            else:
                pairs = self._encode(frozen, self.dev_data)
                self._frozen_vectors[setting.key] = sentence_vectors(pairs, self.dev_data)
                score = float(scores_from_pairs(pairs, self.dev_data)["stsb"])
                logger.info("frozen %s, %s: STS-B dev %.2f", self.config.encoder.model, setting.source, score)
                self._remember(key, {"kind": "stsb_dev", "stsb_dev": score}, f"{setting.source}, STS-B dev")
            out.append({"key": setting.key, **setting.describe(), "stsb_dev": score})
        return out

    def frozen_baseline(self, dev: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The seven test tasks of the base model as a user gets it (see :meth:`frozen_dev`): the primary setting's
        entry (``pooler``, ``template``, ``pooling_source``, ``stsb_dev``, ``test``) with the run's own pooling under
        ``same_pooling`` when it differs (else None). ``dev``: :meth:`frozen_dev`'s scores (computed now, in the
        same encoding pass as the test sets, when not given)."""
        from fastprompt.eval.sts import load_sts_tasks, scores_from_pairs

        ev = self.config.evaluation
        data = self.test_data if self.test_data is not None else load_sts_tasks(ev.sts_dir)
        known_dev = {d["key"]: d["stsb_dev"] for d in dev or []}
        entries = []
        for setting in self.frozen_settings:
            frozen = self._frozen_encoder(setting)
            key, cached, path = self._cached(frozen, setting, {**data, "_dev": self.dev_data["stsb"]})
            if cached is not None and "test" in cached:
                test, dev_score = dict(cached["test"]), float(known_dev.get(setting.key, cached["stsb_dev"]))
                logger.info("frozen %s, %s: STS-B dev %.2f, seven-task average %.2f (from the cache: %s; --no-cache "
                            "recomputes)", self.config.encoder.model, setting.source, dev_score, test["avg"], path)
                entries.append({"key": setting.key, **setting.describe(), "stsb_dev": dev_score, "test": test})
                continue
            # without the dev score, the dev sentences join the test sets' encoding pass
            datasets = data if setting.key in known_dev else {**data, "_dev": self.dev_data["stsb"]}
            pairs = self._encode(frozen, datasets, self._frozen_vectors.get(setting.key),
                                 what=f"frozen model, {setting.pooler} pooling")
            test = scores_from_pairs({k: pairs[k] for k in data}, data)
            dev_score = (known_dev[setting.key] if setting.key in known_dev
                         else scores_from_pairs({"stsb": pairs["_dev"]}, self.dev_data)["stsb"])
            logger.info("frozen %s, %s: STS-B dev %.2f, seven-task average %.2f", self.config.encoder.model,
                        setting.source, dev_score, test["avg"])
            self._remember(key, {"kind": "test", "stsb_dev": float(dev_score), "test": test},
                           f"{setting.source}, the seven test tasks")
            entries.append({"key": setting.key, **setting.describe(), "stsb_dev": dev_score, "test": test})
        return frozen_summary(entries)

    def final(self, best_dir: Path, frozen_dev: list[dict[str, Any]] | None = None
              ) -> tuple[dict[str, float] | None, dict[str, Any] | None]:
        """The end of a completed run: the test table of ``best_dir`` and, with ``frozen_baseline``, the frozen
        model's scores; (None, None) when the config asks for no final evaluation or there is no best/."""
        ev = self.config.evaluation
        if ev.sts_dir is None or not ev.final_eval or not best_dir.is_dir():
            return None, None
        test = self.test(best_dir, known=self._best_vectors)  # best/ holds the weights of that dev evaluation
        return test, (self.frozen_baseline(frozen_dev) if ev.frozen_baseline else None)
