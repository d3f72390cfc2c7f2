"""fastprompt's sentence-transformers losses give sentence-transformers' own loss values and gradients.

Tolerances (fp32): both sides compute cosines by normalising and a matrix product in float32, then a
log-sum-exp of ``scale * cosine`` (scale 20). Each cosine has a rounding error of at most ~d·2^-24 (d = 24 or 32
here: < 2e-6), so a logit differs by < 4e-5 in the worst case and by ~1e-6 in practice (errors of independent
roundings do not line up); the loss (a difference of log-sum-exps, ~1..10) and its gradients (softmax
probabilities minus one-hot, times scale / |z|, of order 1 / N) inherit errors of that size. We compare at
rtol = atol = 1e-5 (the observed maxima are 3e-7 for gradients and 1e-6 for loss values), which any real
difference in what is computed (a missed column, a wrong label, a scale off by a factor) exceeds by orders of
magnitude. Gradients of a model's weights after a backward through the tiny BERT (2 layers) are compared at
the same tolerance: the backward through the encoder is the same code on both sides, and amplifies the
embedding-gradient difference only by the layers' norms (of order 1 at initialisation).
"""
import functools
import os
import warnings

import pytest
import torch

st = pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402
from sentence_transformers.util import dot_score  # noqa: E402

from fastprompt.integrations import st_loss  # noqa: E402

from ..gloo import free_port, gloo_group, spawn  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
SYMMETRIC = dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")

ANCHORS = ["a man plays the guitar .", "the dog runs in the park", "two people sit at a table", "it is red",
           "a woman eats food", "the cat sits", "one big ball", "water in the street"]
POSITIVES = ["a man plays music", "a dog is running", "people sit", "the car is red", "someone is eating",
             "a cat", "a small ball", "the street has water"]
NEGATIVES = [["the cat runs", "nobody plays", "a table", "blue", "a man sits", "the dog eats", "two cars", "food"],
             ["it is big", "a guitar", "the park", "red ball", "the woman", "one dog", "a sentence", "the table"]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _embeddings(n, d, columns, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g).requires_grad_() for _ in range(columns)]


def _loss_and_grads(loss_fn, embs):
    loss = loss_fn.compute_loss_from_embeddings(embs, None)
    return loss.detach(), torch.autograd.grad(loss, embs)


def _assert_same(ours, theirs):
    (l1, g1), (l2, g2) = ours, theirs
    torch.testing.assert_close(l1, l2, **TOL)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, **TOL)


# ---------------------------------------------------------------- the loss on given embeddings


DIRECTIONS = {"mnrl": {}, "symmetric": SYMMETRIC,
              "joint": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="joint")}


@pytest.mark.parametrize("negatives", [0, 1, 2])
@pytest.mark.parametrize("n", [1, 2, 7, 64])
@pytest.mark.parametrize("directions", DIRECTIONS.values(), ids=DIRECTIONS.keys())
def test_same_loss_and_gradients_as_sentence_transformers(negatives, n, directions):
    embs = _embeddings(n, 24, 2 + negatives, seed=n + negatives)
    theirs = _loss_and_grads(st_losses.MultipleNegativesRankingLoss(None, scale=20.0, **directions), embs)
    ours = _loss_and_grads(st_loss.MultipleNegativesRankingLoss(None, scale=20.0, **directions), embs)
    _assert_same(ours, theirs)


@pytest.mark.parametrize("mode", ["in_batch_negatives", "hard_negatives", "all_negatives"])
@pytest.mark.parametrize("negatives", [0, 2])
@pytest.mark.parametrize("directions", DIRECTIONS.values(), ids=DIRECTIONS.keys())
def test_hardness_weighting_equals_sentence_transformers(mode, negatives, directions):
    """hardness_mode / hardness_strength: the same values and gradients as sentence-transformers' loss (the
    penalty strength · stop_grad(cos) enters the softmax, not the gradient). Strength 9 (Lan et al.'s) makes the
    penalty as large as the scaled cosines, so a misplaced or differentiated penalty moves the loss by O(1)."""
    embs = _embeddings(7, 24, 2 + negatives, seed=5 + negatives)
    kw = dict(scale=20.0, hardness_mode=mode, hardness_strength=9.0, **directions)
    theirs = _loss_and_grads(st_losses.MultipleNegativesRankingLoss(None, **kw), embs)
    ours = _loss_and_grads(st_loss.MultipleNegativesRankingLoss(None, **kw), embs)
    _assert_same(ours, theirs)
    plain = _loss_and_grads(st_loss.MultipleNegativesRankingLoss(None, **directions), embs)
    if mode != "hard_negatives" or negatives:  # hard_negatives without negatives weights nothing
        assert abs(float(ours[0]) - float(plain[0])) > 0.1


