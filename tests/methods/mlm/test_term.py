"""DCPCSE's MLM token term against Hugging Face's masked-LM models, its masking, head and weight schedule.

Tolerances (fp32, atol = rtol = 1e-5). Against ``BertForMaskedLM``/``RobertaForMaskedLM`` the two sides run the
same backbone weights and head weights on the same corrupted ids; they differ only in (a) the attention
kernel (fastprompt's prefix-attention op or SDPA vs the eager/SDPA attention of the HF model), (b) computing
the decoder on the chosen rows only vs on every position, and (c) a sum divided by N vs HF's mean. (b) and
(c) are exact row selections and one division; (a) reorders float32 sums of length <= hidden (32) per
attention and matmul, a relative error of a few ulps (~1e-7) per layer, growing at most linearly over 2 layers
and the head: ~1e-6 on a cross-entropy of order log(vocab) ~ 5. 1e-5 leaves a factor 10.
"""
from pathlib import Path

import pytest
import torch

from fastprompt.data import Collator
from fastprompt.methods.mlm.term import MLMTerm, mask_tokens
from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.model.attention import build_prefix_cache, cache_keyword
from fastprompt.objectives import Method, WeightSchedule
from fastprompt.train.config import TrainConfig
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.grad_cache import make_micro_batches, plan_micro_batches
from fastprompt.train.steps import CachedStep, LossSide, extras_generators, term_seed

ROWS = [("a man plays the guitar .",), ("the dog runs in the park with a red ball",),
        ("two people sit at a big table with water .",), ("it",), ("a woman is eating food in the park",),
        ("the cat sits on the blue car",)]
SEED, STEP = 1234, 100


def _save_mlm(src: Path, dst: Path, seed: int) -> Path:
    """A masked-LM checkpoint (``cls.predictions.*`` / ``lm_head.*``) with ``src``'s tokenizer and config."""
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    torch.manual_seed(seed)
    AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module", params=["bert", "roberta"])
def mlm_dir(request, tiny_bert_dir, tiny_roberta_dir, tmp_path_factory):
    src = tiny_bert_dir if request.param == "bert" else tiny_roberta_dir
    return _save_mlm(src, tmp_path_factory.mktemp(f"mlm-{request.param}"), seed=3)


def _batch_with_extras(enc, term, rows=ROWS, n_views=2, seed=SEED):
    batch = Collator(enc.tokenize, 32, views=("sent0",) * n_views)(rows)
    return Method(SimCSE(), [term]).add_extras(batch, extras_generators(Method(SimCSE(), [term]), seed))


def _hf_loss(mlm, ids, mask, labels, **kwargs):
    return mlm(input_ids=ids, attention_mask=mask, labels=labels, **kwargs).loss


def test_mlm_term_equals_hf_masked_lm_without_prompt(mlm_dir):
    from transformers import AutoModelForMaskedLM

    enc = PromptEncoder.from_pretrained(mlm_dir).eval()
    assert enc.prompt is None
    term = MLMTerm.for_encoder(enc)
    batch = _batch_with_extras(enc, term)
    labels = batch.extras["mlm_labels"]
    n = term.num_targets(batch.extras)
    assert n > 5
    ours = term(enc, batch.model_inputs(), batch.extras, None) / n
    hf = AutoModelForMaskedLM.from_pretrained(mlm_dir).eval()
    ref = _hf_loss(hf, batch.extras["mlm_input_ids"], batch.attention_mask, labels)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_mlm_term_with_prompt_equals_the_dynamic_cache_path_and_hf_head(mlm_dir):
    """Prompted: fastprompt's attention path + masked-only logits vs the DynamicCache path + HF's own head on
    every position (the original code's full-logit loss)."""
    from transformers import AutoModelForMaskedLM

    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(mlm_dir, prompt_config=PromptConfig(3, init_std=0.3)).eval()
    term = MLMTerm.for_encoder(enc)
    batch = _batch_with_extras(enc, term)
    labels, ids = batch.extras["mlm_labels"], batch.extras["mlm_input_ids"]
    ours = term(enc, batch.model_inputs(), batch.extras, None) / term.num_targets(batch.extras)

    hf = AutoModelForMaskedLM.from_pretrained(mlm_dir).eval()
    enc.prefix_mode = "cache"  # the reference path: the prefix expanded into a DynamicCache, stock attention
    hidden = enc.hidden_states(ids, batch.attention_mask)
    head = hf.cls if hasattr(hf, "cls") else hf.lm_head
    logits = head(hidden)  # (rows, seq_len, vocab), as DCPCSE's models.py computes it
    ref = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # the reference path really is HF's own key/value-cache route
    B, P = ids.shape[0], enc.prompt_length
    cache = build_prefix_cache(enc._layer_prefixes(), B)
    mask = torch.cat([batch.attention_mask.new_ones(B, P), batch.attention_mask], dim=1)
    pos = enc._position_ids(ids, batch.attention_mask)
    out = hf(input_ids=ids, attention_mask=mask, use_cache=True, position_ids=pos, labels=labels,
             **{cache_keyword(hf.base_model): cache})
    torch.testing.assert_close(ours, out.loss, atol=1e-5, rtol=1e-5)


