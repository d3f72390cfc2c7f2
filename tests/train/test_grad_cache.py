"""Gradient cache: exact full-batch prompt gradients with dropout on, token-budget micro-batches.

Tolerances (tests/train/numerics.py): against a reference that embeds the same micro-batches with a graph, the
gradients may differ only by the order in which the micro-batches' contributions are summed (a rigorous bound
per entry); against one plain forward of the whole batch (other shapes, other padding), by rounding through the
whole chain, estimated from the step's conditioning and relative to each gradient's own scale.
"""
import pytest
import torch

from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.ops import contrastive_loss
from fastprompt.train.grad_cache import grad_cache_step, make_micro_batches, plan_micro_batches

from .numerics import CHAIN_ULPS, U32, GradientContributions, assert_same_gradients, conditioning

SENTENCES = ["a man plays the guitar .", "the dog runs", "two people sit at a big table with water .", "it",
             "a woman is eating food in the park", "the cat sits", "red car", "one man plays ball on the street ."]
POSITIVES = ["a man plays music", "a dog is running", "people sit at a table", "this is it", "someone is eating",
             "a cat", "the car is red", "a ball on the street"]


def _setup(model_dir, prompt_dropout=0.1, **encoder_kwargs):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, prompt_dropout=prompt_dropout,
                                                                              init_std=0.3), mlp="train",
                                        **encoder_kwargs)
    enc.train()
    tok = enc.tokenize(SENTENCES * 2)  # unsupervised SimCSE: two views of every sentence
    return enc, tok, SimCSE(temperature=0.05, hinge_weight=1.0, backend="reference")


def _loss_fn(objective, n):
    return lambda reps: objective(reps.view(2, n, -1))


def _prompt_grads(enc):
    return {n: p.grad.clone() for n, p in enc.named_parameters() if p.requires_grad and p.grad is not None}


def _full_batch_with_same_chunks(enc, tok, loss_fn, groups):
    """Reference: the same micro-batches embedded WITH a graph (same RNG consumption), one backward of
    ``loss_fn`` (of the (rows, H) embeddings)."""
    enc.zero_grad(set_to_none=True)
    micro = make_micro_batches(tok, groups)
    reps = [None] * tok["input_ids"].shape[0]
    for mb in micro:
        emb = enc(**mb.inputs)
        for j, r in enumerate(mb.rows.tolist()):
            reps[r] = emb[j]
    loss = loss_fn(torch.stack(reps))
    loss.backward()
    return loss.detach(), _prompt_grads(enc)


def _objective_loss(objective, n):
    return lambda reps: objective(reps.view(2, n, -1)).loss


@pytest.mark.parametrize("budget", [dict(micro_batch_size=3), dict(max_tokens=40), dict(micro_batch_size=1)])
def test_grad_cache_equals_full_batch_gradients_with_dropout_on(tiny_model_dir, budget):
    enc, tok, objective = _setup(tiny_model_dir)
    groups = plan_micro_batches(tok["attention_mask"], budget.get("micro_batch_size"), budget.get("max_tokens"))
    assert len(groups) > 1
    torch.manual_seed(42)
    ref_loss, ref = _full_batch_with_same_chunks(enc, tok, _objective_loss(objective, len(SENTENCES)), groups)
    state_after_ref = torch.get_rng_state()

    torch.manual_seed(42)
    enc.zero_grad(set_to_none=True)
    with GradientContributions(dict(enc.named_parameters())) as contributions:
        res = grad_cache_step(enc, tok, _loss_fn(objective, len(SENTENCES)), **budget)
    assert res.backpropagated
    # the same float32 computation on the same embeddings (same micro-batches, replayed dropout): the same loss
    assert torch.equal(res.loss, ref_loss)
    got = _prompt_grads(enc)
    assert set(got) == set(ref) and len(got) == 3  # prefix + head weight + head bias
    assert all(contributions.count[name] == len(groups) for name in got)  # one per micro-batch backward
    contributions.assert_equal_up_to_summation_order(got, ref)
    # the RNG continues exactly as after a single pass, so training stays reproducible
    assert torch.equal(torch.get_rng_state(), state_after_ref)