@pytest.mark.parametrize("similarity_fct", [functools.partial(st.util.cos_sim), st.util.pytorch_cos_sim,
                                            functools.partial(functools.partial(st.util.pytorch_cos_sim))],
                         ids=["partial", "pytorch_cos_sim", "nested-partial"])
def test_cosine_is_recognised_however_it_is_spelt(similarity_fct):
    embs = _embeddings(5, 24, 3)
    theirs = _loss_and_grads(st_losses.MultipleNegativesRankingLoss(None, similarity_fct=similarity_fct), embs)
    ours = _loss_and_grads(st_loss.MultipleNegativesRankingLoss(None, similarity_fct=similarity_fct), embs)
    _assert_same(ours, theirs)


def test_bf16_autocast_gives_a_float32_loss_closer_to_the_float32_one():
    """Under bf16 autocast sentence-transformers' loss is bf16 (its cosine matrix product runs in bf16); the fused
    op computes in float32 whatever the autocast, so its loss is float32 and equals the float32 loss (1e-5, the
    tolerance above), while sentence-transformers' is off by bf16 rounding (2^-8 relative on the cosines, times the
    scale)."""
    embs = _embeddings(16, 24, 3, seed=4)
    reference = st_losses.MultipleNegativesRankingLoss(None).compute_loss_from_embeddings(embs, None).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = st_losses.MultipleNegativesRankingLoss(None).compute_loss_from_embeddings(embs, None)
        ours = st_loss.MultipleNegativesRankingLoss(None).compute_loss_from_embeddings(embs, None)
    assert theirs.dtype == torch.bfloat16 and ours.dtype == torch.float32
    torch.testing.assert_close(ours.detach(), reference, **TOL)
    assert abs(float(theirs) - float(reference)) > 10 * abs(float(ours.detach()) - float(reference))
    assert all(g.dtype == torch.float32 for g in torch.autograd.grad(ours, embs))


@pytest.mark.parametrize("scale", [1.0, 50.0])
def test_scale_is_inverse_temperature(scale):
    embs = _embeddings(9, 24, 3)
    theirs = _loss_and_grads(st_losses.MultipleNegativesRankingLoss(None, scale=scale), embs)
    ours = _loss_and_grads(st_loss.MultipleNegativesRankingLoss(None, scale=scale), embs)
    _assert_same(ours, theirs)


def test_symmetric_class_matches_sentence_transformers():
    embs = _embeddings(6, 24, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # sentence-transformers deprecates its class
        theirs = _loss_and_grads(st_losses.MultipleNegativesSymmetricRankingLoss(None), embs)
    ours = _loss_and_grads(st_loss.MultipleNegativesSymmetricRankingLoss(None), embs)
    _assert_same(ours, theirs)


@pytest.mark.parametrize("symmetric", [False, True], ids=["mnrl", "symmetric"])
def test_hinge_adds_promcse_energy_term(symmetric):
    """hinge_weight adds w * mean(relu(margin + cos(anchor, hardest other candidate) - cos(anchor, positive)))."""
    kw = SYMMETRIC if symmetric else {}
    n, d, w, m = 6, 24, 10.0, 0.2
    embs = _embeddings(n, d, 3, seed=3)
    anchors, cands = embs[0], torch.cat(embs[1:])
    cos = torch.nn.functional.normalize(anchors, dim=1) @ torch.nn.functional.normalize(cands, dim=1).T
    positive = cos.diagonal()
    hardest = cos.masked_fill(torch.eye(n, cands.shape[0], dtype=torch.bool), float("-inf")).max(1).values
    expected = (st_losses.MultipleNegativesRankingLoss(None, **kw).compute_loss_from_embeddings(embs, None)
                + w * torch.relu(m + hardest - positive).mean())
    theirs = expected.detach(), torch.autograd.grad(expected, embs)
    ours = _loss_and_grads(st_loss.MultipleNegativesRankingLoss(None, hinge_weight=w, hinge_margin=m, **kw), embs)
    _assert_same(ours, theirs)
    assert float(torch.relu(m + hardest - positive).mean().detach()) > 1e-2  # the hinge is active on this batch


@pytest.mark.parametrize("directions", [SYMMETRIC, DIRECTIONS["joint"]], ids=["symmetric", "joint"])
def test_hinge_on_a_single_anchor_symmetric_batch(directions):
    """One anchor, symmetric: the reverse term has a single column (the reference computes the 1 x M scores); the
    hinge is added once, with its full gradient."""
    n, w, m = 1, 10.0, 0.9
    embs = _embeddings(n, 24, 4, seed=8)
    cos = torch.nn.functional.normalize(embs[0], dim=1) @ torch.nn.functional.normalize(torch.cat(embs[1:]), dim=1).T
    hinge = torch.relu(m + cos[0, 1:].max() - cos[0, 0])
    expected = (st_losses.MultipleNegativesRankingLoss(None, **directions).compute_loss_from_embeddings(embs, None)
                + w * hinge)
    assert float(hinge) > 0.1
    ours = _loss_and_grads(st_loss.MultipleNegativesRankingLoss(None, hinge_weight=w, hinge_margin=m, **directions),
                           embs)
    _assert_same(ours, (expected.detach(), torch.autograd.grad(expected, embs)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(similarity_fct=dot_score), "cosine"),
    (dict(similarity_fct=functools.partial(dot_score)), "cosine"),
    (dict(similarity_fct=lambda a, b: st.util.cos_sim(a, b)), "cosine"),  # cannot be told from another function
    (dict(directions=("query_to_doc", "query_to_query")), "directions"),
    (dict(directions=("query_to_doc", "doc_to_query", "doc_to_doc")), "directions"),
    (dict(hinge_weight=-1.0), "hinge_weight"),
    (dict(scale=0.0), "positive"),  # sentence-transformers' own validation still runs
    (dict(hardness_mode="hard"), "hardness_mode"),  # and so does its check of the hardness mode
])
def test_unsupported_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        st_loss.MultipleNegativesRankingLoss(None, **kwargs)
    with pytest.raises(ValueError, match=message):
        st_loss.CachedMultipleNegativesRankingLoss(_TinyModelStub(), **kwargs)


