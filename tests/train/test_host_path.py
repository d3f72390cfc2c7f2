"""The CUDA training step's host path, proven on the CPU: one packed training step on the Triton path (the
interpreter runs the kernels) reads no tensor on the host and launches at most one kernel per attention forward and
two per attention backward; a log row reads the steps' values once; and a static check keeps host reads out of the
CUDA path's code.

On a GPU every host read of a device tensor (``.item()``, ``bool(t)``, ``.tolist()``, ``nonzero``,
``torch.tensor(list, device=...)``) waits for every kernel queued before it and bakes a value into the launches a
CUDA graph would capture. :class:`fastprompt.host_sync.HostReads` records such reads made from fastprompt's code while
it switches the code onto the path it takes on CUDA (:func:`fastprompt.host_sync.sync_free`), so the CPU suite sees
what a GPU run would do.
"""
import ast
import re
from pathlib import Path

import pytest
import torch

import fastprompt.ops
from fastprompt.host_sync import HostReads, TritonLaunches, checks_stay_on_device, sync_free
from fastprompt.train import StepOutput, Trainer

ROOT = Path(__file__).resolve().parents[2]


def _trainer(base_config, **overrides):
    cfg = base_config(**{**dict(attn_backend="triton", loss_backend="triton", packed=True, batch_size=4, max_length=12,
                                log_every=1000, eval_steps=1000, max_steps=1000), **overrides})
    trainer = Trainer(cfg)
    trainer.setup()
    return trainer


