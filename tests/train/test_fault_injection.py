"""Fault injection: a training run SIGKILLed at random points, several times over, then resumed, ends with the
prompt of the uninterrupted run bit for bit (and a log holding every step exactly once).

Each kill is a real SIGKILL the run sends itself (no handler runs, nothing is flushed), one of each kind, in an
order and at steps drawn from a seeded generator: after a step, inside the ``last/`` checkpoint write (its files
are in the temporary folder, not yet renamed into place), or between the two renames of the swap (``last`` moved
aside, the new one not yet in place: the next run must restore the old one). The seed is printed with any
failure, so the failure replays; ``FASTPROMPT_FAULT_SEED=<int>`` replaces it, so repeated runs try new plans
(``FASTPROMPT_FAULT_SEED=$RANDOM pytest tests/train/test_fault_injection.py``).
"""
import csv
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastprompt.train import Trainer

pytestmark = pytest.mark.heavy  # training processes killed at random and resumed

REPO = Path(__file__).resolve().parents[2]
MODES = ("after_step", "in_checkpoint_write", "between_renames")
SEED = int(os.environ.get("FASTPROMPT_FAULT_SEED", "20261122"))

_VICTIM = textwrap.dedent("""
    import json, os, signal, sys
    import fastprompt.io
    import fastprompt.train.checkpoints as checkpoints
    from fastprompt.train import Trainer

    cfg, mode, kill_at = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    trainer = Trainer(cfg)

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "after_step":
        trainer.callbacks.append(lambda t, out: t.state.global_step == kill_at and die())
    elif mode == "in_checkpoint_write":
        save = checkpoints.save_training_state

        def save_then_die(folder, **kw):
            save(folder, **kw)
            if trainer.state.global_step >= kill_at:
                die()

        checkpoints.save_training_state = save_then_die
    else:  # between_renames: atomic_directory has moved last/ aside and not yet renamed the new one in
        replace = os.replace

        def replace_then_die(src, dst):
            replace(src, dst)
            if os.path.basename(src) == "last" and trainer.state.global_step >= kill_at:
                die()

        fastprompt.io.os.replace = replace_then_die
    trainer.train()
""")


def _config(tiny_bert_dir, tiny_corpus, out):
    # 3 epochs of 4 batches (resume crosses epoch boundaries), dropout on, a trained head, warmup + decay
    return dict(model=str(tiny_bert_dir), train_file=str(tiny_corpus), output_dir=str(out), batch_size=24,
                max_length=16, prompt_length=4, learning_rate=1e-2, max_steps=10, eval_steps=100, log_every=1,
                num_threads=1, progress_bar=False, seed=5, warmup_steps=2, save_steps=2, mlp="train",
                prompt_dropout=0.1)


def _tensors(run_dir):
    """Every tensor of last/: prompt, head, optimizer moments and schedule. Not the process's global RNG states
    (``rng.*``, saved for user code): a step's randomness is a function of (seed, step), not of them."""
    last = Path(run_dir) / "last"
    return {f"{p.name}:{k}": v for p in sorted(last.glob("*.safetensors")) for k, v in load_file(str(p)).items()
            if not k.startswith("rng.")}


def test_random_sigkills_then_resume_give_the_uninterrupted_prompt_bit_for_bit(tiny_bert_dir, tiny_corpus,
                                                                                  tmp_path):
    n_threads = torch.get_num_threads()
    reference = _config(tiny_bert_dir, tiny_corpus, tmp_path / "reference")
    Trainer(reference).train()
    torch.set_num_threads(n_threads)

    rng = random.Random(SEED)
    modes = list(MODES)
    rng.shuffle(modes)
    # increasing steps: every run resumes from a checkpoint before its kill step, so each one is killed
    kills = list(zip(sorted(rng.sample(range(1, 10), len(modes))), modes))
    assert {m for _, m in kills} == set(MODES)
    plan = f"seed {SEED}, kills {kills}"  # in every failure message: FASTPROMPT_FAULT_SEED replays it
    run = tmp_path / "run"
    cfg = _config(tiny_bert_dir, tiny_corpus, run)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for step, mode in kills:
        proc = subprocess.run([sys.executable, "-c", _VICTIM, json.dumps(cfg), mode, str(step)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
        assert proc.returncode == -signal.SIGKILL, f"{plan}: {mode} at step {step}: {proc.stderr[-2000:]}"
    summary = Trainer(cfg).train()
    torch.set_num_threads(n_threads)

    assert summary["status"] == "completed" and summary["global_step"] == 10, plan
    ref, got = _tensors(tmp_path / "reference"), _tensors(run)
    assert ref.keys() == got.keys() and any(k.startswith("prompt.safetensors:") for k in ref)
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k} differs after {plan}"
    with open(run / "train_log.csv", newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == list(range(1, 11)), plan