class _TinyModelStub(torch.nn.Module):
    """Enough of a SentenceTransformer for the cached loss's constructor checks (no StaticEmbedding)."""

    def __getitem__(self, i):
        return torch.nn.Identity()


def test_rows_must_match():
    embs = [torch.randn(4, 8), torch.randn(3, 8)]
    with pytest.raises(ValueError, match="as many rows"):
        st_loss.MultipleNegativesRankingLoss(None).compute_loss_from_embeddings(embs, None)


def test_config_dict_and_exports():
    import fastprompt.integrations as integrations

    loss = st_loss.CachedMultipleNegativesRankingLoss(_TinyModelStub(), scale=10.0, mini_batch_size=4,
                                                      hinge_weight=2.0)
    cfg = loss.get_config_dict()
    assert cfg["scale"] == 10.0 and cfg["mini_batch_size"] == 4 and cfg["hinge_weight"] == 2.0
    loss.hinge_weight = 3.0  # assignment reaches the wrapped loss, as sentence-transformers' own attributes do
    assert loss.loss.hinge_weight == 3.0 and loss.temperature == 0.1
    assert integrations.CachedMultipleNegativesRankingLoss is st_loss.CachedMultipleNegativesRankingLoss
    assert isinstance(loss, st_losses.CachedMultipleNegativesRankingLoss)  # sentence-transformers' checks apply


@pytest.mark.parametrize("cached", [False, True], ids=["mnrl", "cached"])
def test_config_dict_is_sentence_transformers_when_the_hinge_is_off(cached):
    """The model card of a run with the hinge off lists exactly sentence-transformers' settings."""
    kw = dict(scale=30.0, hardness_mode="all_negatives", hardness_strength=5.0, **DIRECTIONS["joint"])
    if cached:
        ours = st_loss.CachedMultipleNegativesRankingLoss(_TinyModelStub(), mini_batch_size=4, **kw)
        theirs = st_losses.CachedMultipleNegativesRankingLoss(_TinyModelStub(), mini_batch_size=4, **kw)
    else:
        ours = st_loss.MultipleNegativesRankingLoss(None, **kw)
        theirs = st_losses.MultipleNegativesRankingLoss(None, **kw)
    assert ours.get_config_dict() == theirs.get_config_dict()
    ours.hinge_weight = 1.5
    assert ours.get_config_dict() == {**theirs.get_config_dict(), "hinge_weight": 1.5, "hinge_margin": 0.2}


