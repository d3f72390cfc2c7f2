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
    with pytest.raises(ValueError, match=f"{p}: not valid UTF-8 .line 2, byte 6"):
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
    assert set(raw) - {"base"} <= set(cfg.to_dict())
    assert cfg.output_dir and cfg.train_file


def test_there_are_paper_and_minilm_configs():
    names = {p.name for p in CONFIGS}
    assert {"minilm-unsup.yaml", "minilm-sup.yaml", "quickstart.yaml"} <= names
    for setting in ("unsup", "sup"):
        for model in ("bert-base", "bert-large", "roberta-base", "roberta-large"):
            assert f"promcse-{setting}-{model}.yaml" in names and f"dcpcse-{setting}-{model}.yaml" in names


# --------------------------------------------------------------------------- composed sections


def test_sections_own_the_keys_and_flat_keys_still_work():
    from fastprompt.model import PromptConfig
    from fastprompt.objectives.config import ObjectiveConfig
    from fastprompt.train.config import KEYS, SECTIONS

    cfg = TrainConfig(learning_rate=1e-3, prompt_length=8, prompt_init="uniform", objective="promcse_eh")
    assert isinstance(cfg.prompt, PromptConfig) and isinstance(cfg.loss, ObjectiveConfig)
    assert cfg.optim.learning_rate == cfg.learning_rate == 1e-3
    assert cfg.prompt.prompt_length == 8 and cfg.prompt.init == cfg.prompt_init == "uniform"
    assert cfg.loss.name == cfg.objective == "promcse_eh" and cfg.loss.resolved_hinge_weight == 10.0
    cfg.batch_size = 32  # a flat write lands in its section
    assert cfg.optim.batch_size == 32 and cfg.to_dict()["batch_size"] == 32
    with pytest.raises(AttributeError, match="unknown config key 'batchsize'"):
        cfg.batchsize = 3
    # every flat key belongs to one section, and no key is named like a section
    assert len(KEYS) == len(cfg.to_dict()) and not set(KEYS) & set(SECTIONS)
    # a whole section can be passed, flat keys override it
    cfg = TrainConfig(prompt=PromptConfig(5, prefix_projection=True), prompt_length=6)
    assert cfg.prompt.prompt_length == 6 and cfg.prompt.prefix_projection
    with pytest.raises(TypeError, match="section 'prompt' must be a PromptConfig"):
        TrainConfig(prompt={"prompt_length": 5})


def test_to_dict_is_flat_and_round_trips_old_flat_dicts():
    import json

    pinned = json.loads((Path(__file__).with_name("recipe_values.json")).read_text(encoding="utf-8"))
    old = pinned["promcse-sup-bert-base.yaml"]  # a flat dict as checkpoints and summaries store them
    cfg = TrainConfig.from_dict(old)
    flat = cfg.to_dict()
    # keys added after the snapshot take their defaults; every stored key comes back unchanged
    added = {k: v for k, v in TrainConfig().to_dict().items() if k not in old}
    assert flat == {**old, **added} and TrainConfig.from_dict(flat) == cfg
    assert all(not isinstance(v, dict) for v in cfg.to_dict().values())


def test_one_rule_per_key_whether_set_through_the_config_or_the_model():
    from fastprompt.model import PromptConfig

    for make in (lambda: TrainConfig(init_std=0), lambda: PromptConfig(init_std=0)):
        with pytest.raises(ValueError, match="init_std must be > 0"):
            make()
    for make in (lambda: TrainConfig(prompt_init="zeros"), lambda: PromptConfig(init="zeros")):
        with pytest.raises(ValueError, match="prompt_init must be one of normal, uniform, vocab"):
            make()
    with pytest.raises(ValueError, match="promcse_eh needs hinge_weight > 0"):
        TrainConfig(objective="promcse_eh", hinge_weight=0)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_devices_a_run_takes(device):
    assert TrainConfig(device=device).device == device  # syntax only: whether the machine has it is checked later


