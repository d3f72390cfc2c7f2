"""SKICSE through the step strategies: the gradient cache gives the gradients of one graph over the batch.

The SKI is one more view of each row, so the gradient cache must carry it like any other view: its rows are
split into micro-batches with the rest, re-embedded with their own dropout, and get their gradient from every
term that reads them (L_ski's columns, L_ski2's anchors). The reference embeds the same micro-batches with a
graph under the same seed (so it draws the same dropout masks), applies the BatchNorm head over all rows and
backpropagates once. Both sides embed the same micro-batches (bit-identical embeddings and loss), but the
gradient w.r.t. the embeddings is summed in another order (the loss reads this process's rows as a slice of the
gathered ones, whose two gradient paths add in another order than the reference's), and the BatchNorm head
amplifies that rounding: a "different forward" in the sense of tests/train/numerics.py, whose error analysis gives
the rtol (:func:`conditioning` of the embeddings, times the head's amplification), on a well-conditioned step (the
attention strengthened as in test_distributed.py). It was a fixed atol = rtol = 1e-5 ("a few ulps"), which the
head's cancellation exceeded on some CPUs (1.06e-5 on an AMD EPYC with AVX-512). A lost SKI view or a wrong replay
moves the gradients by O(1) (test_the_ski_term_moves_the_gradient).
"""
import copy

import pytest
import torch

from fastprompt.data import Collator
from fastprompt.methods.skicse.objective import SKICSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.objectives import Method, Views
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.grad_cache import make_micro_batches, plan_micro_batches
from fastprompt.train.steps import CachedStep, LossSide, PlainStep

from ...train.numerics import assert_same_gradients, batchnorm_amplification, conditioning
from ...train.test_distributed import _stronger_attention

SEED, STEP = 99, 7
UNSUP = [("a man plays the guitar .", "a guitar is a string instrument ; it is played with the fingers ."),
         ("the dog runs", "dogs are animals that can run fast"),
         ("two people sit at a big table with water .", "water is a drink"),
         ("it", "a pronoun"),
         ("a woman is eating food in the park", "a park is a public green area in a town where people eat"),
         ("the cat sits", "cats sit")]
SUP = [("a man plays the guitar .", "a man plays music", "the cat runs", "a guitar is a string instrument"),
       ("the dog runs", "a dog is running", "nobody plays", "dogs run"),
       ("two people sit at a big table with water .", "people sit", "a table", "water is a drink"),
       ("it", "the car is red", "blue", "a pronoun"),
       ("a woman is eating food in the park", "someone is eating", "a man sits", "parks are green"),
       ("the cat sits", "a cat", "the dog eats", "cats sit often on a red table in the big park")]


def _setup(model_dir, rows):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, prompt_dropout=0.1, init_std=0.3),
                                        pooler="bn_mlp", mlp="train").train()
    _stronger_attention(enc)  # [CLS] vectors that differ as a real encoder's do: a well-conditioned step
    objective = SKICSE(temperature=0.05, hard_negative_weight=0.4, backend="reference")
    columns = ("sent0", "ski") if len(rows[0]) == 2 else ("sent0", "sent1", "hard_neg", "ski")
    batch = Collator(enc.tokenize, 32, columns=columns, views=objective.views_for(columns))(rows)
    return enc, Method(objective).train(), batch


def _grads(enc):
    return {n: p.grad.clone() for n, p in enc.named_parameters() if p.requires_grad and p.grad is not None}


def _reference(enc, method, batch, groups):
    """The loss of one graph over the batch (its gradients in .grad) and the rtol of comparing another run's
    gradients with them (:func:`_rtol`, from these very embeddings)."""
    torch.manual_seed(SEED)
    reps = torch.empty(batch.rows, enc.hidden_size)
    for mb in make_micro_batches(batch.model_inputs(), groups, batch.extras):
        reps = reps.index_put((mb.rows,), enc(**mb.inputs, head=False))
    rtol = _rtol(enc.pooler.head, reps.detach(), batch)
    emb = enc.pooler.head(reps).view(batch.n_views, batch.batch_size, -1)
    loss = method.sentence(Views.single(emb, batch.view_names)).loss
    loss.backward()
    return loss.detach(), rtol


def _rtol(head, reps, batch):
    """The rounding rtol of this step (tests/train/numerics.py), from the pre-head vectors it embeds."""
    amplification = batchnorm_amplification(head, reps)
    with torch.no_grad():
        emb = copy.deepcopy(head).train()(reps)  # a copy: the running statistics stay as they are
    # the objective's anchors (view 0) meet every other view's rows (the positives, negatives and SKI)
    return conditioning(emb.view(batch.n_views, batch.batch_size, -1), 0.05, amplification=amplification,
                        max_rtol=2e-2)


@pytest.mark.parametrize("rows", [UNSUP, SUP], ids=["unsup", "sup"])
@pytest.mark.parametrize("budget", [dict(micro_batch_size=4), dict(max_tokens=40)])
def test_cached_step_with_the_ski_view_equals_one_graph(tiny_bert_dir, rows, budget):
    enc, method, batch = _setup(tiny_bert_dir, rows)
    assert batch.view_names[-1] == "ski" and batch.n_views == (3 if rows is UNSUP else 4)
    groups = plan_micro_batches(batch.attention_mask, budget.get("micro_batch_size"), budget.get("max_tokens"))
    assert len(groups) > 1
    bn = enc.pooler.head[1]
    stats_before = bn.running_mean.clone()
    enc.zero_grad(set_to_none=True)
    ref_loss, rtol = _reference(enc, method, batch, groups)
    ref = _grads(enc)
    bn.running_mean.copy_(stats_before)
    bn.num_batches_tracked.zero_()

    enc.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    out = CachedStep(LossSide(method, enc, DistributedContext()), micro_batch_size=budget.get("micro_batch_size"),
                     max_tokens=budget.get("max_tokens"))(batch, STEP, SEED)
    torch.testing.assert_close(torch.tensor(out.loss), ref_loss, atol=1e-5, rtol=1e-5)
    got = _grads(enc)
    assert set(got) == set(ref) and "prompt.prefix" in got
    assert_same_gradients(ref, got, rtol)
    assert out.stats["loss_ski"] > 0 and ("loss_ski2" in out.stats) == (rows is SUP)


def test_the_ski_term_moves_the_gradient(tiny_bert_dir):
    """Negative control: with λ = 0 the same step gives other gradients, so the equality above covers L_ski."""
    grads = []
    for lam in (0.15, 0.0):
        enc, method, batch = _setup(tiny_bert_dir, UNSUP)
        method.sentence.ski_weight = lam
        enc.zero_grad(set_to_none=True)
        torch.manual_seed(SEED)
        PlainStep(LossSide(method, enc, DistributedContext()))(batch, STEP, SEED)
        grads.append(_grads(enc)["prompt.prefix"])
    assert not torch.allclose(grads[0], grads[1], atol=1e-4, rtol=1e-3)
