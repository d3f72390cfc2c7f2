"""PromptBERT training: views wrapped in two templates, denoised, through both step strategies and the trainer.

The gradient-cache check follows tests/train/test_steps.py: the reference embeds the same micro-batches with a
graph (same dropout masks as the cache's first pass, the template bias included, since it is computed inside
the embed call) and backpropagates once. Micro-batches are planned by length over all rows, so they mix rows of
both templates; a row pooled at the wrong template's [MASK], or denoised with the wrong bias, changes the
loss by far more than the tolerance. Tolerance as in test_steps.py: fp32, only the summation order differs
(a few ulps on gradients of order 1e-2..1), atol = rtol = 1e-5.
"""
import pytest
import torch

from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.model.promptbert import PROMPTBERT_TEMPLATES
from fastprompt.objectives import Method
from fastprompt.train import TrainConfig
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.grad_cache import make_micro_batches, plan_micro_batches
from fastprompt.train.promptbert import TemplateCollator, TemplateViewEmbedder, template_collator
from fastprompt.train.steps import CachedStep, LossSide, PlainStep

SENTS = ["a man plays the guitar .", "the dog runs", "two people sit at a big table with water .", "it",
         "a woman is eating food in the park", "the cat sits"]
T1, T2 = PROMPTBERT_TEMPLATES["bert"]
SEED = 99


def _encoder(model_dir, template=T1, prompt=PromptConfig(3, prompt_dropout=0.1, init_std=0.3)):
    torch.manual_seed(0)
    return PromptEncoder.from_pretrained(model_dir, prompt_config=prompt, pooler="mask", mlp="train",
                                         template=template).train()


def _grads(enc):
    return {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model,denoise,budget", [("bert", True, dict(micro_batch_size=3)),
                                                  ("roberta", True, dict(max_tokens=60)),
                                                  ("bert", False, dict(micro_batch_size=5))])
def test_cached_step_equals_reference_with_two_templates(request, model, denoise, budget):
    enc = _encoder(request.getfixturevalue(f"tiny_{model}_dir"))
    templates = (T1, T2)
    collate = TemplateCollator(enc, templates, (0, 1), 32, columns=("sent0",), views=("sent0", "sent0"),
                               pad_token_id=enc.tokenizer.pad_token_id)
    batch = collate([(s,) for s in SENTS])
    assert batch.template_index.tolist() == [0] * 6 + [1] * 6
    embed = TemplateViewEmbedder(enc, templates, denoise)
    method = Method(SimCSE(temperature=0.05, backend="reference"))
    groups = plan_micro_batches(batch.attention_mask, budget.get("micro_batch_size"), budget.get("max_tokens"))
    micro = make_micro_batches(batch.model_inputs(), groups)
    assert any(len(set(mb.inputs["template_index"].tolist())) == 2 for mb in micro), "no mixed micro-batch"

    torch.manual_seed(SEED)
    reps = torch.empty(batch.rows, enc.hidden_size)
    for mb in micro:
        reps = reps.index_put((mb.rows,), embed(**mb.inputs))
    emb = enc.pooler.head(reps)
    ref_loss = method.sentence(emb.view(2, len(SENTS), -1)).loss
    ref_loss.backward()
    ref = _grads(enc)
    assert {"prompt.prefix", "pooler.head.0.weight"} <= set(ref)

    enc.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    side = LossSide(method, enc, DistributedContext(), embed=embed)
    out = CachedStep(side, micro_batch_size=budget.get("micro_batch_size"), max_tokens=budget.get("max_tokens"))(
        batch, 0, SEED)
    torch.testing.assert_close(torch.tensor(out.loss), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    got = _grads(enc)
    assert set(got) == set(ref)
    for name in ref:
        assert ref[name].abs().sum() > 0
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_embedder_equals_each_template_encoded_on_its_own(tiny_bert_dir):
    """Without dropout, the training embedder gives each view's vectors as an encoder of that template alone
    encodes them (pooled at its [MASK], denoised)."""
    enc = _encoder(tiny_bert_dir).eval()
    collate = TemplateCollator(enc, (T1, T2), (0, 1), 32, columns=("sent0",), views=("sent0", "sent0"),
                               pad_token_id=0)
    batch = collate([(s,) for s in SENTS])
    with torch.no_grad():
        got = TemplateViewEmbedder(enc, (T1, T2), True)(**batch.model_inputs())
    refs = []
    for t in (T1, T2):
        single = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(3), pooler="mask",
                                               mlp="train", template=t, denoise=True).eval()
        single.load_state_dict(enc.state_dict())
        refs.append(single.encode(SENTS, max_length=32, normalize=False, convert_to_numpy=False))
    torch.testing.assert_close(got, torch.cat(refs), atol=1e-5, rtol=1e-5)
    # and the two views really differ by template: pooling every row at the first template would not match
    with torch.no_grad():
        wrong = TemplateViewEmbedder(enc, (T1, T2), True)(batch.input_ids, batch.attention_mask)
    assert not torch.allclose(wrong[6:], got[6:], atol=1e-3)


