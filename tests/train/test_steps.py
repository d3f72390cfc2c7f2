"""Step strategies against a plain-PyTorch reference: the objective contract with a token term and a BatchNorm head.

The reference below embeds the same micro-batches with a graph (so it draws the same dropout masks as the
gradient cache's first pass), applies the head over every row, adds the term on each micro-batch on the
contract's RNG stream (``term_seed``) with ``h`` taken *with* its graph, and backpropagates once. The gradient
cache reaches the same gradients through three passes, a leaf for the pre-head vectors and a detached leaf for
``h``; any slip in that routing (h's gradient dropped, the head applied per micro-batch, a term normalised per
micro-batch, dropout not replayed) moves the gradients by far more than the fp32 tolerance.

Tolerance: both sides run the same fp32 kernels on the same rows (same micro-batches, same masks, the head
and the loss on the same matrix), so only the order in which each parameter's gradient contributions are summed
differs (one per micro-batch backward and per term backward, vs one graph): the gradients are compared entry by
entry against the rigorous summation-order bound of tests/train/numerics.py (2 gamma(k - 1) sum |g_i|; measured
differences are 0 to 2 ulps of the largest entry), and no conditioning of the loss enters (both sides see the
same cosines). The losses are a handful of float32 terms added in another order: a few ulps of a loss of order 1
to 10, well inside rtol = 1e-5 (~100 ulps).
"""
import pytest
import torch

from fastprompt.data import Collator
from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.objectives import Method, WeightSchedule
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.grad_cache import make_micro_batches, plan_micro_batches
from fastprompt.train.steps import CachedStep, LossSide, PlainStep, extras_generators, term_seed

from .numerics import GradientContributions
from .token_term import ReconstructionTerm

ROWS = [("a man plays the guitar .", "a man plays music", "the cat runs"),
        ("the dog runs", "a dog is running", "nobody plays"),
        ("two people sit at a big table with water .", "people sit", "a table"),
        ("it", "the car is red", "blue"),
        ("a woman is eating food in the park", "someone is eating", "a man sits"),
        ("the cat sits", "a cat", "the dog eats")]
SEED, STEP = 1234, 100


def _setup(model_dir, pooler="bn_mlp", terms=True, h="after_head"):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, prompt_dropout=0.1, init_std=0.3),
                                        pooler=pooler, mlp="train").train()
    objective = SimCSE(temperature=0.05, hard_negative_weight=0.3, hinge_weight=1.0, backend="reference")
    term = [ReconstructionTerm(enc.hidden_size, enc.tokenizer.mask_token_id, WeightSchedule(0.5, 0.9, 50),
                               sentence_embedding=h)]
    method = Method(objective, term if terms else []).train()
    batch = Collator(enc.tokenize, 32)(ROWS)
    method.add_extras(batch, extras_generators(method, SEED))
    return enc, method, batch


def _params(enc, method):
    return dict(enc.named_parameters()) | {f"method.{k}": v for k, v in method.named_parameters()}


def _grads(enc, method):
    return {n: p.grad.clone() for n, p in _params(enc, method).items() if p.requires_grad and p.grad is not None}


def _reference(enc, method, batch, groups):
    """The method's loss over the same micro-batches, embedded with a graph, and one backward."""
    torch.manual_seed(SEED)
    micro = make_micro_batches(batch.model_inputs(), groups, batch.extras)
    reps = torch.empty(batch.rows, enc.hidden_size)
    for mb in micro:
        reps = reps.index_put((mb.rows,), enc(**mb.inputs, head=False))
    emb = enc.pooler.head(reps)  # training mode: BatchNorm statistics of all rows of all views
    loss = method.sentence(emb.view(batch.n_views, batch.batch_size, -1)).loss
    for term in method.terms:
        n_targets = term.num_targets(batch.extras)
        for i, mb in enumerate(micro):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(term_seed(SEED, term.name, i))
                h = emb if term.sentence_embedding == "after_head" else reps
                s = term(enc, mb.inputs, mb.extras, h[mb.rows])
            loss = loss + term.weight(STEP) * s / n_targets
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("model,budget,h", [
    ("bert", dict(micro_batch_size=4), "after_head"), ("roberta", dict(micro_batch_size=4), "after_head"),
    ("bert", dict(max_tokens=40), "after_head"), ("bert", dict(micro_batch_size=1), "after_head"),
    ("roberta", dict(max_tokens=40), "before_head")])