def test_restore_peft_is_importable_where_the_docs_lead():
    """docs/dropin.md: ``fastprompt.accelerate_peft(model)``, undone by ``restore_peft(model)``."""
    import fastprompt
    from fastprompt.integrations import peft_attention

    assert fastprompt.accelerate_peft is peft_attention.accelerate_peft
    assert fastprompt.restore_peft is peft_attention.restore_peft
    assert "restore_peft" in fastprompt.__all__


@pytest.mark.parametrize("name", st_loss.__all__)
def test_each_loss_is_an_instance_of_sentence_transformers_class(name):
    """isinstance(loss, sentence-transformers' class of the same name) holds, for the deprecated symmetric classes
    too, without their DeprecationWarning (subclassing emits it at class definition, silenced in st_loss), and
    the symmetric constructors still set both directions with a softmax per direction."""
    theirs = getattr(st_losses, name)
    assert issubclass(getattr(st_loss, name), theirs)
    model = _TinyModelStub() if name.startswith("Cached") else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        loss = getattr(st_loss, name)(model)
    base = "CachedMultipleNegativesRankingLoss" if name.startswith("Cached") else "MultipleNegativesRankingLoss"
    assert isinstance(loss, theirs) and isinstance(loss, getattr(st_losses, base))
    symmetric = "Symmetric" in name
    assert tuple(loss.directions) == (("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",))
    assert loss.partition_mode == ("per_direction" if symmetric else "joint")


# ---------------------------------------------------------------- on a tiny SentenceTransformer


@pytest.fixture(scope="module")
def tiny_st_dir(tiny_bert_dir):
    return str(tiny_bert_dir)


def _st_model(path):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(path, device="cpu")  # Transformer + mean pooling, built from the local folder


def _features(model, negatives):
    columns = [ANCHORS, POSITIVES] + NEGATIVES[:negatives]
    return [model.preprocess(texts) for texts in columns]


def _grads(model):
    """Every weight's gradient (zeros where it got none: BERT's pooler head is not used by mean pooling)."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


def _model_step(model, loss_fn, negatives, seed=1):
    """One training forward/backward of ``loss_fn`` (dropout on), from a fixed RNG state."""
    model.train()
    model.zero_grad()
    torch.manual_seed(seed)
    loss = loss_fn(_features(model, negatives), None)
    loss.backward()
    return loss.detach(), _grads(model)


CACHED_SETTINGS = {"mnrl": {}, "symmetric": SYMMETRIC,
                   "joint-hardness": dict(hardness_mode="in_batch_negatives", hardness_strength=9.0,
                                          **DIRECTIONS["joint"])}


@pytest.mark.parametrize("negatives", [0, 1, 2])
@pytest.mark.parametrize("setting", CACHED_SETTINGS.values(), ids=CACHED_SETTINGS.keys())
def test_cached_matches_sentence_transformers_cached(tiny_st_dir, negatives, setting):
    """GradCache inside the loss (mini-batches of 3 over 8 rows, dropout replayed): same loss and weight
    gradients as sentence-transformers' CachedMultipleNegativesRankingLoss, and as the plain MNRL in eval mode."""
    kw = dict(mini_batch_size=3, **setting)
    model = _st_model(tiny_st_dir)
    theirs = _model_step(model, st_losses.CachedMultipleNegativesRankingLoss(model, **kw), negatives)
    ours = _model_step(model, st_loss.CachedMultipleNegativesRankingLoss(model, **kw), negatives)
    _assert_same(ours, theirs)
    assert max(float(g.abs().max()) for g in ours[1]) > 1e-4  # the gradients are not trivially zero


def test_cached_equals_plain_without_dropout(tiny_st_dir):
    model = _st_model(tiny_st_dir)
    plain = st_loss.MultipleNegativesRankingLoss(model)
    cached = st_loss.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
    results = []
    for loss_fn in (plain, cached):
        model.eval()  # no dropout: the mini-batched embeddings equal the full-batch ones
        model.zero_grad()
        loss = loss_fn(_features(model, 1), None)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    _assert_same(*results)


@pytest.mark.parametrize("cached", [False, True], ids=["mnrl", "cached"])
def test_inside_matryoshka_loss(tiny_st_dir, cached):
    """sentence-transformers' wrappers work unchanged: MatryoshkaLoss truncates the embeddings (patching the model's
    forward for the plain loss, calculate_loss for the cached one) and sums the losses at each dimension. Weight
    gradients are compared relative to their largest entry (the three losses add up gradients of order 10)."""
    model = _st_model(tiny_st_dir).eval()
    results = []
    for module in (st_losses, st_loss):
        inner = (module.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3) if cached
                 else module.MultipleNegativesRankingLoss(model))
        loss_fn = st_losses.MatryoshkaLoss(model, inner, matryoshka_dims=[32, 16, 8])
        model.zero_grad()
        loss = loss_fn(_features(model, 1), None)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    (l1, g1), (l2, g2) = results
    torch.testing.assert_close(l1, l2, **TOL)
    scale = max(float(g.abs().max()) for g in g2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a / scale, b / scale, **TOL)


