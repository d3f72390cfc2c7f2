"""`fastprompt train`: config + --set overrides, printed summary, exit codes."""
import json
import logging

import pytest
import yaml

from fastprompt.cli import main as _main  # the other train tests import it from here


def _write(tmp_path, cfg):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def test_train_command(base_config, tiny_sts_dir, tmp_path, capsys):
    cfg = base_config(max_steps=4)
    path = _write(tmp_path, cfg)
    out_dir = tmp_path / "cli-run"
    rc = _main(["train", "--config", str(path), "--set", f"sts_dir={tiny_sts_dir}", "--set", "eval_steps=2",
                "--output-dir", str(out_dir)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "training completed at step 4/4" in printed and "best STS-B dev:" in printed
    assert "| STS12 |" in printed and "Avg." in printed
    assert f"best checkpoint: {out_dir}/best" in printed and f"{out_dir}/train_log.csv" in printed
    assert (out_dir / "best" / "prompt.safetensors").is_file()


def test_print_config_and_bad_override(base_config, tmp_path, capsys):
    path = _write(tmp_path, base_config())
    assert _main(["train", "--config", str(path), "--set", "learning_rate=5e-3", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["learning_rate"] == 0.005 and printed["batch_size"] == 8
    assert _main(["train", "--config", str(path), "--set", "btach_size=4"]) == 2
    assert "unknown config key 'btach_size'" in capsys.readouterr().err


def test_summary_compares_with_the_frozen_base_model(base_config, tiny_sts_dir, tmp_path, capsys):
    """frozen_baseline: the summary holds the untouched model's scores, the same as evaluating it directly."""
    from fastprompt.eval.sts import evaluate_sts
    from fastprompt.model import PromptEncoder

    cfg = base_config(max_steps=2, pooler="mean")
    path = _write(tmp_path, cfg)
    out_dir = tmp_path / "frozen-run"
    rc = _main(["train", "--config", str(path), "--set", f"sts_dir={tiny_sts_dir}", "--set", "eval_steps=2",
                "--set", "frozen_baseline=true", "--output-dir", str(out_dir)])
    printed = capsys.readouterr().out
    assert rc == 0
    summary = json.loads((out_dir / "summary.json").read_text())
    frozen = summary["frozen_baseline"]
    assert frozen["pooler"] == "mean" and set(frozen["test"]) == set(summary["test"])
    direct = evaluate_sts(PromptEncoder.from_pretrained(cfg["model"], pooler="mean").eval(), tiny_sts_dir)
    assert frozen["test"] == pytest.approx(direct, abs=1e-9)
    # the tiny model has no sentence-transformers configuration: the run's pooling, and the summary says why
    assert frozen["key"] == "run_pooling" and frozen["same_pooling"] is None
    assert frozen["pooling_source"].startswith("the prompt's pooling; the model's own is not known: no "
                                               "sentence-transformers pooling configuration in ")
    assert (f"the frozen base model, mean pooling ({frozen['pooling_source']}), no prompt: STS-B dev "
            f"{frozen['stsb_dev']:.2f}, seven-task average {frozen['test']['avg']:.2f}") in printed
    assert f"trained prompt: {summary['comparison']['message']}" in printed
    gain = summary["test"]["avg"] - frozen["test"]["avg"]
    assert summary["comparison"]["gain"] == pytest.approx(gain if abs(gain) >= 0.005 else 0.0)


def test_binary_config_file_is_named(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    assert _main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastprompt train: error: ") and str(path) in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_a_gpu_fails_in_one_line_before_the_model_loads(base_config, tmp_path, capsys,
                                                                             monkeypatch):
    """The one device rule (fastprompt.model.device.resolve_device) runs when the run starts: nothing is loaded
    or written before it (the encoder and the data readers would fail this test if reached)."""
    from fastprompt.train import build

    def never(*args, **kwargs):
        raise AssertionError("loaded before the device was checked")

    monkeypatch.setattr(build, "build_encoder", never)
    monkeypatch.setattr(build, "load_examples", never)
    out_dir = tmp_path / "cuda-run"
    path = _write(tmp_path, base_config(max_steps=1))
    assert _main(["train", "--config", str(path), "--set", "device=cuda", "--output-dir", str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastprompt train: error: device 'cuda' requested but "), err
    assert "use device cpu" in err and len(err.strip().splitlines()) == 1, err
    assert not out_dir.exists()


def test_a_collapsed_run_exits_with_status_3_and_says_why(base_config, tmp_path, caplog):
    """`fastprompt train` at learning_rate=1e6: the run stops on representation collapse with exit status 3 (the
    console script's sys.exit(main())), and its last log line says what happened and what to do
    (docs/troubleshooting.md, "Training runs")."""
    cfg = base_config(learning_rate=1e6, max_steps=40, log_every=1, collapse_patience=2)
    with caplog.at_level(logging.INFO):
        assert _main(["train", "--config", str(_write(tmp_path, cfg))]) == 3
    last = caplog.records[-1]
    assert last.levelno == logging.ERROR and last.exc_info is None
    assert "representation collapse in 2 consecutive checks" in last.getMessage()
    assert "lower learning_rate" in last.getMessage()
