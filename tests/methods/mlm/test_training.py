"""A run with ``do_mlm`` from config keys alone: mlm columns in train_log.csv, the schedule per step, the head's
trained tensors saved (the tied_new head's transform; the whole checkpoint head, its untied decoder included, as
DCPCSE's code trains it), and an interrupted run that resumes bit for bit (masks included)."""
import csv
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastprompt.train import Trainer


def _rows(run_dir):
    with open(Path(run_dir) / "train_log.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("head", ["tied_new", "checkpoint"])
def test_do_mlm_run_logs_trains_and_resumes_exactly(base_config, tmp_path, head, request):
    model = {} if head == "tied_new" else {"model": str(request.getfixturevalue("tiny_bert_masked_lm"))}
    cfg = base_config(output_dir=str(tmp_path / "ref"), max_steps=4, log_every=1, save_steps=2, eval_steps=100,
                      prompt_dropout=0.1, micro_batch_size=5, do_mlm=True, mlm_head=head, mlm_weight=0.2,
                      mlm_decay_rate=0.5, mlm_decay_steps=2, **model)
    trainer = Trainer(cfg)
    trainer.train()
    rows = _rows(tmp_path / "ref")
    assert {"loss_sentence", "loss_mlm", "w_mlm"} <= set(rows[0])
    assert [float(r["w_mlm"]) for r in rows] == pytest.approx([0.2 * 0.5 ** (s / 2) for s in range(4)], rel=1e-5)
    for r in rows:
        assert float(r["loss_mlm"]) > 0
        total = float(r["loss_sentence"]) + float(r["w_mlm"]) * float(r["loss_mlm"])
        assert float(r["loss"]) == pytest.approx(total, rel=1e-4)
    saved = load_file(str(tmp_path / "ref" / "last" / "method.safetensors"))
    assert "terms.0.head.predictions.transform.dense.weight" in saved
    emb = trainer.encoder.backbone.get_input_embeddings().weight
    if head == "tied_new":
        assert not any("decoder.weight" in k for k in saved)  # tied to the frozen word embeddings: not saved
    else:  # DCPCSE's code: the decoder is the head's own copy, trained (the embeddings stay frozen)
        decoder = saved["terms.0.head.predictions.decoder.weight"]
        assert decoder.shape == emb.shape and not torch.equal(decoder, emb.detach().cpu())

    run = dict(cfg, output_dir=str(tmp_path / "run"))

    def interrupt_at_step_2(trainer, out):
        if trainer.state.global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    assert Trainer(run, callbacks=[interrupt_at_step_2]).train()["status"] == "interrupted"
    assert Trainer(run).train()["global_step"] == 4
    for name in ("prompt.safetensors", "method.safetensors"):
        a, b = (load_file(str(tmp_path / d / "last" / name)) for d in ("run", "ref"))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
    with pytest.raises(ValueError, match="do_mlm"):
        Trainer(dict(run, do_mlm=False, max_steps=5)).train()