# ---------------------------------------------------------------- inside SentenceTransformerTrainer


def _train(path, loss_name, module, tmp_path, steps=3, negatives=1, **loss_kwargs):
    """``steps`` SentenceTransformerTrainer steps; returns the per-step losses, the step-0 weight gradients and
    the trained model."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from transformers import TrainerCallback

    model = _st_model(path)
    data = {"anchor": ANCHORS * 2, "positive": POSITIVES * 2}
    for i in range(negatives):
        data[f"negative_{i + 1}"] = NEGATIVES[i] * 2
    loss_fn = getattr(module, loss_name)(model, **loss_kwargs)
    losses, grads = [], []
    loss_fn.register_forward_hook(lambda mod, inputs, out: losses.append(out.detach().clone()))

    class StepZeroGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 0:
                grads.extend(_grads(model))

    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / loss_name), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
        max_grad_norm=0.0, warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[], seed=7,
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=Dataset.from_dict(data), loss=loss_fn,
                                         callbacks=[StepZeroGradients()])
    result = trainer.train()
    assert trainer.state.global_step == steps
    return losses, grads, model, result


@pytest.mark.parametrize("loss_name, loss_kwargs", [
    ("MultipleNegativesRankingLoss", {}),
    ("CachedMultipleNegativesRankingLoss", dict(mini_batch_size=3)),
], ids=["mnrl", "cached"])
def test_sentence_transformer_trainer_step0_matches(tiny_st_dir, tmp_path, loss_name, loss_kwargs):
    """A short SentenceTransformerTrainer run with fastprompt's loss: step 0 has sentence-transformers' loss and
    weight gradients (same seed, so the same batches and dropout masks), and the run trains the model."""
    ours_losses, ours_grads, trained, _ = _train(tiny_st_dir, loss_name, st_loss, tmp_path / "ours", **loss_kwargs)
    st_losses_, st_grads, _, _ = _train(tiny_st_dir, loss_name, st_losses, tmp_path / "st", **loss_kwargs)
    assert len(ours_losses) == 3 and all(torch.isfinite(x) for x in ours_losses)
    _assert_same((ours_losses[0], ours_grads), (st_losses_[0], st_grads))
    initial = _st_model(tiny_st_dir)
    moved = [float((a - b).detach().abs().max()) for a, b in zip(trained.parameters(), initial.parameters())]
    assert max(moved) > 1e-4  # the optimizer stepped with our gradients


# ---------------------------------------------------------------- gather_across_devices (two gloo processes)


def _gather_worker(rank, world, port, out_dir):
    with gloo_group(rank, world, port):
        results = {}
        for setting, directions in DIRECTIONS.items():
            for negatives in (0, 1):
                kw = dict(gather_across_devices=True, **directions)
                if negatives:  # hardness weighting with the gathered offsets (own vs in-batch columns)
                    kw.update(hardness_mode="all_negatives", hardness_strength=5.0)
                embs = _embeddings(5, 24, 2 + negatives, seed=10 * rank + negatives)
                for name, module in (("ours", st_loss), ("st", st_losses)):
                    loss, grads = _loss_and_grads(module.MultipleNegativesRankingLoss(None, **kw), embs)
                    for i, g in enumerate((loss.reshape(1),) + grads):
                        results[f"{name}_{setting}_{negatives}_{i}"] = g.contiguous()
        from safetensors.torch import save_file

        save_file(results, os.path.join(out_dir, f"rank{rank}.safetensors"))


@pytest.mark.heavy  # two processes
def test_gather_across_devices_matches_sentence_transformers(tmp_path):
    """Two gloo processes: each rank's loss and gradients equal sentence-transformers' gathered loss (forward,
    symmetric per direction and joint; with a negative column, hardness-weighted)."""
    from safetensors.torch import load_file

    spawn(_gather_worker, (2, free_port(), str(tmp_path)))
    for rank in range(2):
        res = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        ours = {k[5:]: v for k, v in res.items() if k.startswith("ours_")}
        assert len(ours) == 3 * (3 + 4)
        for key, value in ours.items():
            torch.testing.assert_close(value, res["st_" + key], **TOL, msg=f"rank {rank} {key}")
