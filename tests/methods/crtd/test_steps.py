"""With the CRTD term on (and the BatchNorm head, dropout on), the gradient cache gives the gradients of one
full-batch graph. Tolerance: fp32 1e-5, as tests/train/test_steps.py: both sides compute the same sums in
another order (micro-batch splits of BatchNorm-free encoder forwards, a chain-rule split at the pre-head
vectors); the errors are a few ulps of O(1) quantities, far below 1e-5."""
import pytest
import torch

from fastprompt.data import Collator
from fastprompt.data.replacements import RandomGenerator
from fastprompt.methods.crtd.term import CRTDTerm
from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.objectives import Method, WeightSchedule
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.grad_cache import plan_micro_batches
from fastprompt.train.steps import CachedStep, LossSide, PlainStep, extras_generators

from ...train.test_steps import ROWS, SEED, STEP, _grads, _reference


def _setup(model_dir, discriminator, condition, rows=ROWS):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, prompt_dropout=0.1, init_std=0.3),
                                        pooler="bn_mlp", mlp="train").train()
    # λ large enough that the term's share of the prompt gradient is far above the tolerance
    term = CRTDTerm(enc.hidden_size, RandomGenerator(enc.tokenizer, 0.3), WeightSchedule(0.5),
                    discriminator=discriminator, condition=condition)
    method = Method(SimCSE(temperature=0.05, backend="reference"), [term]).train()
    batch = Collator(enc.tokenize, 32)(rows)
    method.add_extras(batch, extras_generators(method, SEED))
    return enc, method, batch


def _run(step_cls, enc, method, batch, **kw):
    enc.zero_grad(set_to_none=True)
    method.zero_grad(set_to_none=True)
    bns = [m for m in enc.pooler.head if isinstance(m, torch.nn.BatchNorm1d)]
    saved = [{k: v.clone() for k, v in bn.state_dict().items()} for bn in bns]
    torch.manual_seed(SEED)
    out = step_cls(LossSide(method, enc, DistributedContext()), **kw)(batch, STEP, SEED)
    stats = [bn.running_mean.clone() for bn in bns]
    for bn, s in zip(bns, saved):
        bn.load_state_dict(s)
    return out, _grads(enc, method), stats


@pytest.mark.parametrize("discriminator,condition", [("prompted", "after_head"), ("plain", "before_head"),
                                                     ("prompted", "none")])
@pytest.mark.parametrize("model", ["bert", "roberta"])
def test_cached_step_equals_reference_with_crtd(request, model, discriminator, condition):
    """The reference (tests/train/test_steps.py) embeds the same micro-batches with a graph, replaying the
    same dropout, applies the head to all rows at once and backpropagates one loss."""
    enc, method, batch = _setup(request.getfixturevalue(f"tiny_{model}_dir"), discriminator, condition)
    assert batch.view_names == ("sent0", "sent1", "hard_neg")  # supervised: the term over all three views
    labels = batch.extras["rtd_labels"].view(3, batch.batch_size, -1)
    assert all((labels[v] != -100).any() for v in range(3))
    groups = plan_micro_batches(batch.attention_mask, 2, None)
    assert len(groups) > 1
    bns = [m for m in enc.pooler.head if isinstance(m, torch.nn.BatchNorm1d)]
    saved = [{k: v.clone() for k, v in bn.state_dict().items()} for bn in bns]
    enc.zero_grad(set_to_none=True)
    method.zero_grad(set_to_none=True)
    ref_loss = _reference(enc, method, batch, groups)
    ref, ref_stats = _grads(enc, method), [bn.running_mean.clone() for bn in bns]
    for bn, s in zip(bns, saved):
        bn.load_state_dict(s)
    cached, got, stats = _run(CachedStep, enc, method, batch, micro_batch_size=2, max_tokens=None)
    assert cached.stats["w_rtd"] == 0.5 and cached.stats["loss_rtd"] > 0
    torch.testing.assert_close(torch.tensor(cached.loss), ref_loss, atol=1e-5, rtol=1e-5)
    assert {"prompt.prefix", "pooler.head.0.weight", "method.terms.0.classifier.weight"} <= set(ref)
    assert set(got) == set(ref)
    for name in ref:
        assert ref[name].abs().sum() > 0, name
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    for a, b in zip(stats, ref_stats):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_the_term_changes_the_prompt_gradient(tiny_bert_dir):
    """The comparison above is not vacuous: the shared-prompt discriminator adds to the prompt gradient."""
    enc, method, batch = _setup(tiny_bert_dir, "prompted", "after_head")
    _, with_term, _ = _run(PlainStep, enc, method, batch)
    method.terms[0].weight = WeightSchedule(0.0)
    _, without, _ = _run(PlainStep, enc, method, batch)
    assert (with_term["prompt.prefix"] - without["prompt.prefix"]).abs().max() > 1e-4
