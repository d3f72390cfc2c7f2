"""SKICSE's loss terms against a plain-PyTorch reference written here from the formulas of docs/ski.md.

Tolerance: the reference and the op compute the same cosine logits and log-softmax in fp32 with a different
summation order (the C++ kernel tiles, the reference calls aten), so they agree to a few float32 ulps of the
log-sum-exp of about 10..40 logits of size <= 1/0.05 = 20: ~1e-6 absolute on losses of order 1..5 and on their
gradients; 1e-5 leaves an order of magnitude of margin.
"""
import pytest
import torch
import torch.nn.functional as F

from fastprompt.objectives import SKICSE, ObjectiveConfig, SimCSE, Views, objective_from_config

TAU = 0.05
TOL = dict(atol=1e-5, rtol=1e-5)


def infonce(anchors, columns, positive_index, boost=None):
    """-log softmax of each anchor's positive over ``columns`` (cosine / TAU); ``boost``: (column index per
    anchor, value) added to that logit (SimCSE's hard-negative weight)."""
    logits = F.normalize(anchors, dim=-1) @ F.normalize(columns, dim=-1).T / TAU
    if boost is not None:
        idx, value = boost
        logits = logits + value * F.one_hot(idx, columns.shape[0])
    return F.cross_entropy(logits, positive_index)


def unsup_reference(local, gathered, offset, lam):
    """(1 - λ) L_simcse + λ L_ski with views (sent0, sent0, ski)."""
    pos = torch.arange(local.shape[1]) + offset
    l_cl = infonce(local[0], gathered[1], pos)
    l_ski = infonce(local[0], gathered[2], pos)
    return (1 - lam) * l_cl + lam * l_ski


def sup_reference(local, gathered, offset, lam1, lam2, hnw):
    """(1 - λ1 - λ2) L_sup + λ1 L_ski1 + λ2 L_ski2 with views (sent0, sent1, hard_neg, ski). L_ski2: anchor the SKI,
    columns the entailments and the contradictions only (no SKI in its denominator)."""
    b, m = local.shape[1], gathered.shape[1]
    pos = torch.arange(b) + offset
    cols = torch.cat([gathered[1], gathered[2]])
    boost = (pos + m, hnw)
    l_sup = infonce(local[0], cols, pos, boost)
    l_ski1 = infonce(local[0], gathered[3], pos)
    l_ski2 = infonce(local[3], cols, pos, boost)
    return (1 - lam1 - lam2) * l_sup + lam1 * l_ski1 + lam2 * l_ski2, l_ski2


def _gathered(names, b_global, hidden=19, seed=0):
    """Random post-head embeddings of every view of a global batch (an odd hidden size on purpose)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(names), b_global, hidden, generator=g).requires_grad_(True)


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("b_local,b_global,offset", [(7, 7, 0), (5, 15, 5), (3, 6, 3)])
def test_unsupervised_loss_and_gradients_match_the_reference(backend, b_local, b_global, offset):
    names = ("sent0", "sent0", "ski")
    gathered = _gathered(names, b_global)
    local = gathered[:, offset:offset + b_local]
    obj = SKICSE(temperature=TAU, backend=backend)
    out = obj.loss(Views(names, local, gathered, offset))
    (grad,) = torch.autograd.grad(out.loss, gathered)
    ref = unsup_reference(local, gathered, offset, 0.15)
    (ref_grad,) = torch.autograd.grad(ref, gathered)
    torch.testing.assert_close(out.loss, ref, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    assert grad[2].abs().sum() > 0  # the SKI view is trained
    assert set(out.stats) == set(obj.stat_names) - {"loss_ski2"}


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("b_local,b_global,offset,hnw", [(6, 6, 0, 0.0), (4, 12, 8, 0.7), (9, 9, 0, 1.3)])
def test_supervised_loss_and_gradients_match_the_reference(backend, b_local, b_global, offset, hnw):
    names = ("sent0", "sent1", "hard_neg", "ski")
    gathered = _gathered(names, b_global, seed=1)
    local = gathered[:, offset:offset + b_local]
    obj = SKICSE(temperature=TAU, hard_negative_weight=hnw, backend=backend)
    out = obj.loss(Views(names, local, gathered, offset))
    (grad,) = torch.autograd.grad(out.loss, gathered)
    ref, ref_ski2 = sup_reference(local, gathered, offset, 0.1, 0.3, hnw)
    (ref_grad,) = torch.autograd.grad(ref, gathered)
    torch.testing.assert_close(out.loss, ref, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    assert out.stats["loss_ski2"] == pytest.approx(float(ref_ski2.detach()), abs=1e-5)


def test_ski2_has_no_knowledge_sentence_in_its_denominator():
    """Negative control for the Eq. 6 decision: with the other SKIs as extra negatives the term would differ,
    and moving another row's SKI changes an anchor's L_ski2 only through that row's own anchor."""
    names = ("sent0", "sent1", "hard_neg", "ski")
    gathered = _gathered(names, 6, seed=2).detach()
    obj = SKICSE(temperature=TAU, ski_weight=0.0, ski1_weight=0.0, ski2_weight=1.0, backend="reference")
    got = obj.loss(Views.single(gathered, names)).loss
    pos = torch.arange(6)
    with_skis = infonce(gathered[3], torch.cat([gathered[1], gathered[2], gathered[3]]), pos)
    assert abs(float(got) - float(with_skis)) > 1e-2
    # Row 0's SKI is a column of no other anchor: its gradient comes from its own row's loss alone.
    g = gathered.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(obj.loss(Views.single(g, names)).loss, g)
    alone = infonce(g[3][:1], torch.cat([g[1], g[2]]), pos[:1]) / 6
    (grad_alone,) = torch.autograd.grad(alone, g)
    torch.testing.assert_close(grad[3, 0], grad_alone[3, 0], **TOL)
    assert float(got) >= 0  # the positive is in its own denominator: -log softmax, bounded below


