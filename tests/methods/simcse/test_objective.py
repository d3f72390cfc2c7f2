"""SimCSE's objective against the paper's formula written out in plain PyTorch."""
import pytest
import torch
import torch.nn.functional as F

from fastprompt.methods.simcse.objective import SimCSE


def _simcse_paper(z1, z2, z3=None, temp=0.05, hnw=0.0):
    """SimCSE's cl_forward: CrossEntropy over cos(z1, [z2; z3]) / temp with log-weight on z3's diagonal."""
    cos = F.cosine_similarity(z1.unsqueeze(1), z2.unsqueeze(0), dim=-1) / temp
    if z3 is not None:
        c3 = F.cosine_similarity(z1.unsqueeze(1), z3.unsqueeze(0), dim=-1) / temp
        cos = torch.cat([cos, c3 + hnw * torch.eye(len(z1))], 1)
    return F.cross_entropy(cos, torch.arange(len(z1)))


@pytest.mark.parametrize("n_views,batch,dim,hnw", [(2, 5, 8, 0.0), (3, 7, 16, 0.0), (2, 2, 3, 0.0),
                                                   (3, 4, 8, 0.5), (3, 5, 8, -0.7)])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_simcse_matches_paper_formula_and_gradients(n_views, batch, dim, hnw, backend):
    torch.manual_seed(n_views * 100 + batch)
    emb = torch.randn(n_views, batch, dim, dtype=torch.float64, requires_grad=True)
    obj = SimCSE(temperature=0.07, hard_negative_weight=hnw, backend=backend)
    out = obj(emb)
    ref = _simcse_paper(*emb, temp=0.07, hnw=obj.hard_negative_weight)
    torch.testing.assert_close(out.loss, ref, rtol=1e-9, atol=1e-9)
    g, = torch.autograd.grad(out.loss, emb)
    g_ref, = torch.autograd.grad(ref, emb)
    torch.testing.assert_close(g, g_ref, rtol=1e-7, atol=1e-9)
    assert set(out.stats) == {"pos_cos", "hard_neg_cos", "acc"} and 0.0 <= out.stats["acc"] <= 1.0