def test_vocabulary_logits_only_at_masked_positions(tiny_bert_dir, tmp_path):
    enc = PromptEncoder.from_pretrained(_save_mlm(tiny_bert_dir, tmp_path / "m", 3),
                                        prompt_config=PromptConfig(2)).train()
    term = MLMTerm.for_encoder(enc, train_head=False)
    batch = _batch_with_extras(enc, term)
    shapes = []
    for module in term.head.modules():
        module.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    loss = term(enc, batch.model_inputs(), batch.extras, None)
    n, vocab = int(term.num_targets(batch.extras)), enc.backbone.config.vocab_size
    assert (n, vocab) in shapes  # the decoder's output: one row per target
    rows, length = batch.input_ids.shape
    assert all(s[0] == n and len(s) == 2 for s in shapes), shapes  # no (rows, seq_len, ...) tensor in the head
    assert max(s[-1] for s in shapes) * n < rows * length * vocab / 4
    loss.backward()
    assert enc.prompt.prefix.grad.abs().sum() > 0  # the prompts get the term's gradient
    assert all(p.grad is None for p in term.head.parameters())  # train_head=False: the head stays frozen


def test_the_checkpoints_head_trains_as_dcpcse_code_trains_it(mlm_dir):
    """train_head (the default): every tensor of the checkpoint's head gets a gradient, the decoder's included, as
    a copy of the word embeddings (untied: the frozen backbone's embeddings never move); at the start the loss is
    the frozen head's; the resume state holds each tensor once (safetensors refuses shared storage)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(mlm_dir, prompt_config=PromptConfig(3, init_std=0.3)).eval()
    emb = enc.backbone.get_input_embeddings().weight
    trained, frozen = MLMTerm.for_encoder(enc), MLMTerm.for_encoder(enc, train_head=False)
    batch = _batch_with_extras(enc, trained)
    loss = trained(enc, batch.model_inputs(), batch.extras, None)
    torch.testing.assert_close(loss, frozen(enc, batch.model_inputs(), batch.extras, None), atol=1e-6, rtol=1e-6)
    loss.backward()
    decoder = getattr(trained.head, "predictions", trained.head).decoder
    assert decoder.weight is not emb and torch.equal(decoder.weight, emb) and emb.grad is None
    grads = {k: p.grad for k, p in trained.named_parameters()}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values()), list(grads)
    assert any(k.endswith("decoder.weight") for k in grads) and any(k.endswith("decoder.bias") for k in grads)
    assert not any(p.requires_grad for p in frozen.head.parameters())
    state = Method(SimCSE(), [trained]).resume_state()
    assert set(state) == {f"terms.0.{k}" for k in grads}
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(mlm_dir.parent / "resume.safetensors"))
    with pytest.raises(ValueError, match="tied_new is a new head: it must train"):
        MLMTerm.for_encoder(enc, "tied_new", train_head=False)
    with pytest.raises(ValueError, match="mlm_train_head: true"):
        TrainConfig(do_mlm=True, mlm_head="tied_new", mlm_train_head=False)


def test_masking_recipe_and_reproducibility(tiny_bert_dir):
    ids = torch.randint(5, 150, (400, 40))
    ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
    mask = torch.ones_like(ids)
    mask[200:, 30:] = 0
    ids[200:, 30:] = 0
    special = torch.tensor([0, 1, 2, 3, 4])
    kwargs = dict(mask_token_id=4, vocab_size=150, probability=0.15)
    corrupted, labels = mask_tokens(ids, mask, special, generator=torch.Generator().manual_seed(0), **kwargs)
    again = mask_tokens(ids, mask, special, generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.equal(corrupted, again[0]) and torch.equal(labels, again[1])
    chosen = labels != -100
    assert not chosen[:, 0].any() and not chosen[:, -1].any() and not chosen[200:, 30:].any()
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(corrupted[~chosen], ids[~chosen])
    eligible = int(mask.sum()) - 2 * 400
    # 15,600 eligible tokens: binomial standard deviations are ~0.3% (chosen share) and ~1-3% (80/10/10)
    assert abs(chosen.sum() / eligible - 0.15) < 0.015
    n = chosen.sum()
    masked = (corrupted == 4) & chosen
    kept = (corrupted == ids) & chosen
    assert abs(masked.sum() / n - 0.8) < 0.03
    assert abs(kept.sum() / n - 0.1) < 0.03  # a random id equal to the original (1/150) counts as kept
    assert abs((chosen & ~masked & ~kept).sum() / n - 0.1) < 0.03


def test_weight_schedule_from_the_config():
    cfg = TrainConfig(do_mlm=True)
    m = cfg.mlm
    w = WeightSchedule(m.weight, m.decay_rate, m.decay_steps)
    assert w(0) == pytest.approx(0.1)
    assert w(100) == pytest.approx(0.095)
    assert w(1000) == pytest.approx(0.1 * 0.95 ** 10)  # 0.05987
    assert TrainConfig(mlm_weight=0.2, mlm_decay_rate=0.5, mlm_decay_steps=10).mlm.decay_steps == 10
    with pytest.raises(ValueError, match="mlm_decay_rate"):
        TrainConfig(mlm_decay_rate=1.5)
    with pytest.raises(ValueError, match="mlm_head"):
        TrainConfig(mlm_head="new")


def test_a_backbone_without_head_needs_the_explicit_opt_in(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(2))
    with pytest.raises(ValueError, match="mlm_head: tied_new"):
        MLMTerm.for_encoder(enc)
    term = MLMTerm.for_encoder(enc, "tied_new")
    emb = enc.backbone.get_input_embeddings().weight
    decoder = term.head.predictions.decoder
    assert decoder.weight is emb and not decoder.weight.requires_grad
    trainable = {k for k, p in term.named_parameters() if p.requires_grad}
    assert trainable == {"head.predictions.decoder.bias", "head.predictions.transform.dense.weight",
                         "head.predictions.transform.dense.bias", "head.predictions.transform.LayerNorm.weight",
                         "head.predictions.transform.LayerNorm.bias"}
    saved = Method(SimCSE(), [term]).resume_state()
    assert "terms.0.head.predictions.transform.dense.weight" in saved
    assert not any("decoder.weight" in k for k in saved)
    batch = _batch_with_extras(enc, term)
    term(enc, batch.model_inputs(), batch.extras, None).backward()
    assert term.head.predictions.transform.dense.weight.grad.abs().sum() > 0
    assert enc.prompt.prefix.grad.abs().sum() > 0


def test_minilm_has_no_head_and_the_error_names_the_fix(minilm_dir):
    enc = PromptEncoder.from_pretrained(minilm_dir)
    with pytest.raises(ValueError, match="no MLM head weights.*mlm_head: tied_new"):
        MLMTerm.for_encoder(enc)


def _reference(enc, method, batch, groups):
    """Plain PyTorch: the same micro-batches embedded with a graph, the head over all rows, the MLM term on each
    micro-batch on the contract's RNG stream, one backward (see tests/train/test_steps.py)."""
    torch.manual_seed(SEED)
    micro = make_micro_batches(batch.model_inputs(), groups, batch.extras)
    reps = torch.empty(batch.rows, enc.hidden_size)
    for mb in micro:
        reps = reps.index_put((mb.rows,), enc(**mb.inputs, head=False))
    emb = enc.pooler.head(reps)
    loss = method.sentence(emb.view(batch.n_views, batch.batch_size, -1)).loss
    term = method.terms[0]
    n = term.num_targets(batch.extras)
    for i, mb in enumerate(micro):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(term_seed(SEED, term.name, i))
            loss = loss + term.weight(STEP) * term(enc, mb.inputs, mb.extras, None) / n
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("head,train_head", [("checkpoint", True), ("checkpoint", False), ("tied_new", True)])
def test_gradient_cache_equals_reference_with_the_mlm_term(mlm_dir, head, train_head):
    """Dropout on (hidden, attention and prompt dropout 0.1). Same fp32 kernels, same rows, same RNG streams on
    both sides; only the order of gradient accumulation differs: a few ulps, 1e-5 leaves two orders of margin."""
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(mlm_dir, prompt_config=PromptConfig(3, prompt_dropout=0.1, init_std=0.3),
                                        pooler="cls", mlp="train").train()
    term = MLMTerm.for_encoder(enc, head, train_head, weight=WeightSchedule(0.1, 0.95, 100))
    method = Method(SimCSE(temperature=0.05, backend="reference"), [term]).train()
    batch = Collator(enc.tokenize, 32, views=("sent0", "sent0"))(ROWS)
    method.add_extras(batch, extras_generators(method, SEED))
    groups = plan_micro_batches(batch.attention_mask, 4, None)
    assert len(groups) > 1
    params = dict(enc.named_parameters()) | {f"method.{k}": v for k, v in method.named_parameters()}
    ref_loss = _reference(enc, method, batch, groups)
    ref = {k: p.grad.clone() for k, p in params.items() if p.grad is not None}
    for p in params.values():
        p.grad = None
    torch.manual_seed(SEED)
    out = CachedStep(LossSide(method, enc, DistributedContext()), micro_batch_size=4, max_tokens=None)(
        batch, STEP, SEED)
    got = {k: p.grad for k, p in params.items() if p.grad is not None}
    torch.testing.assert_close(torch.tensor(out.loss), ref_loss, atol=1e-5, rtol=1e-5)
    assert "prompt.prefix" in got and set(got) == set(ref)
    head_grads = [k for k in got if k.startswith("method.terms.0.head.")]
    if head == "tied_new":
        assert "method.terms.0.head.predictions.transform.dense.weight" in got or \
            "method.terms.0.head.dense.weight" in got
    elif train_head:
        assert any(k.endswith("decoder.weight") for k in head_grads), head_grads
    else:
        assert not head_grads
    for k in ref:
        assert ref[k].abs().sum() > 0, k
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert out.stats["w_mlm"] == pytest.approx(0.095) and out.stats["loss_mlm"] > 0


