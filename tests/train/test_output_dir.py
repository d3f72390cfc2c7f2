"""A run never replaces what it did not write: a folder holding the user's own files is refused unless
overwrite_output_dir=true, and a fresh start over an earlier run deletes it only once the new run's setup worked.
Every test compares the user's files byte for byte before and after."""
import json
from pathlib import Path

import pytest

from fastprompt.cli import main
from fastprompt.train import Trainer
from fastprompt.train.checkpoints import RunDirectory

FOREIGN = "holds files that no fastprompt run wrote"


def _snapshot(root: Path, skip=()) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes), without the names in ``skip``."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).parts[0] not in skip}


def _user_files(root: Path, names) -> None:
    for name in names:
        if name in ("best", "last"):
            (root / name).mkdir(parents=True)
            (root / name / "notes.txt").write_text(f"my own {name} results\n")
        else:
            root.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(f"my own {name}\n" if name != "summary.json" else '{"mine": true}\n')


@pytest.mark.parametrize("names", [["best"], ["last"], ["config.yaml"], ["train_log.csv"], ["summary.json"],
                                   ["best", "last", "config.yaml", "train_log.csv", "summary.json"]],
                         ids=["best", "last", "config", "log", "summary", "all"])
def test_a_folder_of_the_users_files_is_refused_and_left_as_it_was(base_config, tmp_path, names):
    out = tmp_path / "mine"
    _user_files(out, names)
    before = _snapshot(out)
    with pytest.raises(ValueError, match=FOREIGN + r".*set overwrite_output_dir=true"):
        Trainer(base_config(output_dir=str(out))).train()
    assert _snapshot(out) == before
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # no lock, no train.log: nothing was written


def test_output_dir_dot_in_a_project_folder_is_refused_from_the_cli(base_config, tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "README.md").write_text("# my project\n")
    (project / "config.yaml").write_text("model: mine  # my recipe, with comments\n")
    (project / "src" / "app.py").write_text("print('hello')\n")
    before = _snapshot(project)
    monkeypatch.chdir(project)
    cfg = base_config(max_steps=1)
    args = ["train", "--output-dir", "."] + [f"--set={k}={v}" for k, v in cfg.items() if k != "output_dir"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and FOREIGN in err and "README.md" in err and "Traceback" not in err
    assert _snapshot(project) == before and sorted(p.name for p in project.iterdir()) == ["README.md", "config.yaml",
                                                                                          "src"]


def test_overwrite_output_dir_lets_a_run_into_a_folder_with_other_files_and_keeps_them(base_config, tmp_path):
    out = tmp_path / "shared"
    _user_files(out, ["README.md"])
    before = _snapshot(out)
    summary = Trainer(base_config(output_dir=str(out), max_steps=2, overwrite_output_dir=True)).train()
    assert summary["status"] == "completed"
    assert _snapshot(out, skip={"best", "last", "config.yaml", "train_log.csv", "train.log", "summary.json",
                                "tensorboard", ".fastprompt.lock"}) == before


def test_an_earlier_run_and_the_leftovers_of_an_interrupted_one_are_a_runs_own(base_config, tmp_path):
    cfg = base_config(max_steps=2)
    Trainer(cfg).train()
    run = RunDirectory(cfg["output_dir"])
    (run.root / ".last.tmp-12345").mkdir()  # an atomic write killed half-way
    (run.root / ".summary.json.tmp-12345.json").write_text("{")  # fastprompt.io.atomic_file's temporary name
    (run.root / ".config.yaml.tmp-12345").write_text("")  # the name before one writer did every file
    assert run.foreign_entries() == []
    assert Trainer(dict(cfg, max_steps=3)).train()["global_step"] == 3  # resumes
    (run.root / "last" / "my-notes.txt").write_text("mine\n")  # a user's file inside the run's checkpoint
    assert run.foreign_entries() == ["last"]
    failed = tmp_path / "failed"  # a run that failed at setup left only its lock and log: still a run's folder
    failed.mkdir()
    (failed / ".fastprompt.lock").write_text("")
    (failed / "train.log").write_text("2026-01-01 00:00:00 INFO fastprompt: ...\n")
    assert RunDirectory(failed).foreign_entries() == []


RUN_NAMES = ("best", "last", "config.yaml", "train_log.csv", "summary.json")


@pytest.mark.parametrize("bad", ["model", "train_file"])
def test_a_fresh_start_that_fails_at_setup_keeps_the_previous_run(base_config, tmp_path, bad):
    cfg = base_config(max_steps=2)
    Trainer(cfg).train()
    out = Path(cfg["output_dir"])
    before = _snapshot(out, skip={"train.log", ".fastprompt.lock"})
    assert {Path(k).parts[0] for k in before} >= set(RUN_NAMES)
    typo = dict(cfg, resume=False, overwrite_output_dir=True, **{bad: str(tmp_path / "typo")})
    with pytest.raises((OSError, ValueError)):
        Trainer(typo).train()
    assert _snapshot(out, skip={"train.log", ".fastprompt.lock"}) == before
    # the same fresh start with good settings does replace the previous run
    summary = Trainer(dict(cfg, resume=False, overwrite_output_dir=True, max_steps=1)).train()
    assert summary["global_step"] == 1
    assert json.loads((out / "last" / "training_state.json").read_text())["trainer"]["state"]["global_step"] == 1


def test_cli_no_resume_with_a_typo_in_the_model_keeps_the_previous_run(base_config, tmp_path, capsys):
    cfg = base_config(max_steps=2)
    Trainer(cfg).train()
    out = Path(cfg["output_dir"])
    before = _snapshot(out, skip={"train.log", ".fastprompt.lock"})
    capsys.readouterr()  # the first run's progress bars
    args = (["train", "--no-resume", "--set", "overwrite_output_dir=true"]
            + [f"--set={k}={v}" for k, v in dict(cfg, model=str(tmp_path / "bert-typo")).items()])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bert-typo" in err
    assert _snapshot(out, skip={"train.log", ".fastprompt.lock"}) == before
