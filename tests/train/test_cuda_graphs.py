"""``cuda_graphs: true`` (issue 41, item 3): a training step Inductor's CUDA graphs can replay, refused where it
cannot apply, and proven capture-safe on the CPU with what runs here.

What a CUDA graph needs of the step, and how each is checked without a GPU:
- static shapes: the batches are padded to at most eight widths (a graph is recorded per shape); the padding is
  masked, so the maths is the padded batch's;
- no host read of a device tensor (it would wait for the GPU, and bake a value into the replayed launches): the
  step's host path reads nothing (:class:`fastprompt.host_sync.HostReads`, which switches fastprompt's code onto its
  CUDA path);
- one graph, no break: the trainer's compiled forward traces with ``fullgraph=True`` (a graph break raises), here
  with torch.compile's ``aot_eager`` backend (Dynamo and AOTAutograd trace forward and backward as Inductor receives
  them; the kernels run eagerly), and the evaluations (whose widths vary) run eagerly instead of compiling more.
"""
import pytest
import torch

import fastprompt.train.trainer as trainer_module
from fastprompt.data import Collator
from fastprompt.host_sync import HostReads
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.train import Trainer
from fastprompt.train.compile import MAX_GRAPH_WIDTHS, graph_widths

LONG = "two people sits table water food red blue big small man woman dog cat plays runs eating guitar ball park"


@pytest.mark.parametrize("max_length", [2, 10, 16, 32, 100, 128, 512])
def test_graph_widths_are_few_and_waste_at_most_an_eighth(max_length):
    widths = graph_widths(max_length)
    assert len(widths) <= MAX_GRAPH_WIDTHS and widths[-1] == max_length and list(widths) == sorted(set(widths))
    gaps = [b - a for a, b in zip((0, *widths), widths)]
    assert max(gaps) <= max(8, -(-max_length // MAX_GRAPH_WIDTHS))


def test_the_collator_pads_to_the_smallest_width_that_holds_the_batch(tiny_bert_dir):
    """The padded batch encodes to the same vectors as the unpadded one (eval mode: no dropout). Tolerance: the
    extra keys are masked (their softmax weight is exactly 0), but the products run over wider operands, whose
    blocking may sum the real terms in another order: float32 rounding, ~1e-7 relative per op over 2 layers; 1e-5."""
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(3, init_std=0.3), pooler="mean")
    enc.eval()
    rows = [("a man plays the guitar",), ("the dog runs",)]
    plain = Collator(enc.tokenize, 16)(rows)
    padded = Collator(enc.tokenize, 16, pad_widths=graph_widths(16))(rows)
    assert plain.input_ids.shape[1] < 8 and padded.input_ids.shape[1] == 8
    assert padded.lengths == plain.lengths
    assert Collator(enc.tokenize, 16, pad_widths=graph_widths(16))([(LONG,)]).input_ids.shape[1] == 16
    with torch.no_grad():
        a = enc(plain.input_ids, plain.attention_mask)
        b = enc(padded.input_ids, padded.attention_mask)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for bad in ([], [16, 8], [0, 8], [8, 8], [8.0]):
        with pytest.raises(ValueError, match="pad_widths"):
            Collator(enc.tokenize, 16, pad_widths=bad)


@pytest.mark.parametrize("overrides, message", [
    (dict(micro_batch_size=2), "gradient cache"),
    (dict(max_tokens_per_micro_batch=64), "gradient cache"),
    (dict(packed=True), "packed"),
    (dict(compile=False), "compile: false"),
], ids=["micro_batch_size", "max_tokens", "packed", "compile_false"])
def test_settings_that_rule_cuda_graphs_out_are_refused(base_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        Trainer(base_config(cuda_graphs=True, **overrides))


def test_a_cpu_run_is_refused_before_anything_is_written(base_config, tmp_path):
    cfg = base_config(cuda_graphs=True, device="cpu", output_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Trainer(cfg).train()
    assert not (tmp_path / "out").exists()


@pytest.fixture
def graphs_on_the_cpu(monkeypatch):
    """The trainer's cuda_graphs path on the CPU: the device refusal lifted, ``encoder.compile`` recorded and run
    with ``aot_eager`` and ``fullgraph=True`` (a graph break raises), each step's mark counted."""
    calls = {"compile": [], "marks": 0}

    def compile_(self, *args, **kwargs):
        calls["compile"].append(kwargs)
        return torch.nn.Module.compile(self, backend="aot_eager", fullgraph=True, dynamic=kwargs.get("dynamic"))

    def mark():
        calls["marks"] += 1

    monkeypatch.setattr(trainer_module, "check_cuda_graphs", lambda config, device: None)
    monkeypatch.setattr(PromptEncoder, "compile", compile_)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", mark)
    return calls


@pytest.mark.heavy  # torch.compile of a training step: ~20 s
def test_a_cuda_graphs_step_traces_whole_on_few_shapes_and_reads_nothing(base_config, tiny_sts_dir,
                                                                         graphs_on_the_cpu, tmp_path):
    """The capture-safety proof on the CPU: batches of varying lengths (and a last, smaller batch) pad to the
    graph widths, the compiled forward and backward trace whole (fullgraph) into one graph of dynamic shapes (a
    CUDA graph is recorded per shape from it), the steps read nothing on the host, and the STS evaluations leave the
    compiled graphs alone (run eagerly)."""
    from torch._dynamo.utils import counters

    corpus = tmp_path / "varied.txt"
    words = LONG.split()
    corpus.write_text("".join(" ".join(words[: 3 + (7 * i) % 17]) + "\n" for i in range(22)), encoding="utf-8")
    torch._dynamo.reset()
    counters.clear()
    cfg = base_config(cuda_graphs=True, train_file=str(corpus), batch_size=8, max_length=24, max_steps=6,
                      eval_steps=3, log_every=1, sts_dir=str(tiny_sts_dir), prompt_dropout=0.1)
    trainer = Trainer(cfg)
    trainer.setup()
    assert graphs_on_the_cpu["compile"] == [dict(mode="reduce-overhead", dynamic=True)] and not trainer.encoder.packed
    widths = set()
    collate = trainer.collator.__call__

    def recorded(rows):
        batch = collate(rows)
        widths.add(tuple(batch.input_ids.shape))
        return batch

    trainer.collators[0] = trainer.collator = recorded
    trainer._run_step(list(range(8)))  # one compilation, dynamic shapes: every later shape reuses it
    trainer._run_step(list(range(8, 16)))
    trainer._run_step(list(range(16, 22)))  # the last, smaller batch
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1 and dict(counters["graph_break"]) == {}
    assert graphs_on_the_cpu["marks"] == 3
    # The host reads of the whole step, the encoder's included, counted eagerly (HostReads is a TorchFunctionMode,
    # which Dynamo would trace into the graph; inside the graph fullgraph=True already refused any read, a break)
    with torch.compiler.set_stance("force_eager"), HostReads() as reads:
        trainer._run_step(list(range(16, 22)))
    assert reads.reads == [], f"host reads in a cuda_graphs step:\n{reads.report()}"
    assert {w for _, w in widths} <= set(graph_widths(24)) and len(widths) >= 2
    assert trainer.evaluator.dev() is not None  # eagerly: no graph for the evaluation's widths
    assert trainer.evaluator.probe_spread() is not None
    assert counters["stats"]["unique_graphs"] == graphs
