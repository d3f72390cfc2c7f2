"""Both token terms at once (DCPCSE's MLM and D2CSE's CRTD) with the BatchNorm head and dropout on: the gradient
cache gives the gradients of one full-batch graph.

Setup: tiny BERT and tiny RoBERTa, hidden/attention/prompt dropout 0.1, the ``bn_mlp`` head (BatchNorm over the
whole batch), the supervised triple (the CRTD term over all three views), the MLM term with the checkpoint's
head (trained, as DCPCSE's code, or frozen) or the trainable ``tied_new`` head, the CRTD term in the paper's
design (d) (shared prompts, conditioned on the post-head embedding). Both terms at λ = 5: on these random tiny
weights each term at λ = 0.5 moves the prompt gradient by only ~6e-5..8e-5, too close to the tolerance for the
comparison to prove much; at λ = 5 ``test_each_term_moves_the_prompt_gradient`` checks each moves it by > 1e-4. The
reference (``_reference`` of tests/train/test_steps.py) embeds the same micro-batches with a graph, applies
the head to all rows at once, adds each term on each micro-batch on the contract's RNG stream
(``term_seed``) and backpropagates one loss.

Error analysis (fp32, atol = rtol = 1e-5): both sides run the same kernels on the same rows with the same
dropout masks (the cached step replays each micro-batch's RNG state; each term draws from its own
``term_seed`` stream on both sides). They differ only in the order gradient contributions are summed: per
micro-batch into ``.grad`` (9 micro-batches of 2 rows) vs inside one autograd graph, and the chain-rule split
at the pre-head vectors (the cache backpropagates the loss to a leaf, then runs each micro-batch's forward
again). Each reordering costs a few float32 ulps (relative ~1e-7) per addition; over at most 9 + 3 partial
sums of gradients of order 1e-2..1 the bound is ~1e-6 absolute. Measured: the largest absolute difference
over the four cases was 2.4e-7 (prompt gradient norm ~0.3). 1e-5 is an order of magnitude above the bound
and an order below each term's share of the prompt gradient, so a routing slip in either term (normalised
per micro-batch, h's gradient dropped, BatchNorm per micro-batch, dropout not replayed) fails the test.
"""
from pathlib import Path

import pytest
import torch

from fastprompt.data import Collator
from fastprompt.data.replacements import RandomGenerator
from fastprompt.methods.crtd.term import CRTDTerm
from fastprompt.methods.mlm.term import MLMTerm
from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.objectives import Method, WeightSchedule
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.grad_cache import plan_micro_batches
from fastprompt.train.steps import CachedStep, LossSide, PlainStep, extras_generators

from .test_steps import ROWS, SEED, STEP, _grads, _reference


def _save_masked_lm(src: Path, dst: Path) -> Path:
    """``src`` saved as a masked LM (``cls.predictions.*`` / ``lm_head.*``): the MLM term's checkpoint head."""
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    torch.manual_seed(3)
    AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module", params=["bert", "roberta"])
def masked_lm_dir(request, tiny_bert_dir, tiny_roberta_dir, tmp_path_factory):
    src = tiny_bert_dir if request.param == "bert" else tiny_roberta_dir
    return _save_masked_lm(src, tmp_path_factory.mktemp(f"masked-lm-{request.param}"))


def _setup(model_dir, head, train_head=True):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, prompt_dropout=0.1, init_std=0.3),
                                        pooler="bn_mlp", mlp="train").train()
    assert enc.backbone.config.hidden_dropout_prob == 0.1 and enc.backbone.config.attention_probs_dropout_prob == 0.1
    terms = [MLMTerm.for_encoder(enc, head, train_head, weight=WeightSchedule(5.0)),
             CRTDTerm(enc.hidden_size, RandomGenerator(enc.tokenizer, 0.3), WeightSchedule(5.0),
                      discriminator="prompted", condition="after_head")]
    method = Method(SimCSE(temperature=0.05, backend="reference"), terms).train()
    batch = Collator(enc.tokenize, 32)(ROWS)
    method.add_extras(batch, extras_generators(method, SEED))
    return enc, method, batch


