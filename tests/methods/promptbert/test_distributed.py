"""Two gloo processes equal one process for PromptBERT's template views with a trainable backbone.

Each process collates its shard of the global batch (its rows of both views, each view in its template),
runs the gradient-cached step with the template embedder (denoised), and all-reduces the gradients of the
prompt and of every backbone weight; the one-process reference is the same objective over the whole batch in
one graph. Dropout is off (eval mode), so both sides compute the same function with other shapes: they differ by
rounding alone, compared with the rtol of tests/train/numerics.py ("different forward") derived from the step's
conditioning. The two template views of a sentence have cosines up to 0.998 (kappa ~ 16), which puts that rtol
at ~2e-3, above the 1e-3 that numerics.py takes as clearly resolving O(1) mistakes; up to 1e-2 is accepted
here because the mistake this test guards against (processes that do not see each other's rows) moves every
gradient by 20 to 130 percent (test_without_gathering_the_gradients_differ_by_far_more_than_the_tolerance).
"""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.model.promptbert import PROMPTBERT_TEMPLATES
from fastprompt.objectives import Method
from fastprompt.train.promptbert import TemplateCollator, TemplateViewEmbedder
from fastprompt.train.steps import CachedStep, LossSide

from ...gloo import free_port, gloo_group, spawn
from ...train.numerics import assert_same_gradients, conditioning

SENTS = ["a man plays the guitar", "the dog runs in the park", "two people sit", "a woman is eating food",
         "the cat sits on the table", "red car", "one big ball", "water in the park"]
TEMPLATES = PROMPTBERT_TEMPLATES["bert"]
TEMPERATURE = 0.05
MAX_RTOL = 1e-2  # see the module docstring
# The last LayerNorm's bias adds the same vector to the [MASK] state h and to the template-only state that
# denoising subtracts from it: its exact gradient is zero, and both sides hold rounding noise there.
ZERO_GRADIENT = "backbone.encoder.layer.1.output.LayerNorm.bias"


def _setup(model_dir):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, init_std=0.3), pooler="mask",
                                        template=TEMPLATES[0]).train_backbone().eval()
    # A random tiny BERT's [MASK] state barely depends on the sentence (its attention output is small next to the
    # residual), so the denoised h - ĥ is ~1e-3 of h and ĥ: the cosine loss's large gradients into h and ĥ then
    # cancel in the shared [MASK] embedding row, and float32 summation order alone moves that row by ~2e-4
    # relative. A 10x stronger attention output (as in test_distributed.py) makes the state vary like a real
    # encoder's and the comparison well conditioned.
    with torch.no_grad():
        for layer in enc.backbone.encoder.layer:
            layer.attention.self.value.weight.mul_(10)
            layer.attention.output.dense.weight.mul_(10)
    collate = TemplateCollator(enc, TEMPLATES, (0, 1), 16, columns=("sent0",), views=("sent0", "sent0"),
                               pad_token_id=enc.tokenizer.pad_token_id)
    embed = TemplateViewEmbedder(enc, TEMPLATES, denoise=True)
    return enc, Method(SimCSE(temperature=TEMPERATURE, backend="reference")), collate, embed


def _worker(rank, world, model_dir, port, out_dir):
    with gloo_group(rank, world, port) as ctx:
        enc, method, collate, embed = _setup(model_dir)
        b = len(SENTS) // world
        batch = collate([(s,) for s in SENTS[rank * b:(rank + 1) * b]])
        out = CachedStep(LossSide(method, enc, ctx, embed=embed), micro_batch_size=3, max_tokens=None)(batch, 0, 1)
        ctx.all_reduce_gradients(enc.trainable_parameters())
        grads = {n: p.grad.contiguous() for n, p in enc.named_parameters() if p.grad is not None}
        save_file({**grads, "loss": torch.tensor([out.loss])}, os.path.join(out_dir, f"rank{rank}.safetensors"))


@pytest.mark.heavy  # two processes
def test_two_processes_match_one_with_templates_and_a_trainable_backbone(tiny_bert_dir, tmp_path):
    spawn(_worker, (2, str(tiny_bert_dir), free_port(), str(tmp_path)))
    enc, method, collate, embed = _setup(tiny_bert_dir)
    batch = collate([(s,) for s in SENTS])
    emb = embed(**batch.model_inputs()).view(2, len(SENTS), -1)
    rtol = conditioning(emb.detach(), TEMPERATURE, max_rtol=MAX_RTOL)
    loss = method.sentence(emb).loss
    loss.backward()
    ref = {n: p.grad for n, p in enc.named_parameters() if p.grad is not None}
    assert "backbone.encoder.layer.1.output.dense.weight" in ref and "prompt.prefix" in ref
    largest = max(float(g.abs().max()) for g in ref.values())
    zero = ref.pop(ZERO_GRADIENT)
    assert zero.abs().max() <= rtol * largest
    ref["loss"] = loss.detach().reshape(1)
    for rank in range(2):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        unused = set(got) - set(ref) - {ZERO_GRADIENT}  # the all-reduce sends zeros for parameters not reached
        assert unused == {"backbone.pooler.dense.weight", "backbone.pooler.dense.bias"} or not unused
        assert all(not got.pop(n).any() for n in unused)
        assert got.pop(ZERO_GRADIENT).abs().max() <= rtol * largest
        assert_same_gradients(ref, got, rtol)


def test_without_gathering_the_gradients_differ_by_far_more_than_the_tolerance(tiny_bert_dir):
    """Negative control of MAX_RTOL: each half of the batch on its own (no rows from the other process) moves
    every gradient by more than 10 x the largest rtol accepted."""
    enc, method, collate, embed = _setup(tiny_bert_dir)
    batch = collate([(s,) for s in SENTS])
    method.sentence(embed(**batch.model_inputs()).view(2, len(SENTS), -1)).loss.backward()
    ref = {n: p.grad for n, p in enc.named_parameters() if p.grad is not None}
    halves, b = [], len(SENTS) // 2
    for rank in range(2):
        enc_r, method_r, collate_r, embed_r = _setup(tiny_bert_dir)
        half = collate_r([(s,) for s in SENTS[rank * b:(rank + 1) * b]])
        method_r.sentence(embed_r(**half.model_inputs()).view(2, b, -1)).loss.backward()
        halves.append({n: p.grad for n, p in enc_r.named_parameters() if p.grad is not None})
    for name in set(ref) - {ZERO_GRADIENT}:
        alone = (halves[0][name] + halves[1][name]) / 2
        assert (alone - ref[name]).abs().max() > 10 * MAX_RTOL * ref[name].abs().max(), name