#: Two hard negatives per row for the loss-option tests; "a cat" and "the car is red" repeat positives' texts, so the
#: text-id mask has false negatives to remove.
NEGATIVES = [["the cat runs", "nobody plays", "a table", "blue", "a man sits", "the dog eats", "two cars", "food"],
             ["a cat", "it rains", "the car is red", "green", "a boy", "birds", "one chair", "a lamp"]]

LOSS_OPTIONS = {
    "k-negatives-hardness": dict(hardness_mode="all_negatives", hardness_strength=5.0, hard_negative_weight=0.3,
                                 hinge_weight=1.0),
    "text-ids-joint-symmetric": dict(ids=True, symmetric=True, partition_mode="joint"),
    "gist-margin-model-scored": dict(fn_margin=0.05, hardness_mode="in_batch_negatives", hardness_strength=9.0),
    "matryoshka": dict(matryoshka_dims=[32, 8, 16], matryoshka_weights=[1.0, 0.5, 0.25], ids=True),
}


def options_loss(options: dict, n: int):
    """The loss of (rows, H) embeddings laid out as anchors, positives, then the two negatives per row, with the
    op's options (the C++ kernels: the fused forward+backward or the recomputing backward under symmetric)."""
    kw = dict(options)
    if kw.pop("ids", False):
        texts = SENTENCES + POSITIVES + NEGATIVES[0] + NEGATIVES[1]
        ids = torch.tensor([texts.index(t) for t in texts])  # one id per distinct text
        kw["column_ids"] = ids[n:]
        if kw.get("symmetric"):
            kw["anchor_ids"] = ids[:n]

    def loss_fn(reps):
        z1, z2, z3 = reps[:n], reps[n:2 * n], reps[2 * n:].view(2, n, -1)
        return contrastive_loss(z1, z2, z3, temperature=0.05, backend="cpu", **kw)

    return loss_fn


@pytest.mark.parametrize("options", LOSS_OPTIONS.values(), ids=LOSS_OPTIONS.keys())
def test_grad_cache_equals_full_batch_gradients_with_loss_options(tiny_bert_dir, options):
    """k = 2 negatives per anchor, hardness weighting, text-id and GISTEmbed (model-scored) false-negative masks,
    the joint symmetric loss, Matryoshka dimensions: the gradient cache gives the loss and prompt gradients of the
    same micro-batches embedded with a graph (dropout on), as for SimCSE above: the same loss bit for bit, the
    gradients within the summation-order bound."""
    enc, _, _ = _setup(tiny_bert_dir)
    n = len(SENTENCES)
    tok = enc.tokenize(SENTENCES + POSITIVES + NEGATIVES[0] + NEGATIVES[1])
    loss_fn = options_loss(options, n)
    groups = plan_micro_batches(tok["attention_mask"], 5)
    torch.manual_seed(42)
    ref_loss, ref = _full_batch_with_same_chunks(enc, tok, loss_fn, groups)

    torch.manual_seed(42)
    enc.zero_grad(set_to_none=True)
    with GradientContributions(dict(enc.named_parameters())) as contributions:
        res = grad_cache_step(enc, tok, loss_fn, micro_batch_size=5)
    assert res.backpropagated and torch.equal(res.loss, ref_loss)
    got = _prompt_grads(enc)
    assert len(got) == 3 and all(contributions.count[name] == len(groups) for name in got)
    contributions.assert_equal_up_to_summation_order(got, ref)


def test_without_dropout_replay_the_gradients_differ(tiny_bert_dir, monkeypatch):
    """Negative control: dropout really is on, and replaying it is what makes the gradients exact."""
    import fastprompt.train.grad_cache as gc

    enc, tok, objective = _setup(tiny_bert_dir)
    groups = plan_micro_batches(tok["attention_mask"], 4)
    torch.manual_seed(42)
    _, ref = _full_batch_with_same_chunks(enc, tok, _objective_loss(objective, len(SENTENCES)), groups)
    monkeypatch.setattr(gc.RandState, "restore", lambda self: None)
    torch.manual_seed(42)
    enc.zero_grad(set_to_none=True)
    grad_cache_step(enc, tok, _loss_fn(objective, len(SENTENCES)), micro_batch_size=4)
    assert not torch.allclose(_prompt_grads(enc)["prompt.prefix"], ref["prompt.prefix"], atol=1e-5)