def test_zero_weights_reduce_to_simcse():
    for names, lam in ((("sent0", "sent0", "ski"), dict(ski_weight=0.0)),
                       (("sent0", "sent1", "hard_neg", "ski"), dict(ski1_weight=0.0, ski2_weight=0.0))):
        gathered = _gathered(names, 8, seed=3).detach()
        obj = SKICSE(temperature=TAU, hard_negative_weight=0.5, backend="reference", **lam)
        got = obj(Views.single(gathered, names))
        plain_names = tuple(n for n in names if n != "ski")
        want = SimCSE(temperature=TAU, hard_negative_weight=0.5, backend="reference")(
            Views.single(gathered[:len(plain_names)], plain_names))
        torch.testing.assert_close(got.loss, want.loss, **TOL)


def test_views_for_the_data_layouts():
    obj = SKICSE()
    assert obj.views_for(("sent0", "ski")) == ("sent0", "sent0", "ski")
    assert obj.views_for(("sent0", "sent1", "hard_neg", "ski")) == ("sent0", "sent1", "hard_neg", "ski")
    assert obj.views_for(("sent0", "sent1", "ski")) == ("sent0", "sent1", "ski")
    with pytest.raises(ValueError, match="needs a 'ski' column.*generate-ski"):
        obj.views_for(("sent0",))
    # SimCSE on a SKI file trains on the sentences alone
    assert SimCSE().views_for(("sent0", "ski")) == ("sent0", "sent0")
    assert SimCSE().views_for(("sent0", "sent1", "hard_neg", "ski")) == ("sent0", "sent1", "hard_neg")


def test_bad_views_and_weights_are_refused():
    with pytest.raises(ValueError, match="skicse needs the views"):
        SKICSE()(Views.single(torch.randn(2, 4, 8), ("sent0", "sent0")))
    with pytest.raises(ValueError, match="batch_size >= 2"):
        SKICSE()(Views.single(torch.randn(3, 1, 8), ("sent0", "sent0", "ski")))
    with pytest.raises(ValueError, match="ski1_weight \\+ ski2_weight must be <= 1"):
        SKICSE(ski1_weight=0.6, ski2_weight=0.5)
    with pytest.raises(ValueError, match="ski_weight must be in"):
        ObjectiveConfig(name="skicse", ski_weight=1.5)
    with pytest.raises(ValueError, match="no hinge term"):
        ObjectiveConfig(name="skicse", hinge_weight=1.0)


def test_config_builds_the_objective_with_its_weights():
    obj = objective_from_config(ObjectiveConfig(name="skicse", temperature=0.1, ski_weight=0.2, ski1_weight=0.05,
                                                ski2_weight=0.25, loss_backend="reference"))
    assert isinstance(obj, SKICSE)
    assert (obj.temperature, obj.ski_weight, obj.ski1_weight, obj.ski2_weight) == (0.1, 0.2, 0.05, 0.25)
