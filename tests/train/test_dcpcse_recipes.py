"""Every configs/dcpcse-*.yaml paper recipe holds DCPCSE's hyper-parameters, as its authors published them.

Sources (YJiangcm/DCPCSE, commit fea587b, the last README before the repository became PromCSE's; the README's
"Hyperparameters" tables give the paper's per-model settings, Tables 3 and 4 of arXiv:2203.06875):
  README, unsupervised table: batch size, learning rate, prompt length, do_mlm, epochs, valid steps
  README, supervised table: the same rows (batch 256 and 10 epochs for every model)
  train.py: --mlm_weight 0.1, --mlm_probability 0.15 (defaults); dcpcse/trainers.py: the MLM weight decays as
  0.95 ** (global_step / 100); run_*_example.sh: --max_seq_length 32, --temp 0.05, --pooler_type cls,
  --mlp_only_train (unsupervised only), --fp16, --eval_steps 125
  dcpcse/models.py: prompt dropout = the backbone's hidden dropout (0.1 for BERT/RoBERTa)
"""
from pathlib import Path

import pytest

from fastprompt.train import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

#: model, batch_size, learning_rate, prompt_length, do_mlm, epochs: the README's two tables, column by column.
TABLE = {
    "dcpcse-unsup-bert-base.yaml": ("bert-base-uncased", 256, 3e-2, 16, False, 1),
    "dcpcse-unsup-bert-large.yaml": ("bert-large-uncased", 256, 3e-2, 10, False, 1),
    "dcpcse-unsup-roberta-base.yaml": ("roberta-base", 64, 3e-2, 14, True, 1),
    "dcpcse-unsup-roberta-large.yaml": ("roberta-large", 64, 1e-2, 10, True, 1),
    "dcpcse-sup-bert-base.yaml": ("bert-base-uncased", 256, 5e-3, 12, False, 10),
    "dcpcse-sup-bert-large.yaml": ("bert-large-uncased", 256, 5e-3, 12, False, 10),
    "dcpcse-sup-roberta-base.yaml": ("roberta-base", 256, 1e-2, 10, False, 10),
    "dcpcse-sup-roberta-large.yaml": ("roberta-large", 256, 5e-3, 10, False, 10),
}
#: what every DCPCSE recipe shares (run_*_example.sh, train.py, trainers.py, models.py)
COMMON = dict(max_length=32, temperature=0.05, pooler="cls", precision="fp16", eval_steps=125, prompt_dropout=0.1,
              prefix_projection=False, hard_negative_weight=0.0, objective="simcse")
MLM = dict(mlm_weight=0.1, mlm_decay_rate=0.95, mlm_decay_steps=100, mlm_probability=0.15, mlm_head="checkpoint")


def test_the_table_covers_every_dcpcse_paper_recipe():
    assert sorted(p.name for p in CONFIGS.glob("dcpcse-*.yaml") if "minilm" not in p.name) == sorted(TABLE)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_recipe_matches_the_papers_table(name):
    cfg = load_config(CONFIGS / name).to_dict()
    model, batch, lr, length, mlm, epochs = TABLE[name]
    supervised = name.startswith("dcpcse-sup")
    expected = dict(COMMON, model=model, batch_size=batch, learning_rate=lr, prompt_length=length, do_mlm=mlm,
                    epochs=epochs, max_steps=0, mlp="always" if supervised else "train",
                    train_file="data/nli_for_simcse.csv" if supervised else "data/wiki1m_for_simcse.txt")
    if mlm:
        expected |= MLM
    assert {k: cfg[k] for k in expected} == expected
