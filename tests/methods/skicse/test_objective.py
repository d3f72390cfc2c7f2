"""SKICSE's loss terms against a plain-PyTorch reference written directly from the paper's Eq. 1-7.

The reference (:func:`eq`) spells each equation out as printed in SKICSE (Ou & Xu), section 3.2 (the text is in
``../shared/papers/skicse.txt``): ``-log( e^{sim(a_i, p_i)/τ} / Σ_j Σ_{C} e^{sim(a_i, C_j)/τ} )`` with the
numerator's pair and the denominator's column sets exactly as each equation has them, in float64. It shares no
code with the objective (which calls the fused op, or for Eq. 6 rewrites it through Eq. 4's denominator).

Tolerance: the objective computes its cosine logits and log-sum-exp in float32 (the C++ kernel tiles, the
reference backend calls aten); against the float64 equations that is a few float32 ulps of a log-sum-exp of
10..40 logits of size <= 1/0.05 = 20, ~2e-6 absolute on losses of order 1..20 and on their gradients; 1e-5
leaves a margin of about 5.
"""
import pytest
import torch
import torch.nn.functional as F

from fastprompt.methods import objective_sections
from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.methods.skicse.objective import SKICSE
from fastprompt.objectives import ObjectiveConfig, Views, objective_from_config
from fastprompt.train import TrainConfig

TAU = 0.05
TOL = dict(atol=1e-5, rtol=1e-5)


def sim(a, b):
    """(rows of a) x (rows of b) cosine similarities, float64."""
    a, b = a.double(), b.double()
    return (a @ b.T) / (a.norm(dim=-1, keepdim=True) * b.norm(dim=-1).unsqueeze(0))


def eq(anchors, numerators, denominator_sets, boost=None):
    """``mean_i -log( e^{sim(a_i, n_i)/τ} / Σ_{C in denominator_sets} Σ_j e^{sim(a_i, C_j)/τ} )``.

    ``boost``: (set index, column index per anchor, value): ``value`` added to that logit (SimCSE's hard-negative
    weight; the papers' equations have none, it is 0 unless a test says otherwise)."""
    num = torch.exp(torch.diagonal(sim(anchors, numerators)) / TAU)
    den = 0
    for k, cols in enumerate(denominator_sets):
        logits = sim(anchors, cols) / TAU
        if boost is not None and boost[0] == k:
            logits = logits + boost[2] * F.one_hot(boost[1], cols.shape[0]).double()
        den = den + torch.exp(logits).sum(-1)
    return (-torch.log(num / den)).mean()


def unsup_reference(local, gathered, offset, lam):
    """Eq. 3 = (1 - λ) Eq. 1 + λ Eq. 2, views (sent0, sent0, ski) = (h, h', h^ski)."""
    b = local.shape[1]
    h, h2, ski = local[0], gathered[1][offset:offset + b], gathered[2][offset:offset + b]
    eq1 = eq(h, h2, [gathered[1]])
    eq2 = eq(h, ski, [gathered[2]])
    return (1 - lam) * eq1 + lam * eq2


def sup_reference(local, gathered, offset, lam1, lam2, hnw=0.0, denominator="printed"):
    """Eq. 7 = (1 - λ1 - λ2) Eq. 4 + λ1 Eq. 5 + λ2 Eq. 6, views (sent0, sent1, hard_neg, ski) = (h, h+, h-, h^ski).
    Returns (Eq. 7, Eq. 5, Eq. 6). ``denominator="ski"``: Eq. 6 with the SKIs as its columns (the option)."""
    b = local.shape[1]
    h, ski = local[0], local[3]
    pos = gathered[1][offset:offset + b]
    nli = [gathered[1], gathered[2]]  # Σ_j (e^{sim(., h_j+)} + e^{sim(., h_j-)})
    boost = (1, torch.arange(b) + offset, hnw)  # the own contradiction h_i-
    eq4 = eq(h, pos, nli, boost)
    eq5 = eq(ski, pos, nli, boost)  # anchor h_i^ski, positive h_i+
    eq6 = eq(h, ski, nli, boost) if denominator == "printed" else eq(h, ski, [gathered[3]])  # anchor h_i, pos h_i^ski
    return (1 - lam1 - lam2) * eq4 + lam1 * eq5 + lam2 * eq6, eq5, eq6


