"""No code from a model folder runs unless asked: transformers' "run the custom code? [y/N]" is never left to read
a "y" from standard input. Each way a model gets loaded (encode, train, import --from peft, make-replacements,
generate-ski --llm local) is tried with a folder whose config.json maps the model to a .py file that writes a marker
file, and "y" on stdin: the marker is never written, and the error is one line naming --trust-remote-code."""
import ast
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastprompt import remote_code
from fastprompt.cli import main

REPO = Path(__file__).resolve().parents[1]
EVIL = '''
import pathlib
pathlib.Path({marker!r}).write_text("the model folder's code ran")
from transformers import BertConfig, BertModel, BertForMaskedLM

class EvilConfig(BertConfig):
    model_type = "evil-model"

class EvilModel(BertModel):
    config_class = EvilConfig

class EvilForMaskedLM(BertForMaskedLM):
    config_class = EvilConfig
'''


def _evil_folder(tiny_bert_dir: Path, where: Path, model_type: str) -> tuple[Path, Path]:
    """A copy of the tiny BERT whose config.json names evil.py's classes (auto_map); returns (folder, marker)."""
    folder, marker = where / f"evil-{model_type}", where / f"marker-{model_type}"
    shutil.copytree(tiny_bert_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                                                   "AutoModelForMaskedLM": "evil.EvilForMaskedLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))
    return folder, marker


@pytest.fixture(params=["bert", "evil-model"])
def evil(request, tiny_bert_dir, tmp_path, monkeypatch):
    """("bert"): a known model type that names its own code, refused by fastprompt before transformers reads it.
    ("evil-model"): a type only its code defines, with fastprompt's check switched off, so transformers itself
    must refuse: this shows every load passes trust_remote_code=False rather than leaving it to the prompt."""
    folder, marker = _evil_folder(tiny_bert_dir, tmp_path, request.param)
    if request.param == "evil-model":
        monkeypatch.setattr(remote_code, "check_remote_code", lambda model, trust: None)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 20))  # what a careless `echo y |` gives
    return folder, marker


@pytest.fixture
def base_config(tiny_bert_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"sentence number {i} is here\n" for i in range(32)))

    def make(**overrides):
        return dict(model=str(tiny_bert_dir), train_file=str(corpus), output_dir=str(tmp_path / "run"), batch_size=8,
                    max_length=16, prompt_length=4, max_steps=2, num_threads=1, progress_bar=False, **overrides)

    return make


def _refused(code: int, capsys, marker: Path) -> None:
    err = capsys.readouterr().err
    assert code == 2 and not marker.exists(), err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line and "Loading weights" not in line]
    assert len(lines) == 1 and lines[0].startswith("fastprompt ") and "--trust-remote-code" in err, err


def test_encode_and_eval(evil, tmp_path, capsys):
    folder, marker = evil
    (tmp_path / "s.txt").write_text("a man plays\n")
    _refused(main(["encode", "--model", str(folder), "--input", str(tmp_path / "s.txt"), "--output",
                   str(tmp_path / "e.npy")]), capsys, marker)


def test_train(evil, base_config, capsys):
    folder, marker = evil
    cfg = dict(base_config(), model=str(folder))
    _refused(main(["train"] + [f"--set={k}={v}" for k, v in cfg.items()]), capsys, marker)


def test_import_of_a_peft_adapter_naming_such_a_base_model(evil, tiny_bert_dir, tmp_path, capsys):
    from fastprompt.integrations.peft import export_peft
    from fastprompt.model import PromptConfig, PromptEncoder

    folder, marker = evil
    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2))
    adapter = export_peft(encoder, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(dict(config, base_model_name_or_path=str(folder))))
    capsys.readouterr()
    _refused(main(["import", "--from", "peft", "--checkpoint", str(adapter), "--output", str(tmp_path / "p")]),
             capsys, marker)


def test_make_replacements_generator(evil, base_config, tmp_path, capsys):
    folder, marker = evil
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(base_config(rtd_weight=0.01, rtd_generator=str(folder))))
    capsys.readouterr()
    _refused(main(["make-replacements", "--config", str(recipe), "--output", str(tmp_path / "r.jsonl")]),
             capsys, marker)


def test_generate_ski_local_llm(evil, tmp_path, capsys):
    folder, marker = evil
    (tmp_path / "s.txt").write_text("A cat sat on the mat.\n")
    _refused(main(["generate-ski", "--llm", "local", "--model", str(folder), "--input", str(tmp_path / "s.txt"),
                   "--output", str(tmp_path / "ski.csv")]), capsys, marker)


@pytest.mark.heavy  # command processes
def test_echo_y_into_the_command_runs_nothing_and_the_flag_runs_it(tiny_bert_dir, tmp_path):
    """The reported case, as a user runs it: `echo y | fastprompt encode --model FOLDER`; then, asked explicitly
    with --trust-remote-code, the folder's code does run (in a scratch module cache)."""
    folder, marker = _evil_folder(tiny_bert_dir, tmp_path, "bert")
    (tmp_path / "s.txt").write_text("a man plays\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_MODULES_CACHE=str(tmp_path / "modules"))
    args = [sys.executable, "-m", "fastprompt.cli", "encode", "--model", str(folder), "--input",
            str(tmp_path / "s.txt"), "--output", str(tmp_path / "e.npy")]
    res = subprocess.run(args, input="y\n", env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and not marker.exists(), res.stderr[-2000:]
    assert res.stderr.strip().count("\n") == 0 and "asks to run its own Python code" in res.stderr
    assert "evil.EvilModel" in res.stderr and "--trust-remote-code" in res.stderr and "[y/N]" not in res.stdout
    res = subprocess.run(args + ["--trust-remote-code"], input="", env=env, capture_output=True, text=True,
                         timeout=300)
    assert marker.read_text() == "the model folder's code ran", res.stderr[-2000:]


def test_every_transformers_load_passes_trust_remote_code():
    """Static guard: a new Auto*.from_pretrained / from_config call without an explicit trust_remote_code would
    bring the [y/N] prompt back."""
    missing = []
    for path in [*(REPO / "fastprompt").rglob("*.py"), *(REPO / "bench").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("from_pretrained", "from_config") and isinstance(node.func.value, ast.Name)
                    and node.func.value.id.startswith("Auto")
                    and not any(k.arg == "trust_remote_code" for k in node.keywords)):
                missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, missing
