"""SimCSE and PromCSE-EH objectives against the papers' formulas written out in plain PyTorch."""
import pytest
import torch
import torch.nn.functional as F

from fastprompt.methods.promcse.objective import PromCSEEH
from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.objectives import OBJECTIVES, build_objective


def _simcse_paper(z1, z2, z3=None, temp=0.05, hnw=0.0):
    """SimCSE's cl_forward: CrossEntropy over cos(z1, [z2; z3]) / temp with log-weight on z3's diagonal."""
    cos = F.cosine_similarity(z1.unsqueeze(1), z2.unsqueeze(0), dim=-1) / temp
    if z3 is not None:
        c3 = F.cosine_similarity(z1.unsqueeze(1), z3.unsqueeze(0), dim=-1) / temp
        cos = torch.cat([cos, c3 + hnw * torch.eye(len(z1))], 1)
    return F.cross_entropy(cos, torch.arange(len(z1)))


def _eh_paper(z1, z2, z3=None, margin=0.2):
    """PromCSE's energy-based hinge: MarginRankingLoss(pos cos, hardest non-positive cos)."""
    c12 = F.cosine_similarity(z1.unsqueeze(1), z2.unsqueeze(0), dim=-1)
    pos = c12.diag()
    neg = c12.masked_fill(torch.eye(len(z1), dtype=torch.bool), -1e9)
    if z3 is not None:
        neg = torch.cat([neg, F.cosine_similarity(z1.unsqueeze(1), z3.unsqueeze(0), dim=-1)], 1)
    return F.margin_ranking_loss(pos, neg.max(1).values, torch.ones_like(pos), margin=margin)


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


def test_registry_and_errors():
    assert set(OBJECTIVES) == {"simcse", "promcse_eh", "skicse"}
    obj = build_objective("promcse_eh", temperature=0.1, backend="reference")
    assert isinstance(obj, PromCSEEH) and obj.temperature == 0.1 and obj.hinge_weight == 10.0
    with pytest.raises(ValueError, match="objective promcse_eh takes no learning_rate"):
        build_objective("promcse_eh", temperature=0.1, learning_rate=3.0)  # would set nothing
    with pytest.raises(ValueError, match="unknown objective 'infonce'"):
        build_objective("infonce")
    with pytest.raises(ValueError, match="hinge_weight > 0"):
        PromCSEEH(hinge_weight=0.0)
    with pytest.raises(ValueError, match="k >= 0 negatives"):
        SimCSE()(torch.randn(4, 3, 8))
    with pytest.raises(ValueError, match="no in-batch negative"):
        SimCSE()(torch.randn(2, 1, 8))
    nan = torch.randn(2, 3, 4)
    nan[0, 0, 0] = float("nan")
    assert not torch.isfinite(SimCSE()(nan).loss)  # reported as a non-finite loss, not an exception


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_an_objective_built_without_a_config_has_the_configs_defaults(name):
    """The classes take their defaults from the config: SimCSE() is what a default config builds (SKICSE's from its
    own section too)."""
    import dataclasses

    from fastprompt.methods import objective_sections
    from fastprompt.objectives import objective_from_config
    from fastprompt.train import TrainConfig

    cfg = TrainConfig(objective=name)
    assert build_objective(name) == objective_from_config(cfg.loss, objective_sections(cfg))
    assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(OBJECTIVES[name]))


def test_config_keys_the_objective_does_not_read_are_refused():
    """objective_from_config passes each objective the keys its fields are named after; a key set away from its
    default that the chosen objective ignores would otherwise change nothing, silently."""
    from fastprompt.methods import objective_sections
    from fastprompt.objectives import ObjectiveConfig, objective_from_config
    from fastprompt.train import TrainConfig

    cfg = TrainConfig(objective="simcse", ski_weight=0.3)  # SKICSE's key, in its method's own section
    assert cfg.ski.ski_weight == 0.3 and not hasattr(cfg.loss, "ski_weight")
    with pytest.raises(ValueError, match=r"objective simcse does not use ski_weight=0.3"):
        objective_from_config(cfg.loss, objective_sections(cfg))
    with pytest.raises(ValueError, match=r"objective skicse does not use hinge_margin=0.5"):
        objective_from_config(ObjectiveConfig(name="skicse", hinge_margin=0.5))
    obj = objective_from_config(ObjectiveConfig(name="promcse_eh", hinge_margin=0.5, loss_backend="reference"))
    assert (obj.hinge_margin, obj.hinge_weight, obj.backend) == (0.5, 10.0, "reference")


def test_register_objective_refuses_bad_names_and_duplicates():
    from fastprompt.objectives import register_objective

    with pytest.raises(ValueError, match="already registered"):
        register_objective("simcse", SimCSE)
    with pytest.raises(ValueError, match="identifier"):
        register_objective("my-loss", SimCSE)
    with pytest.raises(ValueError, match="'module:Class'"):
        register_objective("mine", "fastprompt.methods.simcse.objective.SimCSE")
