"""The CRTD term from config keys and the CLI: on-the-fly (a masked-LM folder as generator) and from a file
made ahead by `fastprompt make-replacements`; train_log.csv gets loss_rtd/w_rtd."""
import csv

import pytest
import torch
import yaml
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from fastprompt import cli
from fastprompt.data.replacements import ReplacementTable
from fastprompt.train import Trainer
from fastprompt.train.config import TrainConfig


def _log(run_dir):
    with open(run_dir / "train_log.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def tiny_mlm_dir(tiny_bert_dir, tmp_path_factory):
    """A tiny random BertForMaskedLM with the tiny BERT's vocabulary (a stand-in for DistilBERT)."""
    path = tmp_path_factory.mktemp("tiny-mlm")
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    torch.manual_seed(2)
    BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=64)).save_pretrained(path)
    return path


def test_config_builds_the_term_and_logs_rtd_columns(base_config, tiny_mlm_dir, tmp_path):
    cfg = TrainConfig(**base_config(rtd_weight=0.005, rtd_generator=str(tiny_mlm_dir), pooler="bn_mlp", mlp="train",
                                    max_steps=2, output_dir=str(tmp_path / "run")))
    Trainer(cfg).train()
    rows = _log(tmp_path / "run")
    assert {"loss_sentence", "loss_rtd", "w_rtd"} <= set(rows[0])
    assert float(rows[-1]["w_rtd"]) == 0.005 and float(rows[-1]["loss_rtd"]) > 0


def test_bad_rtd_keys_fail_clearly():
    with pytest.raises(ValueError, match="rtd_discriminator"):
        TrainConfig(rtd_weight=0.005, rtd_discriminator="shared")
    with pytest.raises(ValueError, match="rtd_masking_ratio"):
        TrainConfig(rtd_masking_ratio=1.5)
    with pytest.raises(ValueError, match="rtd_average must be one of tokens, positions"):
        TrainConfig(rtd_average="all")


def test_config_keys_reach_the_term(tiny_bert_dir):
    from fastprompt.methods.crtd.term import build_crtd_term
    from fastprompt.model import PromptEncoder

    enc = PromptEncoder.from_pretrained(tiny_bert_dir)
    cfg = TrainConfig(rtd_weight=0.005, rtd_average="positions", rtd_sampling="argmax", rtd_generator="random")
    term = build_crtd_term(cfg.rtd, enc)
    assert term.average == "positions" and term.weight.initial == 0.005


def test_make_replacements_then_train_from_the_file(base_config, tmp_path, capsys):
    keys = base_config(rtd_weight=0.01, rtd_generator="random", rtd_discriminator="plain", rtd_condition="none",
                       max_steps=2, output_dir=str(tmp_path / "run"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(keys))
    out = tmp_path / "rep.jsonl"
    assert cli.main(["make-replacements", "--config", str(recipe), "--output", str(out), "--seed", "1"]) == 0
    first = out.read_text()
    assert first and "added" in capsys.readouterr().out
    # resuming adds nothing and keeps the file
    assert cli.main(["make-replacements", "--config", str(recipe), "--output", str(out), "--seed", "1"]) == 0
    assert out.read_text() == first
    rc = cli.main(["train", "--config", str(recipe), "--set", f"rtd_replacements_file={out}"])
    assert rc == 0
    assert float(_log(tmp_path / "run")[-1]["loss_rtd"]) > 0
    # a file made with other settings is refused by name
    rc = cli.main(["train", "--config", str(recipe), "--set", f"rtd_replacements_file={out}",
                   "--set", "rtd_masking_ratio=0.2", "--output-dir", str(tmp_path / "run2")])
    assert rc == 2 and "masking_ratio" in capsys.readouterr().err


def test_make_replacements_device_option(base_config, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(base_config(rtd_weight=0.01, rtd_generator="random")))
    out = tmp_path / "rep.jsonl"
    args = ["make-replacements", "--config", str(recipe), "--output", str(out)]
    assert cli.main(args + ["--device", "cpu", "--batch-size", "7"]) == 0
    assert ReplacementTable(out).settings["sampling"] == "sample" and len(ReplacementTable(out)) > 7
    assert cli.main(args + ["--device", "nonsense"]) == 2
    assert "not a torch device" in capsys.readouterr().err
    assert cli.main(args + ["--batch-size", "0"]) == 2
    assert "--batch-size must be at least 1" in capsys.readouterr().err