def test_plain_step_runs_supervised_three_views(tiny_bert_dir):
    """Supervised PromptBERT: premise in the first template, entailment and contradiction in the second."""
    enc = _encoder(tiny_bert_dir)
    cfg = TrainConfig(model=str(tiny_bert_dir), pooler="mask", template=T1, second_template=T2, denoise=True)
    collate = template_collator(cfg, enc, ("sent0", "sent1", "hard_neg"), ("sent0", "sent1", "hard_neg"))
    batch = collate([(SENTS[i], SENTS[i + 1], SENTS[i + 2]) for i in range(3)])
    assert batch.template_index.tolist() == [0] * 3 + [1] * 6
    t2 = enc._resolve_template(T2)
    row = batch.input_ids[3, :int(batch.attention_mask[3].sum())].tolist()
    assert row[:t2.sentence_start] == [*t2.lead, *t2.before]
    side = LossSide(Method(SimCSE(backend="reference")), enc, DistributedContext(),
                    embed=TemplateViewEmbedder(enc, (T1, T2), True))
    PlainStep(side)(batch, 0, SEED)
    assert enc.prompt.prefix.grad.abs().sum() > 0


def test_max_length_counts_sentence_tokens_and_budget_includes_the_template(tiny_bert_dir):
    enc = _encoder(tiny_bert_dir)
    overhead = enc._resolve_template(T1).overhead
    cfg = TrainConfig(model=str(tiny_bert_dir), pooler="mask", template=T1, max_length=4,
                      max_tokens_per_micro_batch=4 + overhead - 1)
    with pytest.raises(ValueError, match=f"template adds {overhead}"):
        template_collator(cfg, enc, ("sent0",), ("sent0", "sent0"))
    cfg.max_tokens_per_micro_batch = 4 + overhead
    batch = template_collator(cfg, enc, ("sent0",), ("sent0", "sent0"))([(s,) for s in SENTS])
    assert int(batch.attention_mask.sum(1).max()) == 4 + overhead  # sentences cut at 4 tokens, template kept


def test_config_keys_and_their_rules():
    cfg = TrainConfig(pooler="mask", template=T1, second_template=T2, denoise=True, topk=5)
    assert cfg.templates.resolved_eval_denoise is True and cfg.uses_template
    assert TrainConfig(pooler="mask", denoise=True, eval_denoise=False).templates.resolved_eval_denoise is False
    with pytest.raises(ValueError, match="need pooler=mask"):
        TrainConfig(pooler="cls", template=T1, denoise=True)
    with pytest.raises(ValueError, match="exactly one"):
        TrainConfig(template="no sentence here [MASK]")
    with pytest.raises(ValueError, match="second_template"):
        TrainConfig(pooler="cls", second_template=T2)
    with pytest.raises(ValueError, match="optiprompt"):
        TrainConfig(pooler="mask", template=T1, second_template=T2, optiprompt=True, prompt_type="input")


def test_trainer_runs_promptbert_with_gradient_cache_and_saves_the_template(base_config, tiny_sts_dir):
    from fastprompt.train import Trainer
    from fastprompt.train.config import load_config

    keys = base_config(pooler="mask", max_steps=3, eval_steps=3, sts_dir=str(tiny_sts_dir), final_eval=False,
                       micro_batch_size=5)
    cfg = load_config(None, {**keys, "template": T1, "second_template": T2, "denoise": True,
                             "eval_denoise": False})
    trainer = Trainer(cfg)
    summary = trainer.train()
    assert summary["status"] == "completed"
    saved = PromptEncoder.load(trainer.best_dir)
    assert saved.template == T1 and saved.denoise is False


def test_frozen_baseline_of_a_promptbert_run_uses_its_template(base_config, tiny_sts_dir):
    """frozen_baseline scores the base model the way the run evaluates: its pooler, its template, its evaluation
    denoising (and top-k), with no prompt; not PromptBERT's default template."""
    from fastprompt.eval.sts import evaluate_sts
    from fastprompt.model import DEFAULT_TEMPLATE
    from fastprompt.train import Trainer

    assert T1 != DEFAULT_TEMPLATE
    keys = base_config(pooler="mask", max_steps=2, eval_steps=2, sts_dir=str(tiny_sts_dir), frozen_baseline=True,
                       template=T1, denoise=True, eval_denoise=True)
    frozen = Trainer(keys).train()["frozen_baseline"]
    assert frozen["pooler"] == "mask"

    def scores(**template):
        enc = PromptEncoder.from_pretrained(keys["model"], pooler="mask", **template).eval()
        return evaluate_sts(enc, tiny_sts_dir)

    own = scores(template=T1, denoise=True)
    assert frozen["test"] == pytest.approx(own, abs=1e-9)
    default = scores()  # what the baseline computed before it read the run's template
    assert any(abs(own[k] - default[k]) > 1e-6 for k in own)