def _gathered(names, b_global, hidden=19, seed=0):
    """Random post-head embeddings of every view of a global batch (an odd hidden size on purpose)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(names), b_global, hidden, generator=g).requires_grad_(True)


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("b_local,b_global,offset", [(7, 7, 0), (5, 15, 5), (3, 6, 3)])
def test_unsupervised_loss_and_gradients_are_eq_1_to_3(backend, b_local, b_global, offset):
    names = ("sent0", "sent0", "ski")
    gathered = _gathered(names, b_global)
    local = gathered[:, offset:offset + b_local]
    obj = SKICSE(temperature=TAU, backend=backend)
    out = obj.loss(Views(names, local, gathered, offset))
    (grad,) = torch.autograd.grad(out.loss, gathered)
    ref = unsup_reference(local, gathered, offset, 0.15)
    (ref_grad,) = torch.autograd.grad(ref, gathered)
    torch.testing.assert_close(out.loss.double(), ref, **TOL)
    torch.testing.assert_close(grad, ref_grad.float(), **TOL)
    assert grad[2].abs().sum() > 0  # the SKI view is trained
    assert set(out.stats) == set(obj.stat_names) - {"loss_ski2"}


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("b_local,b_global,offset,hnw",
                         [(6, 6, 0, 0.0), (4, 12, 8, 0.0), (9, 9, 0, 1.3), (3, 6, 3, 0.7)])
def test_supervised_loss_and_gradients_are_eq_4_to_7(backend, b_local, b_global, offset, hnw):
    """λ1 = 0.1 weights Eq. 5 (anchor h^ski, positive h+) and λ2 = 0.3 weights Eq. 6 (anchor h, positive h^ski),
    Eq. 6 with the denominator the paper prints (h_j+ and h_j-)."""
    names = ("sent0", "sent1", "hard_neg", "ski")
    gathered = _gathered(names, b_global, seed=1)
    local = gathered[:, offset:offset + b_local]
    obj = SKICSE(temperature=TAU, hard_negative_weight=hnw, backend=backend)
    assert (obj.ski1_weight, obj.ski2_weight, obj.ski2_denominator) == (0.1, 0.3, "printed")
    out = obj.loss(Views(names, local, gathered, offset))
    (grad,) = torch.autograd.grad(out.loss, gathered)
    ref, eq5, eq6 = sup_reference(local, gathered, offset, 0.1, 0.3, hnw)
    (ref_grad,) = torch.autograd.grad(ref, gathered)
    torch.testing.assert_close(out.loss.double(), ref, **TOL)
    torch.testing.assert_close(grad, ref_grad.float(), **TOL)
    assert out.stats["loss_ski"] == pytest.approx(float(eq5.detach()), abs=1e-5)
    assert out.stats["loss_ski2"] == pytest.approx(float(eq6.detach()), abs=1e-5)
    assert grad[3].abs().sum() > 0  # the SKI view is trained


@pytest.mark.parametrize("lam1,lam2", [(1.0, 0.0), (0.0, 1.0), (0.3, 0.1)])
def test_each_weight_sits_on_its_own_equation(lam1, lam2):
    """Negative control of the swap: λ1 alone is Eq. 5, λ2 alone is Eq. 6, and (0.3, 0.1) is not (0.1, 0.3)."""
    names = ("sent0", "sent1", "hard_neg", "ski")
    gathered = _gathered(names, 8, seed=4).detach()
    got = SKICSE(temperature=TAU, ski1_weight=lam1, ski2_weight=lam2, backend="reference")(
        Views.single(gathered, names)).loss
    ref, eq5, eq6 = sup_reference(gathered, gathered, 0, lam1, lam2)
    torch.testing.assert_close(got.double(), ref, **TOL)
    swapped, _, _ = sup_reference(gathered, gathered, 0, lam2, lam1)
    assert abs(float(got) - float(swapped)) > 1e-2
    assert abs(float(eq5) - float(eq6)) > 1e-2  # the two terms differ, so a swap is visible


def test_supervised_rows_without_a_contradiction():
    """sent0,sent1,ski rows: every denominator of Eq. 4-6 loses its h_j- columns."""
    names = ("sent0", "sent1", "ski")
    gathered = _gathered(names, 7, seed=5)
    out = SKICSE(temperature=TAU, backend="reference")(Views.single(gathered, names))
    h, pos, ski = gathered
    ref = 0.6 * eq(h, pos, [pos]) + 0.1 * eq(ski, pos, [pos]) + 0.3 * eq(h, ski, [pos])
    torch.testing.assert_close(out.loss.double(), ref, **TOL)
    (grad,) = torch.autograd.grad(out.loss, gathered)
    (ref_grad,) = torch.autograd.grad(ref, gathered)
    torch.testing.assert_close(grad, ref_grad.float(), **TOL)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_eq6_other_reading_is_an_explicit_option(backend):
    """ski2_denominator="ski": Eq. 6's columns are the SKIs (Eq. 2's form): a -log softmax, so >= 0; the printed
    form is not one (its positive is not in its denominator) and goes below 0 when each SKI is much closer to
    its sentence than the entailment is."""
    names = ("sent0", "sent1", "hard_neg", "ski")
    g = torch.Generator().manual_seed(6)
    h = torch.randn(6, 19, generator=g)
    close = h + 0.05 * torch.randn(6, 19, generator=g)
    far = torch.randn(2, 6, 19, generator=g)
    gathered = torch.stack([h, far[0], far[1], close]).requires_grad_(True)
    printed = SKICSE(temperature=TAU, ski1_weight=0.0, ski2_weight=1.0, backend=backend)
    other = SKICSE(temperature=TAU, ski1_weight=0.0, ski2_weight=1.0, ski2_denominator="ski", backend=backend)
    lp, lo = printed(Views.single(gathered, names)).loss, other(Views.single(gathered, names)).loss
    _, _, ref_printed = sup_reference(gathered, gathered, 0, 0.0, 1.0)
    _, _, ref_other = sup_reference(gathered, gathered, 0, 0.0, 1.0, denominator="ski")
    torch.testing.assert_close(lp.double(), ref_printed, **TOL)
    torch.testing.assert_close(lo.double(), ref_other, **TOL)
    (grad,) = torch.autograd.grad(lo, gathered)
    (ref_grad,) = torch.autograd.grad(ref_other, gathered)
    torch.testing.assert_close(grad, ref_grad.float(), **TOL)
    assert float(lp.detach()) < 0 <= float(lo.detach())
    with pytest.raises(ValueError, match="ski2_denominator must be one of printed, ski"):
        SKICSE(ski2_denominator="columns")
    with pytest.raises(ValueError, match="ski2_denominator must be one of"):
        TrainConfig(objective="skicse", ski2_denominator="x")


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
        TrainConfig(objective="skicse", ski_weight=1.5)
    with pytest.raises(ValueError, match="ski1_weight \\+ ski2_weight must be <= 1"):
        TrainConfig(objective="skicse", ski1_weight=0.6, ski2_weight=0.5)
    with pytest.raises(ValueError, match="no hinge term"):
        ObjectiveConfig(name="skicse", hinge_weight=1.0)


def test_config_builds_the_objective_with_its_weights():
    cfg = TrainConfig(objective="skicse", temperature=0.1, ski_weight=0.2, ski1_weight=0.05, ski2_weight=0.25,
                      ski2_denominator="ski", loss_backend="reference")
    obj = objective_from_config(cfg.loss, objective_sections(cfg))
    assert isinstance(obj, SKICSE)
    assert (obj.temperature, obj.ski_weight, obj.ski1_weight, obj.ski2_weight, obj.ski2_denominator) == (
        0.1, 0.2, 0.05, 0.25, "ski")