def test_a_pretraining_checkpoint_loads_its_mlm_head_and_skips_the_next_sentence_head(tiny_bert_dir, tmp_path):
    """bert-base-uncased is saved as ``BertForPreTraining``: ``cls.predictions.*`` next to the next-sentence
    head ``cls.seq_relationship.*``. The MLM head is ``cls.predictions`` exactly; the term's loss equals the
    cross-entropy of HF's own ``prediction_logits`` (same tolerance analysis as above)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, BertForPreTraining

    AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(tmp_path)
    torch.manual_seed(5)
    BertForPreTraining(AutoConfig.from_pretrained(tiny_bert_dir)).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert any(k.startswith("cls.seq_relationship.") for k in f.keys())
    enc = PromptEncoder.from_pretrained(tmp_path).eval()
    term = MLMTerm.for_encoder(enc, train_head=False)  # the head as loaded (a trained one holds its bias once)
    hf = BertForPreTraining.from_pretrained(tmp_path).eval()
    ours = term.head.state_dict()
    theirs = hf.cls.state_dict()
    assert set(ours) == {k for k in theirs if k.startswith("predictions.")}
    for k, v in ours.items():
        torch.testing.assert_close(v, theirs[k], atol=0, rtol=0, msg=k)
    batch = _batch_with_extras(enc, term)
    labels = batch.extras["mlm_labels"]
    loss = term(enc, batch.model_inputs(), batch.extras, None) / term.num_targets(batch.extras)
    logits = hf(input_ids=batch.extras["mlm_input_ids"], attention_mask=batch.attention_mask).prediction_logits
    ref = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)


def test_unknown_tensors_under_the_head_prefix_are_still_an_error(tiny_bert_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = _save_mlm(tiny_bert_dir, tmp_path, 3)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["cls.something_else.weight"] = torch.zeros(2)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    enc = PromptEncoder.from_pretrained(src)
    with pytest.raises(ValueError, match="unexpected.*something_else"):
        MLMTerm.for_encoder(enc)
