"""PromCSE-EH's objective (SimCSE's InfoNCE + the energy-based hinge) against the paper's formulas written out in
plain PyTorch (SimCSE's: tests/methods/simcse/test_objective.py)."""
import pytest
import torch
import torch.nn.functional as F

from fastprompt.methods.promcse.objective import PromCSEEH

from ..simcse.test_objective import _simcse_paper


def _eh_paper(z1, z2, z3=None, margin=0.2):
    """PromCSE's energy-based hinge: MarginRankingLoss(pos cos, hardest non-positive cos)."""
    c12 = F.cosine_similarity(z1.unsqueeze(1), z2.unsqueeze(0), dim=-1)
    pos = c12.diag()
    neg = c12.masked_fill(torch.eye(len(z1), dtype=torch.bool), -1e9)
    if z3 is not None:
        neg = torch.cat([neg, F.cosine_similarity(z1.unsqueeze(1), z3.unsqueeze(0), dim=-1)], 1)
    return F.margin_ranking_loss(pos, neg.max(1).values, torch.ones_like(pos), margin=margin)


@pytest.mark.parametrize("n_views", [2, 3])
def test_promcse_eh_is_cl_plus_10_hinge_on_pairs_and_triplets(n_views):
    torch.manual_seed(n_views)
    emb = torch.randn(n_views, 6, 12, dtype=torch.float64, requires_grad=True)
    out = PromCSEEH(backend="reference")(emb)
    cl, eh = _simcse_paper(*emb), _eh_paper(*emb, margin=0.2)
    assert eh > 0  # random embeddings: the hinge is active, so the test checks it
    torch.testing.assert_close(out.loss, cl + 10 * eh, rtol=1e-9, atol=1e-9)
    g, = torch.autograd.grad(out.loss, emb)
    g_ref, = torch.autograd.grad(cl + 10 * eh, emb)
    torch.testing.assert_close(g, g_ref, rtol=1e-7, atol=1e-9)
    assert out.stats["loss_eh"] == pytest.approx(eh.item()) and out.stats["loss_cl"] == pytest.approx(cl.item())


def test_eh_is_zero_when_positives_win_by_the_margin():
    z = torch.eye(4, 8, dtype=torch.float64)
    emb = torch.stack([z, z])  # positives identical (cos 1), negatives orthogonal (cos 0)
    out = PromCSEEH(hinge_margin=0.2)(emb)
    assert out.stats["loss_eh"] == 0.0 and out.stats["acc"] == 1.0
    torch.testing.assert_close(out.loss, _simcse_paper(z, z))
