"""The final evaluation logs its progress when no progress bar is shown, with the same vectors."""
import logging

import numpy as np

from fastprompt.model import PromptEncoder
from fastprompt.train import Trainer
from fastprompt.train.progress import LoggedEncoder


def test_logged_encoder_gives_the_same_vectors_and_logs(tiny_bert_dir, caplog):
    enc = PromptEncoder.from_pretrained(str(tiny_bert_dir))
    sentences = [("word " * (i % 7 + 1)).strip() + f" {i}" for i in range(53)]
    caplog.set_level(logging.INFO, logger="fastprompt")
    got = LoggedEncoder(enc, "test eval", reports=4).encode(sentences, batch_size=5)
    np.testing.assert_array_equal(got, enc.encode(sentences, batch_size=5))  # the same batches, bit for bit
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("test eval: encoded")]
    assert len(lines) == 4 and lines[-1].startswith("test eval: encoded 53/53 sentences")


def test_final_evaluation_is_logged_without_a_terminal(base_config, tiny_sts_dir, caplog):
    caplog.set_level(logging.INFO, logger="fastprompt")
    summary = Trainer(base_config(max_steps=2, sts_dir=str(tiny_sts_dir))).train()  # progress_bar=False
    assert summary["test"] is not None
    assert "final evaluation: encoded" in caplog.text
    assert sum("sentences (" in r.getMessage() for r in caplog.records if "final evaluation" in r.getMessage()) >= 2