def test_cached_step_equals_reference_with_token_term_and_batchnorm_head(request, model, budget, h):
    enc, method, batch = _setup(request.getfixturevalue(f"tiny_{model}_dir"), h=h)
    bns = [m for m in enc.pooler.head if isinstance(m, torch.nn.BatchNorm1d)]
    assert len(bns) == 2  # DiffCSE's projection MLP: BatchNorm after each Linear
    groups = plan_micro_batches(batch.attention_mask, budget.get("micro_batch_size"), budget.get("max_tokens"))
    assert len(groups) > 1
    enc.zero_grad(set_to_none=True)
    stats_before = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in bns]
    ref_loss = _reference(enc, method, batch, groups)
    ref, ref_stats = _grads(enc, method), [(bn.running_mean.clone(), bn.running_var.clone()) for bn in bns]
    rng_after_ref = torch.get_rng_state()
    for bn, (mean, var) in zip(bns, stats_before):
        bn.running_mean.copy_(mean)
        bn.running_var.copy_(var)
        bn.num_batches_tracked.zero_()

    enc.zero_grad(set_to_none=True)
    method.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    with GradientContributions(_params(enc, method)) as contributions:
        out = CachedStep(LossSide(method, enc, DistributedContext()), micro_batch_size=budget.get("micro_batch_size"),
                         max_tokens=budget.get("max_tokens"))(batch, STEP, SEED)
    torch.testing.assert_close(torch.tensor(out.loss), ref_loss, atol=1e-5, rtol=1e-5)
    got = _grads(enc, method)
    # prefix, head (Linear, BatchNorm, Linear) and the term's own projection
    assert {"prompt.prefix", "pooler.head.1.weight", "method.terms.0.proj.weight"} <= set(got)
    assert contributions.count["prompt.prefix"] == 2 * len(groups)  # per micro-batch: the term's forward, the replay
    contributions.assert_equal_up_to_summation_order(got, ref)
    for bn, ref_bn, before in zip(bns, ref_stats, stats_before):
        for got_stat, ref_stat, old in zip((bn.running_mean, bn.running_var), ref_bn, before):
            torch.testing.assert_close(got_stat, ref_stat, atol=1e-6, rtol=1e-6)
            assert not torch.equal(ref_stat, old)
    # the token term ran on its own RNG stream: the step leaves the generator where the reference left it
    assert torch.equal(torch.get_rng_state(), rng_after_ref)
    assert out.stats["w_recon"] == pytest.approx(0.5 * 0.9 ** 2)
    n_targets = int(method.terms[0].num_targets(batch.extras))
    assert n_targets > 4 and out.stats["loss_recon"] > 0
    torch.testing.assert_close(torch.tensor(out.loss), torch.tensor(out.stats["loss_sentence"]
                                                                    + out.stats["w_recon"] * out.stats["loss_recon"]))


@pytest.mark.parametrize("h", ["after_head", "before_head"])
def test_plain_step_equals_reference_in_one_micro_batch(tiny_bert_dir, h):
    enc, method, batch = _setup(tiny_bert_dir, h=h)
    enc.zero_grad(set_to_none=True)
    ref_loss = _reference(enc, method, batch, [torch.arange(batch.rows)])
    ref = _grads(enc, method)
    enc.zero_grad(set_to_none=True)
    method.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    with GradientContributions(_params(enc, method)) as contributions:
        out = PlainStep(LossSide(method, enc, DistributedContext()))(batch, STEP, SEED)
    torch.testing.assert_close(torch.tensor(out.loss), ref_loss, atol=1e-5, rtol=1e-5)
    contributions.assert_equal_up_to_summation_order(_grads(enc, method), ref)


def test_without_the_h_gradient_the_cached_step_would_differ(tiny_bert_dir):
    """Negative control: the term's gradient into h is large enough that dropping it is detected."""
    enc, method, batch = _setup(tiny_bert_dir)
    groups = plan_micro_batches(batch.attention_mask, 4)
    enc.zero_grad(set_to_none=True)
    _reference(enc, method, batch, groups)
    ref = _grads(enc, method)
    enc.zero_grad(set_to_none=True)
    method.zero_grad(set_to_none=True)
    term = method.terms[0]
    full = term.forward
    term.forward = lambda encoder, inputs, extras, h: full(encoder, inputs, extras, h.detach())
    torch.manual_seed(SEED)
    with GradientContributions(_params(enc, method)) as contributions:
        CachedStep(LossSide(method, enc, DistributedContext()), micro_batch_size=4, max_tokens=None)(batch, STEP, SEED)
    got = _grads(enc, method)
    own = "method.terms.0.proj.weight"  # the term itself is unchanged
    contributions.assert_equal_up_to_summation_order({own: got[own]}, {own: ref[own]})
    assert not torch.allclose(got["pooler.head.0.weight"], ref["pooler.head.0.weight"], atol=1e-5, rtol=1e-5)


def test_a_non_finite_sentence_loss_is_reported_on_the_device_and_gives_non_finite_gradients(tiny_bert_dir):
    """No step decides on the host whether a loss is finite (that read would wait for the GPU): a NaN loss is
    backpropagated like any other, its gradients are not finite, and the trainer's fused optimizer skips the update
    (tests/train/test_trainer.py::test_nonfinite_loss_skips_the_step)."""
    enc, method, batch = _setup(tiny_bert_dir)
    original = method.sentence

    def nan_loss(views):
        out = original(views)
        out.loss = out.loss * float("nan")
        return out

    method.sentence = nan_loss
    for step in (PlainStep(LossSide(method, enc, DistributedContext())),
                 CachedStep(LossSide(method, enc, DistributedContext()), micro_batch_size=4, max_tokens=None)):
        enc.zero_grad(set_to_none=True)
        out = step(batch, STEP, SEED)
        assert isinstance(out.loss, torch.Tensor) and out.loss.dim() == 0 and out.loss != out.loss
        assert any(p.grad is not None and not torch.isfinite(p.grad).all() for p in enc.trainable_parameters())