def _bn_state(enc):
    return [{k: v.clone() for k, v in m.state_dict().items()}
            for m in enc.pooler.head if isinstance(m, torch.nn.BatchNorm1d)]


def _restore_bn(enc, saved):
    for m, s in zip([m for m in enc.pooler.head if isinstance(m, torch.nn.BatchNorm1d)], saved):
        m.load_state_dict(s)


def _step(step_cls, enc, method, batch, **kw):
    enc.zero_grad(set_to_none=True)
    method.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    return step_cls(LossSide(method, enc, DistributedContext()), **kw)(batch, STEP, SEED)


@pytest.mark.parametrize("head,train_head", [("checkpoint", True), ("checkpoint", False), ("tied_new", True)])
def test_cached_step_equals_reference_with_mlm_and_crtd(masked_lm_dir, head, train_head):
    enc, method, batch = _setup(masked_lm_dir, head, train_head)
    assert batch.view_names == ("sent0", "sent1", "hard_neg")
    assert method.terms[0].num_targets(batch.extras) > 0 and method.terms[1].num_targets(batch.extras) > 0
    groups = plan_micro_batches(batch.attention_mask, 2, None)
    assert len(groups) == 9
    saved = _bn_state(enc)
    enc.zero_grad(set_to_none=True)
    method.zero_grad(set_to_none=True)
    ref_loss = _reference(enc, method, batch, groups)
    ref, ref_bn = _grads(enc, method), _bn_state(enc)
    _restore_bn(enc, saved)
    out = _step(CachedStep, enc, method, batch, micro_batch_size=2, max_tokens=None)
    got = _grads(enc, method)
    assert out.stats["w_mlm"] == 5.0 and out.stats["w_rtd"] == 5.0
    assert out.stats["loss_mlm"] > 0 and out.stats["loss_rtd"] > 0
    torch.testing.assert_close(torch.tensor(out.loss), ref_loss, atol=1e-5, rtol=1e-5)
    expected = {"prompt.prefix", "pooler.head.0.weight", "method.terms.1.classifier.weight"}
    if head == "tied_new":
        expected |= {n for n in ref if n.startswith("method.terms.0.head.") and n.endswith("dense.weight")}
        assert any(n.startswith("method.terms.0.head.") for n in expected)
    elif train_head:  # DCPCSE's code: every tensor of the checkpoint's head trains, its untied decoder too
        expected |= {n for n in ref if n.startswith("method.terms.0.head.") and n.endswith("decoder.weight")}
        assert any(n.startswith("method.terms.0.head.") for n in expected)
    else:
        assert not any(n.startswith("method.terms.0.") for n in ref)  # the frozen head gets no gradient
    assert expected <= set(ref) and set(got) == set(ref)
    for name in ref:
        assert ref[name].abs().sum() > 0, f"{name}: zero gradient, the comparison would be vacuous"
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    for a, b in zip(_bn_state(enc), ref_bn):  # BatchNorm's running statistics: one update over the whole batch
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6)


def test_each_term_moves_the_prompt_gradient(tiny_bert_dir, tmp_path):
    """The comparison above is not vacuous: switching either term off changes the prompt gradient."""
    enc, method, batch = _setup(_save_masked_lm(tiny_bert_dir, tmp_path), "checkpoint")
    saved = _bn_state(enc)

    def prompt_grad():
        _restore_bn(enc, saved)
        _step(PlainStep, enc, method, batch)
        return enc.prompt.prefix.grad.clone()

    both = prompt_grad()
    for term in method.terms:
        weight, term.weight = term.weight, WeightSchedule(0.0)
        assert (prompt_grad() - both).abs().max() > 1e-4, term.name
        term.weight = weight