@pytest.mark.parametrize("device", ["gpu", "cudax", "cuda:", "cuda:x", "cuda:-1", "cpu:0", "auto:1", "CUDA", ""])
def test_a_malformed_device_fails_at_config_time(device):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N, got"):
        TrainConfig(device=device)


@pytest.mark.parametrize("key, choices", [("attn_backend", "auto, triton, cpu, reference"),
                                         ("loss_backend", "auto, triton, cpu, reference, chunked")])
def test_backend_typos_fail_at_config_time_with_the_choices(key, choices):
    with pytest.raises(ValueError, match=f"{key} must be one of {choices}; got 'trition'"):
        load_config(None, [f"{key}=trition"])


def test_a_bad_config_fails_before_torch_is_imported(tmp_path):
    """`fastprompt train --config bad.yaml` validates with the standard library + PyYAML only."""
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: 1\n", encoding="utf-8")
    code = ("import sys; from fastprompt.cli import main; rc = main(['train', '--config', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "batch_size must be >= 2" in proc.stderr


# --------------------------------------------------------------------------- base: recipes


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_base_chains_resolve_relative_to_each_recipe(tmp_path):
    (tmp_path / "bases").mkdir()
    _write(tmp_path / "bases" / "root.yaml", "model: m\nlearning_rate: 1e-2\nbatch_size: 16\nmax_length: 24\n")
    _write(tmp_path / "bases" / "mid.yaml", "base: root.yaml\nbatch_size: 32\n")
    leaf = _write(tmp_path / "leaf.yaml", "base: bases/mid.yaml\nlearning_rate: 5e-3\n")
    cfg = load_config(leaf, ["max_length=20"])
    assert (cfg.model, cfg.learning_rate, cfg.batch_size, cfg.max_length) == ("m", 5e-3, 32, 20)


def test_base_errors(tmp_path):
    a = _write(tmp_path / "a.yaml", "base: b.yaml\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ValueError, match="cycle: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        load_config(a)
    missing = _write(tmp_path / "m.yaml", "base: nope.yaml\n")
    with pytest.raises(FileNotFoundError, match="base config of .*m.yaml not found: .*nope.yaml"):
        load_config(missing)
    with pytest.raises(ValueError, match="base must be the path of another YAML recipe"):
        load_config(_write(tmp_path / "n.yaml", "base: [a.yaml]\n"))
    with pytest.raises(ValueError, match="--set base=... is not supported"):
        parse_overrides(["base=a.yaml"])
    _write(tmp_path / "d.yaml", "model: x\n")
    with pytest.raises(ValueError, match="unknown config key 'lerning_rate' in .*c.yaml"):
        load_config(_write(tmp_path / "c.yaml", "base: d.yaml\nlerning_rate: 1\n"))


def test_paper_recipes_are_a_base_plus_a_few_lines():
    # the papers' own settings (the MiniLM recipes are fastprompt's and may differ in more keys)
    paper = [p for p in CONFIGS if p.name.startswith(("dcpcse-", "promcse-")) and "minilm" not in p.name]
    assert len(paper) == 16
    for path in paper:
        keys = [k for k in yaml.safe_load(path.read_text(encoding="utf-8")) if k != "base"]
        assert "base" in yaml.safe_load(path.read_text(encoding="utf-8")), path.name
        assert len(keys) <= 5, f"{path.name} sets {keys}"
    bases = sorted((CONFIGS[0].parent / "base").glob("*.yaml"))
    assert len(bases) >= 3
    for base in bases:  # each base is a valid recipe on its own
        load_config(base)


def test_every_key_decides_whether_it_is_part_of_the_run_identity():
    """Each field says ``identity=True`` or ``False`` (fastprompt.fields.option): a new key cannot fall on either
    side of the resume check by omission, as keys did from the hand-kept list this replaced."""
    import dataclasses

    from fastprompt.fields import flat_key
    from fastprompt.train.checkpoints import RUN_IDENTITY_KEYS
    from fastprompt.train.config import KEYS, SECTIONS

    undecided = [flat_key(f) for cls, _ in SECTIONS.values() for f in dataclasses.fields(cls)
                 if not isinstance(f.metadata.get("identity"), bool)]
    assert undecided == []
    assert set(RUN_IDENTITY_KEYS) < set(KEYS)
    # Every setting of a token term defines its loss; how the run optimises and where it writes do not.
    assert {"mlm_probability", "rtd_masking_ratio", "rtd_generator", "rtd_sampling", "temperature"} <= set(
        RUN_IDENTITY_KEYS)
    assert not {"learning_rate", "max_steps", "precision", "attn_backend", "micro_batch_size", "output_dir",
                "resume", "sts_dir"} & set(RUN_IDENTITY_KEYS)


@pytest.mark.parametrize("keys, message", [
    (dict(hardness_mode="all_negatives"), "hardness_mode and hardness_strength go together"),
    (dict(hardness_strength=5.0), "hardness_mode and hardness_strength go together"),
    (dict(hardness_mode="hard", hardness_strength=5.0), "hardness_mode must be one of"),
    (dict(matryoshka_dims=[64, 64]), "distinct dimensions"),
    (dict(matryoshka_dims=[64, 0]), r"matryoshka_dims must be >= 1"),
    (dict(matryoshka_dims=[64, 32], matryoshka_weights=[1.0]), "one weight per dimension"),
    (dict(matryoshka_weights=[1.0]), "without matryoshka_dims"),
    (dict(fn_margin=-0.1), "fn_margin must be >= 0"),
    (dict(objective="skicse", matryoshka_dims=[8]), "objective=skicse does not take matryoshka_dims"),
    # bounded by what can train, the reason in the message (issue 40, item 8: each trained and said "completed")
    (dict(matryoshka_dims=[64, 32], matryoshka_weights=[0, 0]), r"are all 0: the loss would be 0 at every dimension"),
    (dict(hardness_mode="all_negatives", hardness_strength=1e30),
     r"hardness_strength must be in \[0, 1000\], got 1e\+30: strength x cosine is added to logits of at most"),
    (dict(hard_negative_weight=1e30), r"hard_negative_weight must be <= 1000, got 1e\+30: the logits themselves"),
    (dict(fn_margin=5), r"fn_margin=5 \(absolute\) must be < 2: cosines lie in \[-1, 1\]"),
    (dict(fn_margin=2, fn_margin_strategy="relative"), r"fn_margin=2 with fn_margin_strategy relative must be < 1"),
    (dict(temperature=1e-4), r"temperature must be >= 0.001, got 0.0001: below it float32 rounding"),
])
def test_loss_options_are_checked(keys, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**keys)


def test_loss_options_reach_the_objective():
    from fastprompt.objectives.registry import objective_from_config

    cfg = TrainConfig(hardness_mode="in_batch_negatives", hardness_strength=9, fn_margin=0.1,
                      fn_margin_strategy="relative", matryoshka_dims="384,128", matryoshka_weights=[1, 0.5])
    obj = objective_from_config(cfg.loss)
    assert obj.loss_options() == dict(hardness_mode="in_batch_negatives", hardness_strength=9.0, fn_margin=0.1,
                                      fn_margin_strategy="relative", matryoshka_dims=[384, 128],
                                      matryoshka_weights=[1.0, 0.5])
    assert objective_from_config(TrainConfig().loss).loss_options() == {}
    # the bounds' edges that still train: one weight of 0 (a dimension scored, not trained), margins just inside
    TrainConfig(matryoshka_dims=[64, 32], matryoshka_weights=[0, 1], fn_margin=1.9, hardness_strength=1000,
                hardness_mode="hard_negatives")
    TrainConfig(fn_margin=0.99, fn_margin_strategy="relative")
