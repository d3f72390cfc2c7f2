"""The GPU kit (bench/gpu_kit.py, `bash scripts/gpu_check.sh kit`) and `fastprompt tune`, on a machine without a GPU:
the kit's steps fit its budget and its dry run executes the whole command sequence at smoke sizes on the CPU (each
step exits cleanly and writes its results); without a GPU the kit says so and exits 0; `fastprompt tune` refuses
clearly without a GPU and lists its plan with --dry-run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_kit  # noqa: E402

from fastprompt import cli  # noqa: E402
from fastprompt.ops import tune  # noqa: E402


def test_the_kit_fits_well_under_eight_minutes_and_is_ordered_by_value():
    assert [s.name for s in gpu_kit.STEPS] == ["profile", "graphs", "tune", "loss", "train_step"]
    assert sum(s.minutes for s in gpu_kit.STEPS) <= gpu_kit.BUDGET_MINUTES < 8
    for step in gpu_kit.STEPS:  # the GPU commands name the device and write under the results folder
        assert "cuda" in " ".join(step.gpu) and any("{out}/" in a for a in step.gpu)
        assert "cuda" not in " ".join(step.smoke)
    plan = json.loads((ROOT / "bench" / "tune_plan_sm90.json").read_text())  # the tune step's candidates
    assert plan["cc"] == 90 and plan["sizes"] == "realistic"
    assert list(plan["candidates"]) == [c.label() for c in tune.plan("realistic")]  # made from today's size set
    for case in tune.plan("realistic"):
        assert set(plan["candidates"][case.label()]) == set(tune.kernel_candidates(case))
        for cfgs in plan["candidates"][case.label()].values():
            assert cfgs and all(tune.config_to_dict(tune.config_from_dict(c)) == c for c in cfgs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the kit would run for real")
def test_the_kit_says_so_and_exits_cleanly_without_a_gpu():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "kit"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    assert proc.returncode == 0 and "no CUDA GPU here" in proc.stdout and "--dry-run" in proc.stdout


@pytest.mark.heavy  # the GPU kit's dry run at smoke sizes: ~45 s
def test_the_dry_run_executes_every_step_at_smoke_sizes(tmp_path):
    """~50 s: a tiny training step's profile, two tiny train steps vs PEFT, tune's plan, the loss bench's smoke
    sizes."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_kit.py"), "--dry-run", "--results",
                           str(tmp_path)], capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "gpu_kit_cpu.md").read_text()
    assert summary.count("| ok |") == len(gpu_kit.STEPS), summary
    profile = json.loads((tmp_path / "profile_step_cpu.json").read_text())["result"]
    assert profile["wall_ms"] > 0 and profile["launches"] > 0 and profile["host_reads"] == []
    plan = json.loads((tmp_path / "tuning_plan.json").read_text())
    assert {c["case"].split()[0] for c in plan["cases"]} == {"prefix_attention", "contrastive_loss"}
    for name in ("contrastive_loss_smoke_cpu.csv", "train_step_smoke_cpu.csv", "train_step_graphs_smoke_cpu.csv"):
        assert len((tmp_path / name).read_text().splitlines()) >= 3, name


def test_tune_refuses_without_a_gpu_and_plans_with_dry_run(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    assert cli.main(["tune"]) == 2
    assert "measures a CUDA GPU" in capsys.readouterr().err
    assert cli.main(["tune", "--max-minutes", "0"]) == 2
    assert cli.main(["tune", "--dry-run", "--sizes", "quick", "--max-candidates", "2", "--output",
                     str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    (case,) = [c for c in plan["cases"] if c["case"].startswith("prefix_attention")]
    assert case["choice_key"]["BH"] == 64 * 12 and set(case["timed"]) == {"fwd", "bwd_dq", "bwd_dkdv"}
    assert all(1 <= len(v) <= 2 for v in case["timed"].values())
    # a planned config round-trips to the LaunchConfig the kernels take
    cfg = case["timed"]["fwd"][0]
    assert tune.config_to_dict(tune.config_from_dict(cfg)) == cfg
    (tmp_path / "bad.json").write_text('{"sizes": "quick"}')
    assert cli.main(["tune", "--plan", str(tmp_path / "bad.json"), "--dry-run"]) == 0  # --dry-run ignores it


def test_every_size_set_plans_both_ops():
    for sizes in tune.SIZES:
        ops = {c.op for c in tune.plan(sizes)}
        assert ops == {"prefix_attention", "contrastive_loss"}, sizes
    with pytest.raises(ValueError, match="unknown size set"):
        tune.plan("huge")


def test_profile_step_refuses_cuda_graphs_without_cuda():
    """``profile_step.py --cuda-graphs`` profiles the trainer's cuda_graphs step: without ``--device cuda`` it is
    refused at once, before any model is built."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_step.py"), "--cuda-graphs"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT / "bench")
    assert proc.returncode == 2 and "--cuda-graphs profiles CUDA graphs: it needs --device cuda" in proc.stderr
