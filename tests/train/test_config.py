"""TrainConfig: YAML + --set overrides, type coercion, and clear errors for bad values."""
from pathlib import Path

import pytest
import yaml

from fastprompt.train import TrainConfig, load_config, parse_overrides

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    # PyYAML reads 3e-2 (no dot) as a string: it must still become a float
    p.write_text("model: some/model\nlearning_rate: 3e-2\nbatch_size: 16\nsts_dir: /x\n", encoding="utf-8")
    cfg = load_config(p, ["batch_size=32", "sts_dir=null", "precision=bf16", "mlp=train", "epochs=0.5"])
    assert cfg.model == "some/model" and cfg.learning_rate == 0.03 and isinstance(cfg.learning_rate, float)
    assert cfg.batch_size == 32 and cfg.sts_dir is None and cfg.precision == "bf16" and cfg.epochs == 0.5
    assert parse_overrides(["a=1", "b=x=y", "c="]) == {"a": 1, "b": "x=y", "c": ""}


@pytest.mark.parametrize("overrides,message", [
    (["lerning_rate=1"], "unknown config key 'lerning_rate'.*did you mean 'learning_rate'"),
    (["batch_size=1"], "batch_size must be >= 2.*negative"),
    (["pooler=avg"], "pooler must be one of cls, cls_before_pooler"),
    (["objective=mse"], "objective must be one of simcse, promcse_eh"),
    (["precision=fp8"], "precision must be one of fp32, bf16, fp16"),
    (["epochs=abc"], "epochs must be a number"),
    (["max_steps=1.5"], "max_steps must be an integer"),
    (["resume=maybe"], "resume must be true or false"),
    (["learning_rate=0"], "learning_rate must be > 0"),
    (["warmup_ratio=1.5"], "warmup_ratio must be in"),
    (["epochs=0"], "set epochs > 0 or max_steps > 0"),
    (["model=null"], "model must not be null"),
    (["shared_across_layers=true", "input_layer_only=true"], "mutually exclusive"),
    (["batch_size"], "--set expects key=value"),
])
def test_bad_values_raise_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(ValueError, match="must be a YAML mapping"):
        load_config(p)
    p.write_text("a: [\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(p)
    # binary garbage: every error names the file (not a bare UnicodeDecodeError or YAML reader error)
    p.write_bytes(b"lr: 1\n\x89PNG\xff\xfe")
    with pytest.raises(ValueError, match=f"config {p} is not UTF-8 text .line 2, byte 6"):
        load_config(p)
    p.write_bytes(b"lr: 1\n\x00\x01\x02")
    with pytest.raises(ValueError, match=f"{p}: a binary file, not UTF-8 text .a NUL byte on line 2"):
        load_config(p)
    p.write_bytes(b"lr: \x07\n")  # a control character YAML does not accept
    with pytest.raises(ValueError, match=f"config {p} is not valid YAML"):
        load_config(p)


def test_prompt_config_fields_match_the_model():
    from fastprompt.model import PromptConfig

    cfg = TrainConfig(prompt_length=7, prefix_projection=True, prompt_init="uniform")
    pc = PromptConfig.from_dict(cfg.prompt_config_dict())
    assert pc.prompt_length == 7 and pc.prefix_projection and pc.init == "uniform"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_are_valid(path):
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    cfg = load_config(path)
    assert set(raw) <= set(cfg.to_dict())
    assert cfg.output_dir and cfg.train_file


def test_there_are_paper_and_minilm_configs():
    names = {p.name for p in CONFIGS}
    assert {"minilm-unsup.yaml", "minilm-sup.yaml", "quickstart.yaml"} <= names
    for setting in ("unsup", "sup"):
        for model in ("bert-base", "bert-large", "roberta-base", "roberta-large"):
            assert f"promcse-{setting}-{model}.yaml" in names and f"dcpcse-{setting}-{model}.yaml" in names
