"""The configs/d2cse-* paper recipes hold D2CSE's Table 7 and DiffCSE's code where the paper is silent.

Every value of these recipes, with its source, is transcribed once in tests/train/paper_values.yaml and checked
there (tests/train/test_paper_values.py); this file checks which recipes exist, and the MiniLM recipe's
documented deviation.
"""
from pathlib import Path

from fastprompt.train import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAPER = sorted(p.name for p in CONFIGS.glob("d2cse-*.yaml") if "minilm" not in p.name)


def test_the_five_table_7_recipes_exist():
    """Table 7 has five columns: unsupervised BERT-base, BERT-large, RoBERTa-base; supervised BERT-base,
    RoBERTa-base."""
    assert PAPER == ["d2cse-sup-bert-base.yaml", "d2cse-sup-roberta-base.yaml", "d2cse-unsup-bert-base.yaml",
                     "d2cse-unsup-bert-large.yaml", "d2cse-unsup-roberta-base.yaml"]
    for name in PAPER:
        assert "UNVERIFIED" not in (CONFIGS / name).read_text(encoding="utf-8")


def test_minilm_recipe_says_where_it_departs_from_the_paper_recipes():
    """The CPU recipe keeps Table 7's unsupervised BERT-base [CLS] prompt (off) and says why its RTD average
    differs from the paper recipes'."""
    text = (CONFIGS / "d2cse-unsup-minilm.yaml").read_text(encoding="utf-8")
    cfg = load_config(CONFIGS / "d2cse-unsup-minilm.yaml")
    assert cfg.cls_prompt is False and cfg.rtd_average == "tokens"
    line = next(ln for ln in text.splitlines() if ln.startswith("rtd_average:"))
    assert "deviation" in line and "issue" not in text.lower()
