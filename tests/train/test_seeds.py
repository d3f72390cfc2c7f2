"""`fastprompt train --seeds`: one recipe over several seeds, each in its own resumable run, and the table of
mean ± sample standard deviation of their STS test results."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from fastprompt.train import load_config
from fastprompt.train.seeds import COLUMNS, parse_seeds, seeds_markdown, train_seeds

from .test_cli import _main


def _recipe(tmp_path, base_config, tiny_sts_dir, **keys):
    cfg = base_config(max_steps=4, eval_steps=2, sts_dir=str(tiny_sts_dir), **keys)
    cfg.pop("output_dir")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def test_three_seeds_of_a_tiny_model_write_the_mean_and_std_table(base_config, tiny_sts_dir, tmp_path, capsys):
    recipe = _recipe(tmp_path, base_config, tiny_sts_dir, frozen_baseline=True)
    out = tmp_path / "seeds"
    argv = ["train", "--config", str(recipe), "--seeds", "1,2,3", "--output-dir", str(out)]
    assert _main(argv) == 0
    printed = capsys.readouterr().out
    table = json.loads((out / "seeds.json").read_text(encoding="utf-8"))
    assert table["seeds"] == table["completed"] == [1, 2, 3] and table["n"] == 3 and table["not_completed"] == []
    rows = {}
    for seed in (1, 2, 3):
        summary = json.loads((out / f"seed-{seed}" / "summary.json").read_text(encoding="utf-8"))
        assert summary["status"] == "completed" and summary["config"]["seed"] == seed
        assert summary["config"]["output_dir"] == str(out / f"seed-{seed}")
        assert (out / f"seed-{seed}" / "best" / "prompt.safetensors").is_file()
        # the frozen model does not depend on the seed: only the first run scores it
        assert (summary["frozen_baseline"] is not None) == (seed == 1)
        rows[seed] = summary["test"]
    assert [r["test"] for r in table["runs"]] == [{c: rows[s][c] for c in COLUMNS} for s in (1, 2, 3)]
    assert len({rows[s]["avg"] for s in rows}) == 3  # the seeds train differently
    for c in COLUMNS:  # numpy's mean and sample std (ddof=1), independent of the module's arithmetic
        values = np.array([rows[s][c] for s in (1, 2, 3)])
        assert table["mean_over_seeds"][c] == pytest.approx(values.mean(), abs=1e-9)
        assert table["std_over_seeds"][c] == pytest.approx(values.std(ddof=1), abs=1e-9)
    md = (out / "seeds.md").read_text(encoding="utf-8")
    assert md == seeds_markdown(table) and md in printed
    lines = md.splitlines()
    assert lines[0].startswith("| | STS12 | STS13 | STS14 | STS15 | STS16 | STS-B | SICK-R | Avg. |")
    assert lines[2].startswith("| frozen base model (cls pooling, no prompt) |")
    for seed, line in zip((1, 2, 3), lines[3:6]):
        assert line.startswith(f"| seed {seed} | {rows[seed]['sts12']:.2f} |")
    mean = lines[6]
    assert mean.startswith("| mean ± std (3 seeds) | ")
    m, s = table["mean_over_seeds"], table["std_over_seeds"]
    assert f"| {m['sts12']:.2f} ± {s['sts12']:.2f} |" in mean and f"| **{m['avg']:.2f} ± {s['avg']:.2f}** |" in mean


def test_rerun_skips_completed_seeds_and_resumes_the_rest(base_config, tiny_sts_dir, tmp_path):
    """An interrupted seed stops the loop; the same call again trains only what is missing, and a completed
    seed with other settings is handed back to the trainer (which decides: resume, or refuse)."""
    cfg = load_config(_recipe(tmp_path, base_config, tiny_sts_dir), {"output_dir": str(tmp_path / "s")})
    from fastprompt.train import Trainer

    calls = []

    def interrupt_seed_2(c):
        calls.append(c.seed)
        if c.seed == 2:
            return {"status": "interrupted"}
        return Trainer(c).train()

    table = train_seeds(cfg, [1, 2, 3], run=interrupt_seed_2)
    assert calls == [1, 2] and table["completed"] == [1] and table["not_completed"] == [2, 3]
    assert "Not completed (left out of the mean): seeds 2, 3." in (tmp_path / "s" / "seeds.md").read_text()
    assert table["std_over_seeds"]["avg"] is None  # one seed: no standard deviation
    calls.clear()
    table = train_seeds(cfg, [1, 2, 3], run=lambda c: calls.append(c.seed) or Trainer(c).train())
    assert calls == [2, 3] and table["completed"] == [1, 2, 3]
    calls.clear()
    cfg.learning_rate = 5e-3  # another setting: seed 1's completed run is not silently reused
    train_seeds(cfg, [1], run=lambda c: calls.append(c.seed) or {"status": "completed", "test": None})
    assert calls == [1]
    calls.clear()
    cfg.learning_rate, cfg.resume = 1e-2, False  # --no-resume: the trainer decides (starts over, or refuses)
    train_seeds(cfg, [1], run=lambda c: calls.append(c.seed) or {"status": "completed", "test": None})
    assert calls == [1]


def test_a_diverged_seed_is_reported_and_left_out(base_config, tiny_sts_dir, tmp_path):
    from fastprompt.train import TrainingDiverged

    cfg = load_config(_recipe(tmp_path, base_config, tiny_sts_dir), {"output_dir": str(tmp_path / "d")})
    fake = {s: {c: float(s + i) for i, c in enumerate(COLUMNS)} for s in (1, 3)}

    def run(c):
        if c.seed == 2:
            raise TrainingDiverged("stopped at step 3")
        return {"status": "completed", "test": fake[c.seed], "best_stsb_dev": 50.0 + c.seed, "best_step": 2}

    table = train_seeds(cfg, [1, 2, 3], run=run)
    assert table["completed"] == [1, 3] and table["runs"][1]["status"] == "diverged"
    assert table["mean_over_seeds"]["avg"] == pytest.approx(9.0)
    assert table["std_over_seeds"]["avg"] == pytest.approx(math.sqrt(2.0))
    assert table["mean_over_seeds"]["stsb_dev"] == pytest.approx(52.0)
    assert "| seed 2 | — |" in seeds_markdown(table)


def test_bad_seed_arguments_fail_before_training(base_config, tiny_sts_dir, tmp_path, capsys):
    recipe = _recipe(tmp_path, base_config, tiny_sts_dir)
    out = str(tmp_path / "never")
    for argv, message in ((["--seeds", "1,x"], "comma-separated integers"), (["--seeds", "1,1"], "distinct"),
                          (["--seeds", ","], "names no seed"),
                          (["--seeds", "1,2", "--set", "seed=4"], "leave out --set seed"),
                          (["--seeds", "1,2", "--set", "sts_dir=null"], "set sts_dir")):
        assert _main(["train", "--config", str(recipe), "--output-dir", out, *argv]) == 2
        assert message in capsys.readouterr().err
    assert not Path(out).exists()
    assert parse_seeds("42, 43,44") == [42, 43, 44]


@pytest.mark.parametrize("content, message", [
    ("[1]", r"seed-1/summary.json must be a JSON object, got \[1\]"),  # an AttributeError before
    ('{"status": "completed", "dev_his', r"seed-1/summary.json is corrupt \(not valid UTF-8 JSON\)"),
    (json.dumps({"status": "completed", "dev_history": [], "test": {"sts12": "abc"}}),
     r"seed-1/summary.json: key 'test.sts12' must be a number, got 'abc'"),
    (json.dumps({"status": "completed", "dev_history": [], "test": {"sts12": 1.0}}),
     r"seed-1/summary.json: key 'test' has no sts13, sts14"),
])
def test_a_malformed_seed_summary_is_one_line_naming_it(base_config, tiny_sts_dir, tmp_path, content, message):
    """Issue 40, items 11 and 15: a seed's summary.json of the wrong shape (or truncated) is one line naming the
    file and the key, with what to do, before anything trains."""
    cfg = load_config(_recipe(tmp_path, base_config, tiny_sts_dir), {"output_dir": str(tmp_path / "s")})
    (tmp_path / "s" / "seed-1").mkdir(parents=True)
    (tmp_path / "s" / "seed-1" / "summary.json").write_text(content, encoding="utf-8")
    calls = []
    with pytest.raises(ValueError, match=message + ".*; delete it and rerun: seed 1 then resumes from its last/"):
        train_seeds(cfg, [1, 2], run=lambda c: calls.append(c.seed))
    assert calls == []


def test_every_seed_is_checked_before_the_first_trains(base_config, tiny_sts_dir, tmp_path, capsys):
    """Issue 40, item 15: --seeds 1,5000000000 trained and evaluated seed 1 before refusing the second."""
    with pytest.raises(ValueError, match=r"--seeds: 5000000000 is not a seed: a run's seed is in \[0, 4294967295\]"):
        parse_seeds("1,5000000000")
    recipe = _recipe(tmp_path, base_config, tiny_sts_dir)
    out = tmp_path / "never"
    assert _main(["train", "--config", str(recipe), "--output-dir", str(out), "--seeds", "1,5000000000"]) == 2
    assert "5000000000 is not a seed" in capsys.readouterr().err and not out.exists()
    cfg = load_config(recipe, {"output_dir": str(out)})
    calls = []
    with pytest.raises(ValueError, match=r"seed must be in \[0, 4294967295\], got 5000000000"):
        train_seeds(cfg, [1, 5000000000], run=lambda c: calls.append(c.seed))  # the Python API too
    assert calls == []


def test_one_seed_is_not_called_a_mean_and_std(base_config, tiny_sts_dir, tmp_path):
    """``--seeds 42`` alone wrote "mean ± std (1 seeds)" over a row without a standard deviation."""
    cfg = load_config(_recipe(tmp_path, base_config, tiny_sts_dir), {"output_dir": str(tmp_path / "one")})

    def run(c):
        return {"status": "completed", "test": {c: 70.0 for c in COLUMNS}, "best_stsb_dev": 80.0, "best_step": 2}

    md = seeds_markdown(train_seeds(cfg, [42], run=run))
    assert "| mean (1 seed, no std) | 70.00 |" in md and "±" not in md.split("\n\n")[0]
