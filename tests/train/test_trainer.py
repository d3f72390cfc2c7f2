"""Trainer end to end on a tiny random BERT: checkpoints, logs, evaluation, faults, exact resume."""
import csv
import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastprompt.model import PromptEncoder
from fastprompt.train import Trainer, TrainingDiverged


def _prompt(run_dir, which="last"):
    return load_file(str(Path(run_dir) / which / "prompt.safetensors"))


def _assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def _log_rows(run_dir):
    with open(Path(run_dir) / "train_log.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_train_writes_checkpoints_logs_and_summary(base_config, tiny_sts_dir, tmp_path):
    cfg = base_config(sts_dir=str(tiny_sts_dir), mlp="train")
    trainer = Trainer(cfg)
    trainer.setup()
    initial = {k: v.clone() for k, v in trainer.encoder.prompt_state_dict().items()}
    summary = trainer.train()
    run = Path(cfg["output_dir"])
    assert summary["status"] == "completed" and summary["global_step"] == 8 == summary["total_steps"]
    # dev evaluation at steps 4 and 8, the best of them selected and saved
    assert [s for s, _ in summary["dev_history"]] == [4, 8]
    assert summary["best_stsb_dev"] == max(v for _, v in summary["dev_history"])
    info = json.loads((run / "best" / "train_info.json").read_text())
    assert info["step"] == summary["best_step"] and info["stsb_dev"] == summary["best_stsb_dev"]
    # final seven-task test table of the best checkpoint
    assert set(summary["test"]) == {"sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr", "avg"}
    assert json.loads((run / "summary.json").read_text())["test"] == summary["test"]
    # both checkpoints are prompt-only and load onto the base model
    for which in ("best", "last"):
        enc = PromptEncoder.load(run / which, prefix_mode="cache")
        assert enc.prompt_length == 4 and enc.pooler.mlp == "train"
        assert not any(k.startswith("backbone.") for k in _prompt(run, which))
    # the prompt trained, the backbone did not
    fresh = PromptEncoder.from_pretrained(cfg["model"], prefix_mode="cache")
    trained = trainer.encoder
    for name, p in fresh.backbone.state_dict().items():
        assert torch.equal(p, trained.backbone.state_dict()[name].cpu())
    last = _prompt(run)
    assert set(last) == set(initial) and all(not torch.equal(initial[k], last[k]) for k in last)
    rows = _log_rows(run)
    train_rows = [r for r in rows if r["loss"]]
    assert [int(r["step"]) for r in train_rows] == [2, 4, 6, 8]
    assert all(math.isfinite(float(r["loss"])) and float(r["tokens_per_s"]) > 0 for r in train_rows)
    assert [int(r["step"]) for r in rows if r["stsb_dev"]] == [4, 8]
    assert (run / "train.log").read_text().count("STS-B dev") == 2
    assert (run / "config.yaml").is_file()


def test_prompt_parameters_change_and_loss_uses_all_views(base_config, tiny_triplets):
    cfg = base_config(train_file=str(tiny_triplets), objective="promcse_eh", max_steps=3, prefix_mode="cache",
                      loss_backend="reference")
    trainer = Trainer(cfg)
    trainer.setup()
    assert trainer.encoder.prefix_mode == "cache" and trainer.objective.backend == "reference"
    assert trainer.objective.hinge_weight == 10.0
    before = {k: v.clone() for k, v in trainer.encoder.prompt_state_dict().items()}
    seen = []
    trainer.callbacks.append(lambda t, out: seen.append(out))
    summary = trainer.train()
    after = _prompt(cfg["output_dir"])
    assert summary["status"] == "completed" and len(seen) == 3
    assert all("loss_eh" in s.stats and not s.skipped for s in seen)
    assert any(not torch.equal(before[k], after[k]) for k in after)
    # without a dev set, best/ holds the final prompt
    _assert_bit_identical(_prompt(cfg["output_dir"], "best"), after)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs(base_config, precision, monkeypatch, caplog):
    """Both train on the CPU; fp16 there (many times slower than fp32: no fast float16 matrix kernels on most
    CPUs) warns once (docs/troubleshooting.md)."""
    import fastprompt.model.device as device_mod

    monkeypatch.setattr(device_mod, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="fastprompt.model.device"):
        summary = Trainer(base_config(precision=precision, max_steps=2)).train()
    assert summary["status"] == "completed" and summary["global_step"] == 2
    warnings = [r for r in caplog.records if "float16 on the CPU is many times slower" in r.getMessage()]
    assert len(warnings) == (1 if precision == "fp16" else 0)


@pytest.mark.parametrize("eval_precision", ["fp32", "bf16"])
def test_evaluations_run_in_fp32_whatever_the_training_precision(base_config, tiny_sts_dir, eval_precision,
                                                                  monkeypatch):
    """STS-B dev selection and the final table run without autocast by default (the papers evaluate in fp32),
    while the training forwards run under bf16; eval_precision=bf16 evaluates under that autocast instead."""
    import fastprompt.eval.sts as sts

    seen = []
    original = sts.encode_pairs  # every evaluation encodes through it

    def recording(*args, **kwargs):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return original(*args, **kwargs)

    monkeypatch.setattr(sts, "encode_pairs", recording)
    summary = Trainer(base_config(precision="bf16", max_steps=2, eval_steps=1, sts_dir=str(tiny_sts_dir),
                                  eval_precision=eval_precision)).train()
    assert summary["status"] == "completed" and summary["test"] is not None
    assert len(seen) == 3  # dev at steps 1 and 2, then the test table
    assert set(seen) == {None if eval_precision == "fp32" else torch.bfloat16}


# --------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def reference_run(tiny_bert_dir, tiny_corpus, tmp_path_factory):
    """An uninterrupted 10-step run (3 epochs of 4 batches: resume must cross an epoch boundary)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    cfg = dict(model=str(tiny_bert_dir), train_file=str(tiny_corpus), output_dir=str(out), batch_size=24,
               max_length=16, prompt_length=4, learning_rate=1e-2, max_steps=10, eval_steps=100, log_every=1,
               num_threads=1, progress_bar=False, seed=3, warmup_steps=2, save_steps=2,
               mlp="train", prompt_dropout=0.1)
    n = torch.get_num_threads()
    try:
        Trainer(cfg).train()
    finally:
        torch.set_num_threads(n)
    return cfg, out


def test_sigint_saves_last_and_resume_is_bit_identical(reference_run, tmp_path):
    cfg, ref_out = reference_run
    cfg = dict(cfg, output_dir=str(tmp_path / "run"))

    def interrupt_at_step_5(trainer, out):
        if trainer.state.global_step == 5:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, handled gracefully

    summary = Trainer(cfg, callbacks=[interrupt_at_step_5]).train()
    assert summary["status"] == "interrupted" and summary["global_step"] == 5
    state = json.loads((tmp_path / "run" / "last" / "training_state.json").read_text())
    assert state["trainer"]["state"]["global_step"] == 5  # saved at the interrupt, not at step 4
    summary = Trainer(cfg).train()
    assert summary["status"] == "completed" and summary["global_step"] == 10
    _assert_bit_identical(_prompt(tmp_path / "run"), _prompt(ref_out))
    opt = load_file(str(tmp_path / "run" / "last" / "training_state.safetensors"))
    ref_opt = load_file(str(ref_out / "last" / "training_state.safetensors"))
    _assert_bit_identical({k: v for k, v in opt.items() if k.startswith("optimizer.")},
                          {k: v for k, v in ref_opt.items() if k.startswith("optimizer.")})
    # the log holds each step exactly once
    assert [int(r["step"]) for r in _log_rows(tmp_path / "run")] == list(range(1, 11))


_SLOW_RUN = textwrap.dedent("""
    import json, sys, time
    from fastprompt.train import Trainer
    cfg = json.loads(sys.argv[1])
    # slow each step down so the parent can kill us mid-run
    Trainer(cfg, callbacks=[lambda t, out: time.sleep(0.3)]).train()
""")


@pytest.mark.heavy  # a training process killed and resumed
def test_sigkill_mid_run_then_resume_is_bit_identical(reference_run, tmp_path):
    cfg, ref_out = reference_run
    run = tmp_path / "run"
    cfg = dict(cfg, output_dir=str(run))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_RUN, json.dumps(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            rows = _log_rows(run) if (run / "train_log.csv").is_file() else []
            if rows and int(rows[-1]["step"]) >= 7 or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read().decode()[-2000:]
        proc.kill()  # SIGKILL: no handler runs, whatever was being written is cut off
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    killed_at = int(_log_rows(run)[-1]["step"])
    assert 7 <= killed_at < 10
    saved = json.loads((run / "last" / "training_state.json").read_text())["trainer"]["state"]["global_step"]
    assert saved in (killed_at - (killed_at % 2), killed_at - (killed_at % 2) - 2) and saved >= 6
    summary = Trainer(cfg).train()
    assert summary["status"] == "completed" and summary["global_step"] == 10
    _assert_bit_identical(_prompt(run), _prompt(ref_out))


def test_resume_refuses_a_different_run_and_fresh_start_needs_overwrite(base_config):
    cfg = base_config(max_steps=2)
    Trainer(cfg).train()
    with pytest.raises(ValueError, match=r"different configuration \(batch_size: 8 -> 4\)"):
        Trainer(dict(cfg, batch_size=4)).train()
    # The token terms' settings count even while the term is off (they were missing from a hand-kept list).
    for key, value in (("mlm_probability", 0.2), ("rtd_sampling", "argmax"), ("temperature", 0.1)):
        with pytest.raises(ValueError, match=rf"different configuration \({key}: .* -> {value!r}\)"):
            Trainer(dict(cfg, **{key: value})).setup()
    with pytest.raises(ValueError, match="already holds a training run"):
        Trainer(dict(cfg, resume=False)).train()
    summary = Trainer(dict(cfg, resume=False, overwrite_output_dir=True, max_steps=1)).train()
    assert summary["global_step"] == 1


def test_completed_run_resumes_to_nothing(base_config):
    cfg = base_config(max_steps=2)
    first = Trainer(cfg).train()
    again = Trainer(cfg).train()
    assert again["global_step"] == first["global_step"] == 2
    assert len([r for r in _log_rows(cfg["output_dir"]) if r["loss"]]) == 1


# --------------------------------------------------------------------------- faults


def _nan_at(steps):
    """Wrap the method's sentence-level objective so the loss is NaN at the given (1-based) steps."""

    def install(trainer):
        original = trainer.method.sentence

        def sentence(views):
            out = original(views)
            if trainer.state.global_step + 1 in steps:
                out.loss = out.loss * float("nan")
            return out

        trainer.method.sentence = sentence

    return install


def test_nonfinite_loss_skips_the_step(base_config, caplog):
    trainer = Trainer(base_config(max_steps=4, log_every=1))
    trainer.setup()
    _nan_at({2, 3})(trainer)
    snapshots = []
    trainer.callbacks.append(lambda t, out: snapshots.append(
        (out.skipped, {k: v.clone() for k, v in t.encoder.prompt_state_dict().items()})))
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["nonfinite_steps"] == 2
    assert [s for s, _ in snapshots] == [False, True, True, False]
    _assert_bit_identical(snapshots[0][1], snapshots[2][1])  # skipped steps leave the prompt untouched
    assert "non-finite loss" in caplog.text
    rows = _log_rows(base_config()["output_dir"])
    assert [r["skipped"] for r in rows if r["step"]] == ["0", "1", "1", "0"]


def test_persistent_nonfinite_loss_stops_with_checkpoints_intact(base_config):
    cfg = base_config(max_steps=20, max_nonfinite_steps=3, save_steps=2)
    trainer = Trainer(cfg)
    trainer.setup()
    _nan_at(set(range(5, 21)))(trainer)
    with pytest.raises(TrainingDiverged, match="3 consecutive non-finite"):
        trainer.train()
    state = json.loads((Path(cfg["output_dir"]) / "last" / "training_state.json").read_text())
    assert state["trainer"]["state"]["global_step"] == 7
    assert all(torch.isfinite(v).all() for v in _prompt(cfg["output_dir"]).values())
    assert json.loads((Path(cfg["output_dir"]) / "summary.json").read_text())["status"] == "diverged"


def test_bad_inputs_fail_clearly(base_config, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="contains no sentences"):
        Trainer(base_config(train_file=str(empty))).train()
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("premise,hypothesis\na,b\n", encoding="utf-8")
    with pytest.raises(ValueError, match="must have a header with columns sent0,sent1"):
        Trainer(base_config(train_file=str(bad_csv))).train()
    with pytest.raises(ValueError, match="batch_size must be >= 2"):
        Trainer(base_config(batch_size=1))
    with pytest.raises(FileNotFoundError, match="STS directory not found"):
        Trainer(base_config(sts_dir=str(tmp_path / "nope"))).train()
    with pytest.raises(FileNotFoundError, match="training file not found"):
        Trainer(base_config(train_file=str(tmp_path / "nope.txt"))).train()


# --------------------------------------------------------------------------- token-level terms


def _recon_term(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from fastprompt.objectives import WeightSchedule

    from .token_term import ReconstructionTerm

    torch.manual_seed(5)
    return ReconstructionTerm(AutoConfig.from_pretrained(model_dir).hidden_size,
                              AutoTokenizer.from_pretrained(model_dir).mask_token_id, WeightSchedule(0.5, 0.9, 2))


def test_token_term_is_trained_logged_and_resumed_bit_for_bit(base_config, tmp_path):
    """A token term with its own weights, under the gradient cache and a BatchNorm head: CSV columns from the
    configured terms, the weight schedule per step, and an interrupted run that resumes exactly."""
    cfg = base_config(output_dir=str(tmp_path / "ref"), max_steps=6, log_every=1, save_steps=2, eval_steps=100,
                      pooler="bn_mlp", mlp="train", prompt_dropout=0.1, micro_batch_size=5)
    ref = Trainer(cfg, terms=[_recon_term(cfg["model"])])
    ref.setup()
    initial_proj = ref.method.terms[0].proj.weight.detach().clone()
    ref.train()
    rows = _log_rows(tmp_path / "ref")
    assert {"loss_sentence", "loss_recon", "w_recon"} <= set(rows[0])
    assert [float(r["w_recon"]) for r in rows] == pytest.approx([0.5 * 0.9 ** (s / 2) for s in range(6)], rel=1e-5)
    for r in rows:
        total = float(r["loss_sentence"]) + float(r["w_recon"]) * float(r["loss_recon"])
        assert float(r["loss_recon"]) > 0 and float(r["loss"]) == pytest.approx(total, rel=1e-4)
    trained = load_file(str(tmp_path / "ref" / "last" / "method.safetensors"))
    assert set(trained) == {"terms.0.proj.weight", "terms.0.proj.bias"}
    assert not torch.equal(trained["terms.0.proj.weight"], initial_proj)

    run = dict(cfg, output_dir=str(tmp_path / "run"))

    def interrupt_at_step_3(trainer, out):
        if trainer.state.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    assert Trainer(run, terms=[_recon_term(cfg["model"])], callbacks=[interrupt_at_step_3]).train()["status"] \
        == "interrupted"
    assert Trainer(run, terms=[_recon_term(cfg["model"])]).train()["global_step"] == 6
    for name in ("prompt.safetensors", "method.safetensors", "training_state.safetensors"):
        _assert_bit_identical(load_file(str(tmp_path / "run" / "last" / name)),
                              load_file(str(tmp_path / "ref" / "last" / name)))
    # a run without the term cannot resume from a checkpoint that has one, and vice versa
    with pytest.raises(ValueError, match="other token terms|without the token terms"):
        Trainer(dict(run, max_steps=7)).train()