def test_grad_cache_equals_single_forward_without_dropout(tiny_bert_dir):
    """With dropout off, micro-batching + padding trimming changes nothing: same as one plain forward.

    Here the two sides embed other shapes (one padded batch vs trimmed micro-batches), so they differ by rounding
    through the whole chain (tests/train/numerics.py, "different forward"), which needs a well-conditioned step:
    mean pooling, and each sentence paired with a paraphrase (as NLI pairs). With [CLS] pooling and the same
    sentence twice, the tiny BERT's cosines are all within 2e-6 of 1, hardest negatives tie within 3e-7 and the
    prefix gradient is 3e-5 in all: an absolute 1e-5 would have passed almost anything."""
    enc, _, objective = _setup(tiny_bert_dir, prompt_dropout=0.0, pooler="mean")
    enc.eval()  # no dropout anywhere; the MLP head is train-only so use a loss on the raw pooled vectors
    n = len(SENTENCES)
    tok = enc.tokenize(SENTENCES + POSITIVES)
    enc.zero_grad(set_to_none=True)
    emb = enc(**tok).view(2, n, -1)
    loss = objective(emb).loss
    loss.backward()
    ref = _prompt_grads(enc)
    enc.zero_grad(set_to_none=True)
    cached = []

    def loss_fn(reps):
        cached.append(reps.detach().clone().view(2, n, -1))
        return objective(reps.view(2, n, -1))

    res = grad_cache_step(enc, tok, loss_fn, max_tokens=30)
    assert len(plan_micro_batches(tok["attention_mask"], max_tokens=30)) > 1
    # the forward half of the chain: within CHAIN_ULPS of the embeddings' scale; the loss, a mean of terms of
    # order 1 to 10 computed from them, within the same relative rounding amplified by 1 / temperature
    assert (cached[0] - emb).abs().max() <= CHAIN_ULPS * U32 * emb.abs().max()
    torch.testing.assert_close(res.loss, loss.detach(), atol=0, rtol=CHAIN_ULPS * U32 / 0.05)
    got = _prompt_grads(enc)
    assert set(got) == set(ref) == {"prompt.prefix"}
    rtol = conditioning(emb.detach(), temperature=0.05, margin=0.2)
    assert_same_gradients(ref, got, rtol)


def test_plan_respects_budgets_and_covers_every_row_once():
    mask = torch.zeros(10, 12, dtype=torch.long)
    for i, n in enumerate([12, 3, 7, 7, 1, 12, 5, 9, 2, 4]):
        mask[i, :n] = 1
    groups = plan_micro_batches(mask, max_tokens=24)
    assert sorted(torch.cat(groups).tolist()) == list(range(10))
    lengths = mask.sum(1)
    for g in groups:
        assert len(g) * int(lengths[g].max()) <= 24
    assert all(len(g) <= 3 for g in plan_micro_batches(mask, micro_batch_size=3, max_tokens=1000))
    with pytest.raises(ValueError, match="smaller than one sequence"):
        plan_micro_batches(mask, max_tokens=5)
    with pytest.raises(ValueError, match="micro_batch_size or max_tokens"):
        plan_micro_batches(mask)


def test_non_finite_loss_writes_no_gradient(tiny_bert_dir):
    enc, tok, _ = _setup(tiny_bert_dir)
    enc.zero_grad(set_to_none=True)
    res = grad_cache_step(enc, tok, lambda reps: reps.sum() * float("nan"), micro_batch_size=4)
    assert not res.backpropagated and not torch.isfinite(res.loss)
    assert all(p.grad is None for p in enc.trainable_parameters())


def test_no_sync_wraps_every_micro_batch_backward_but_the_last(tiny_bert_dir):
    """For an encoder wrapped in DistributedDataParallel by the caller: one gradient sync per step."""
    import contextlib

    enc, tok, objective = _setup(tiny_bert_dir)
    entered = []

    @contextlib.contextmanager
    def no_sync():
        entered.append(len(entered))
        yield

    groups = plan_micro_batches(tok["attention_mask"], 4)
    grad_cache_step(enc, tok, _loss_fn(objective, len(SENTENCES)), micro_batch_size=4, no_sync=no_sync)
    assert len(groups) == 4 and len(entered) == 3