def test_cached_step_equals_reference_with_the_mlm_transform_head(tiny_bert_masked_lm):
    """Supervised PromptBERT's BERT head (pooler_head mlm_transform): T(h) - T(bias) inside the embed call, so the
    gradient cache replays it with the rest of each micro-batch; the transform's gradients equal one graph's."""
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(tiny_bert_masked_lm, prompt_config=PromptConfig(3, prompt_dropout=0.1,
                                                                                  init_std=0.3),
                                        pooler="mask", mlp="always", template=T1, denoise=True,
                                        pooler_head="mlm_transform").train()
    views = ("sent0", "sent1", "hard_neg")
    collate = TemplateCollator(enc, (T1,), (0, 0, 0), 32, columns=views, views=views,
                               pad_token_id=enc.tokenizer.pad_token_id)
    batch = collate([(SENTS[i], SENTS[(i + 1) % 6], SENTS[(i + 2) % 6]) for i in range(6)])
    embed = TemplateViewEmbedder(enc, (T1,), denoise=True)
    method = Method(SimCSE(temperature=0.05, backend="reference"))
    groups = plan_micro_batches(batch.attention_mask, 4, None)
    torch.manual_seed(SEED)
    reps = torch.empty(batch.rows, enc.hidden_size)
    for mb in make_micro_batches(batch.model_inputs(), groups):
        reps = reps.index_put((mb.rows,), embed(**mb.inputs))
    ref_loss = method.sentence(enc.pooler.apply_head(reps).view(3, 6, -1)).loss
    ref_loss.backward()
    ref = _grads(enc)
    assert {"prompt.prefix", "pooler.head.dense.weight", "pooler.head.LayerNorm.weight"} <= set(ref)
    enc.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    out = CachedStep(LossSide(method, enc, DistributedContext(), embed=embed), micro_batch_size=4,
                     max_tokens=None)(batch, 0, SEED)
    torch.testing.assert_close(torch.tensor(out.loss), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    got = _grads(enc)
    assert set(got) == set(ref)
    for name in ref:
        # the LayerNorm's bias cancels in T(h) - T(bias): its gradient is exactly zero (in the authors' code too)
        assert (ref[name].abs().sum() > 0) != (name == "pooler.head.LayerNorm.bias"), name
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("recipe", ["promptbert-sup-bert-base.yaml", "optiprompt-bert-base.yaml"])
def test_the_bert_recipes_train_their_transform_head(recipe, tiny_bert_masked_lm, tiny_triplets, tiny_corpus,
                                                     tmp_path):
    """The two recipes with BERT's pretrained MLM transform as the head, scaled down to the tiny BERT: supervised
    PromptBERT (the backbone trains too; the head in training and evaluation, after denoising) and OptiPrompt
    (the template's vectors and the head train, the backbone is frozen; the head in training only): the head
    moves, and best/ holds it and evaluates as the trained encoder does."""
    from pathlib import Path

    from fastprompt.train import Trainer
    from fastprompt.train.config import load_config

    sup = recipe.startswith("promptbert")
    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / recipe, dict(
        model=str(tiny_bert_masked_lm), train_file=str(tiny_triplets if sup else tiny_corpus), batch_size=8,
        micro_batch_size=5, max_steps=2, sts_dir=None, output_dir=str(tmp_path / "run"), precision="fp32",
        num_threads=1, progress_bar=False, tensorboard=False))
    assert cfg.pooler_head == "mlm_transform" and cfg.train_backbone == sup
    assert cfg.mlp == ("always" if sup else "train")
    trainer = Trainer(cfg)
    trainer.setup()
    before = trainer.encoder.pooler.head.dense.weight.detach().clone()
    assert trainer.train()["status"] == "completed"
    after = trainer.encoder.pooler.head.dense.weight.detach()
    assert not torch.equal(before, after)
    if not sup:
        assert trainer.encoder.template_words is not None and not trainer.encoder.backbone_trained
    saved = PromptEncoder.load(trainer.best_dir).eval()
    assert saved.pooler.head_kind == "mlm_transform" and saved.denoise == sup
    torch.testing.assert_close(saved.pooler.head.dense.weight, after, atol=0, rtol=0)
    trainer.encoder.eval()
    # the same forward as the trainer's encoder (packed or not): template denoising subtracts two nearly equal
    # vectors of the tiny model, which turns packed-vs-padded rounding (~1e-8) into ~1e-5
    saved.pack_sequences(trainer.encoder.packed)
    torch.testing.assert_close(torch.as_tensor(saved.encode(SENTS)), torch.as_tensor(trainer.encoder.encode(SENTS)),
                               atol=1e-6, rtol=0)
