"""Two gloo processes equal one process for PromptBERT's template views with a trainable backbone.

Each process collates its shard of the global batch (its rows of both views, each view in its template),
runs the gradient-cached step with the template embedder (denoised), and all-reduces the gradients of the
prompt and of every backbone weight; the one-process reference is the same objective over the whole batch in
one graph. Dropout is off (eval mode), so both sides compute the same function; the tolerance is that of
tests/train/test_distributed.py (fp32, only the summation order differs: atol = rtol = 1e-5).
"""
import os

import torch
from safetensors.torch import load_file, save_file

from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.model.promptbert import PROMPTBERT_TEMPLATES
from fastprompt.objectives import Method, SimCSE
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.promptbert import TemplateCollator, TemplateViewEmbedder
from fastprompt.train.steps import CachedStep, LossSide

from .test_distributed import _free_port, _spawn

SENTS = ["a man plays the guitar", "the dog runs in the park", "two people sit", "a woman is eating food",
         "the cat sits on the table", "red car", "one big ball", "water in the park"]
TEMPLATES = PROMPTBERT_TEMPLATES["bert"]


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
    return enc, Method(SimCSE(temperature=0.05, backend="reference")), collate, embed


def _worker(rank, world, model_dir, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        ctx = DistributedContext(rank=rank, world_size=world)
        enc, method, collate, embed = _setup(model_dir)
        b = len(SENTS) // world
        batch = collate([(s,) for s in SENTS[rank * b:(rank + 1) * b]])
        out = CachedStep(LossSide(method, enc, ctx, embed=embed), micro_batch_size=3, max_tokens=None)(batch, 0, 1)
        ctx.all_reduce_gradients(enc.trainable_parameters())
        grads = {n: p.grad.contiguous() for n, p in enc.named_parameters() if p.grad is not None}
        save_file({**grads, "loss": torch.tensor([out.loss])}, os.path.join(out_dir, f"rank{rank}.safetensors"))
    finally:
        torch.distributed.destroy_process_group()


def test_two_processes_match_one_with_templates_and_a_trainable_backbone(tiny_bert_dir, tmp_path):
    _spawn(_worker, (2, str(tiny_bert_dir), _free_port(), str(tmp_path)))
    enc, method, collate, embed = _setup(tiny_bert_dir)
    batch = collate([(s,) for s in SENTS])
    loss = method.sentence(embed(**batch.model_inputs()).view(2, len(SENTS), -1)).loss
    loss.backward()
    ref = {n: p.grad for n, p in enc.named_parameters() if p.grad is not None}
    assert "backbone.encoder.layer.1.output.dense.weight" in ref and "prompt.prefix" in ref
    for rank in range(2):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        torch.testing.assert_close(got.pop("loss")[0], loss.detach(), atol=1e-5, rtol=1e-5)
        unused = set(got) - set(ref)  # the all-reduce sends zeros for parameters the loss does not reach
        assert unused == {"backbone.pooler.dense.weight", "backbone.pooler.dense.bias"} or not unused
        assert all(not got[n].any() for n in unused) and set(ref) <= set(got)
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