class _AttentionCalls:
    """Counts calls of the prefix attention op's two entries, padded and packed (the model imports them from
    fastprompt.ops at each call)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for name in ("prefix_attention", "prefix_attention_varlen"):
            monkeypatch.setattr(fastprompt.ops, name, self._counted(getattr(fastprompt.ops, name)))

    def _counted(self, original):
        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        return counted


def _attention_launches(launches: TritonLaunches) -> int:
    return sum(n for (module, _), n in launches.by_module.items() if module.endswith("prefix_attention"))


@pytest.mark.heavy  # a packed training step through the Triton interpreter: ~10 s
def test_a_packed_triton_training_step_reads_nothing_on_the_host(base_config, monkeypatch):
    """The whole step (collated batch to the device, forward, loss, backward, clipping, the optimizer update and the
    non-finite bookkeeping) with dropout on: no host read, the update decided on the device."""
    trainer = _trainer(base_config)
    assert trainer.encoder.packed
    rows = list(range(4))
    trainer._run_step(rows)  # a first step builds what is built once (optimizer state, kernels' launch plans)
    attention = _AttentionCalls(monkeypatch)
    side = trainer.step.loss_side
    backward_launches = TritonLaunches()
    forward_backward = side.backward

    def backward(loss):
        with backward_launches:
            forward_backward(loss)

    monkeypatch.setattr(side, "backward", backward)
    with HostReads() as reads, TritonLaunches() as launches:
        out = trainer._run_step(rows)
    assert reads.reads == [], f"host reads in a training step:\n{reads.report()}"
    assert attention.calls >= trainer.encoder.num_layers - 1  # every layer, the last may compute pooled rows only
    backward_attention = _attention_launches(backward_launches)
    forward_attention = _attention_launches(launches) - backward_attention
    assert forward_attention == attention.calls, launches.by_module  # one launch per attention forward
    assert backward_attention <= 2 * attention.calls, backward_launches.by_module  # at most two per backward
    assert out.tokens == sum(trainer.make_batch(rows, 0).lengths)
    assert torch.isfinite(torch.tensor(out.loss)) and not out.skipped  # read after the step, on purpose


def test_the_log_row_reads_every_step_of_its_window_once(base_config):
    """Values stay on the device until a log row reads them: one read for the whole window."""
    trainer = _trainer(base_config, attn_backend="cpu", loss_backend="cpu")
    with sync_free():
        outs = [trainer._run_step(list(range(4))) for _ in range(3)]
    with HostReads() as reads:
        StepOutput.read_all(outs)  # what the trainer does at a log row
        assert len({o.loss for o in outs}) == 3 and all(not o.skipped and o.grad_norm > 0 for o in outs)
    assert [r.function for r in reads.reads] == ["tolist"], reads.report()


def test_checks_stay_on_device_on_cuda_tensors_under_compile_and_in_sync_free():
    assert not checks_stay_on_device(torch.zeros(1), None)
    assert checks_stay_on_device(torch.zeros(1, device="meta"))
    with sync_free():
        assert checks_stay_on_device(torch.zeros(1))
    assert not checks_stay_on_device()


def test_host_reads_records_the_reads_fastprompt_makes():
    from fastprompt.ops.attention import draw_seed

    t = torch.arange(4.0)
    with HostReads() as reads:
        t.sum().item()  # made here, in a test: not fastprompt's
        draw_seed()  # fastprompt's own read of its CPU draw
    assert [r.function for r in reads.reads] == ["item"] and "fastprompt/ops/attention.py" in reads.reads[0].where


# ------------------------------------------------------------------------------------------------
# the static check: no host read in the CUDA path's code unless marked (with why it is not one there)

#: The modules a CUDA training step runs (the ops, their kernels' launchers, the model's packed path, the objectives,
#: the step strategies and the trainer's step).
CUDA_PATH = ["fastprompt/ops/attention.py", "fastprompt/ops/contrastive.py", "kernels/prefix_attention.py",
             "kernels/contrastive_loss.py", "kernels/contrastive_chunked.py", "fastprompt/model/attention.py",
             "fastprompt/model/backbone.py",
             "fastprompt/methods/simcse/objective.py", "fastprompt/methods/skicse/objective.py",
             "fastprompt/train/steps.py", "fastprompt/train/grad_cache.py", "fastprompt/train/build.py",
             "fastprompt/data/collate.py"]
READ_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero"}
REDUCTIONS = {"sum", "max", "min", "all", "any", "mean", "norm", "prod", "amax", "amin"}
MARK = re.compile(r"#.*\bhost read:")  # `# host read: <why this is not a device read on CUDA>`


def _flagged(tree: ast.AST):
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Attribute) and fn.attr in READ_METHODS and not node.args and not node.keywords:
            yield node.lineno, f".{fn.attr}()"
        elif (isinstance(fn, ast.Attribute) and fn.attr in ("tensor", "as_tensor") and isinstance(fn.value, ast.Name)
              and fn.value.id == "torch" and any(k.arg == "device" for k in node.keywords)
              and node.args and isinstance(node.args[0], (ast.List, ast.Tuple, ast.ListComp))):
            yield node.lineno, "torch.tensor(list, device=...)"
        elif (isinstance(fn, ast.Name) and fn.id in ("int", "float", "bool") and len(node.args) == 1
              and isinstance(node.args[0], ast.Call) and isinstance(node.args[0].func, ast.Attribute)
              and node.args[0].func.attr in REDUCTIONS):
            yield node.lineno, f"{fn.id}(tensor.{node.args[0].func.attr}())"


@pytest.mark.parametrize("path", CUDA_PATH)
def test_no_unmarked_host_read_in_the_cuda_path(path):
    """Every ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``.nonzero()``, ``torch.tensor(list,
    device=...)`` and ``int/float/bool(tensor.reduction())`` in the CUDA path's modules carries a ``# host read:``
    comment saying why it is not a device read on a GPU (a CPU-only branch, a host tensor, a documented fallback)."""
    source = (ROOT / path).read_text()
    lines = source.splitlines()
    bad = [f"{path}:{n}: {what}: {lines[n - 1].strip()}" for n, what in _flagged(ast.parse(source))
           if not MARK.search(lines[n - 1]) and not (n >= 2 and MARK.search(lines[n - 2]))]
    assert not bad, "host reads in the CUDA path (mark a legitimate one with `# host read: why`):\n" + "\n".join(bad)
