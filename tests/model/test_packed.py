"""Packed batches (``PromptEncoder.pack_sequences``): the real tokens of every row back to back in one sequence,
through every layer, with the variable-length prefix attention keeping the sequences apart. The same maths as the
padded batch, so the padded forward of the same encoder is the reference: hidden states at the real tokens, pooled
vectors and prompt gradients.

Everything is float64 on tiny random configs (tests/model/test_architectures.py's), so the two sides differ by
summation order alone (the linear layers see N rows instead of B x S, the attention reads another layout):
~1e-15 relative per op through 2 normalised layers; 1e-10 leaves five orders of magnitude, while a sequence that
sees another's tokens, a wrong position id or a layer that skipped its prefix moves outputs by ~1e-1 (the
negative controls below show it). ~25 s on 2 shared cores.
"""
import pytest
import torch

from fastprompt.model import PromptConfig

from .test_architectures import (
    BYPASSING,
    DECODERS,
    ENCODERS,
    SENTENCES,
    TOL,
    _encoder,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PACKABLE = {**ENCODERS, "mpnet": BYPASSING["mpnet"], **DECODERS}
#: the architectures whose last layer computes the pooled rows only in a packed batch
ROWS_ONLY = ["bert", "roberta", "xlm-roberta", "electra"]
SIDES = [(t, "right") for t in PACKABLE] + [(t, "left") for t in DECODERS]


def _run(enc, batch, packed, pool=True):
    """(hidden states at the real tokens, pooled vectors, prompt gradients) of one forward + backward."""
    enc.zero_grad(set_to_none=True)
    enc.pack_sequences(packed)
    hidden = enc.hidden_states(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    vec = enc.pool(hidden, batch["input_ids"], batch["attention_mask"])
    (vec * torch.linspace(-1, 1, vec.numel(), dtype=vec.dtype).view_as(vec)).sum().backward()
    grads = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
    return hidden[batch["attention_mask"].bool()].detach(), vec.detach(), grads


def _assert_same(enc, batch):
    ref_h, ref_v, ref_g = _run(enc, batch, False)
    got_h, got_v, got_g = _run(enc, batch, True)
    torch.testing.assert_close(got_h, ref_h, **TOL)
    torch.testing.assert_close(got_v, ref_v, **TOL)
    assert ref_g and got_g.keys() == ref_g.keys()
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], **TOL, msg=name)


@pytest.mark.parametrize("model_type,side", SIDES, ids=[f"{t}-{s}" for t, s in SIDES])
def test_packed_forward_and_prompt_gradients_equal_the_padded_ones(model_type, side):
    enc = _encoder(model_type, PACKABLE[model_type], PromptConfig(prompt_length=3, init_std=0.5), padding_side=side)
    batch = enc.tokenize(SENTENCES)
    assert not batch["attention_mask"].bool().all()  # the batch has padding to drop
    _assert_same(enc, batch)


@pytest.mark.parametrize("options", [
    dict(prompt_dropout=0.3),  # per-example prefixes (prompt_index) in training
    dict(input_layer_only=True),  # layers without a prefix: an empty one keeps the sequences apart
    dict(prompt_type="both", input_prompt_length=2),  # soft input tokens inserted into every row
    dict(cls_prompt=True),
    dict(position_mode="shifted"),
    dict(prefix_projection=True, projection_hidden_size=16),
], ids=lambda o: next(iter(o)))
@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_every_prompt_kind_packs_to_the_same_maths(model_type, options):
    enc = _encoder(model_type, dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                   PromptConfig(prompt_length=3, init_std=0.5, **options), pooler="cls")
    enc.train()  # prompt dropout draws in training; the backbone's dropout is 0, so both sides draw the same
    batch = enc.tokenize(SENTENCES)
    torch.manual_seed(3)
    ref = _run(enc, batch, False)
    torch.manual_seed(3)
    got = _run(enc, batch, True)
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b, **TOL)
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], **TOL, msg=name)


def test_a_template_and_its_mask_pooler_pack_to_the_same_maths():
    enc = _encoder("bert", {}, PromptConfig(prompt_length=3, init_std=0.5), pooler="mask",
                   template='This sentence : "[X]" means [MASK] .')
    _assert_same(enc, enc.tokenize(SENTENCES))


def test_attention_dropout_draws_the_masks_of_the_padded_batch():
    """Training with attention dropout (the backbone's hidden dropout off): a packed batch drops what the same
    rows right-padded drop (the op's contract), so with the same seed the two sides agree exactly as without
    dropout; float32 on the fused C++ kernel, rtol from its per-op rounding (~1e-6 through 2 layers)."""
    enc = _encoder("bert", dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.3),
                   PromptConfig(prompt_length=3, init_std=0.5), dtype=torch.float32, attn_backend="cpu").train()
    batch = enc.tokenize(SENTENCES)
    torch.manual_seed(5)
    ref = _run(enc, batch, False)
    torch.manual_seed(5)
    got = _run(enc, batch, True)
    torch.manual_seed(6)
    other = _run(enc, batch, True)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2]["prompt.prefix"], ref[2]["prompt.prefix"], rtol=1e-4, atol=1e-6)
    assert (other[1] - ref[1]).abs().max() > 1e-3  # another seed draws other masks: the equality is not vacuous


def test_a_batch_without_padding_runs_unpacked():
    enc = _encoder("bert", {}, PromptConfig(prompt_length=3)).pack_sequences()
    batch = enc.tokenize(["a man plays", "the dog runs"])
    assert batch["attention_mask"].bool().all()
    calls = []
    enc.architecture.forward_packed = lambda *a, **k: calls.append(1)
    enc.hidden_states(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    assert not calls


def test_negative_control_the_packed_row_without_offsets_mixes_the_sequences(monkeypatch):
    """Were the offsets lost (one long sequence), the outputs would move by far more than TOL."""
    enc = _encoder("bert", {}, PromptConfig(prompt_length=3, init_std=0.5))
    batch = enc.tokenize(SENTENCES)
    ref = _run(enc, batch, False)[0]
    from fastprompt.model import attention

    real = attention.PrefixState.__init__

    def without_offsets(self, *args, cu_seqlens=None, max_seqlen=None, **kwargs):
        real(self, *args, **kwargs)

    monkeypatch.setattr(attention.PrefixState, "__init__", without_offsets)
    got = _run(enc, batch, True)[0]
    assert (got - ref).abs().max() > 1e-3


def test_architectures_that_cannot_pack_are_refused_before_any_work():
    enc = _encoder("deberta-v2", BYPASSING["deberta-v2"], None)
    with pytest.raises(ValueError, match="packed sequences are not available.*not among"):
        enc.pack_sequences()
    assert enc.packed is False


def test_the_cache_reference_path_cannot_pack():
    enc = _encoder("bert", {}, PromptConfig(prompt_length=3), prefix_mode="cache")
    with pytest.raises(ValueError, match="prefix_mode='cache'"):
        enc.pack_sequences()
    enc.pack_sequences(False)  # turning it off is always possible


def _pooled(enc, batch, packed, **kwargs):
    enc.zero_grad(set_to_none=True)
    enc.pack_sequences(packed)
    vec = enc(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"), **kwargs)
    (vec * torch.linspace(-1, 1, vec.numel(), dtype=vec.dtype).view_as(vec)).sum().backward()
    return vec.detach(), {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pooler,template", [("cls", None), ("cls_before_pooler", None),
                                             ("mask", 'This sentence : "[X]" means [MASK] .')])
@pytest.mark.parametrize("model_type", ROWS_ONLY)
def test_the_last_layer_computes_the_pooled_rows_only_with_the_same_maths(model_type, pooler, template):
    """BERT-style last layers compute only the row the pooler reads (fastprompt/model/pooled_rows.py): the
    sentence vectors and prompt gradients are the padded forward's, and the last hidden states hold nothing else."""
    enc = _encoder(model_type, ENCODERS[model_type], PromptConfig(prompt_length=3, init_std=0.5), pooler=pooler,
                   template=template)
    assert enc.architecture.pooled_rows_only
    batch = enc.tokenize(SENTENCES)
    ref_v, ref_g = _pooled(enc, batch, False)
    got_v, got_g = _pooled(enc, batch, True)
    torch.testing.assert_close(got_v, ref_v, **TOL)
    assert got_g.keys() == ref_g.keys() and "prompt.prefix" in got_g
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], **TOL, msg=name)
    pooled = enc._pooled_positions(batch["input_ids"], batch["attention_mask"])
    hidden = enc.hidden_states(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"), pooled=pooled)
    assert int((hidden.abs().sum(-1) > 0).sum()) == len(SENTENCES)  # one computed row per sentence


def test_pooled_rows_under_prompt_dropout_and_without_a_prefix_on_the_last_layer():
    for options in (dict(prompt_dropout=0.3), dict(input_layer_only=True)):
        enc = _encoder("bert", dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                       PromptConfig(prompt_length=3, init_std=0.5, **options), pooler="cls").train()
        batch = enc.tokenize(SENTENCES)
        torch.manual_seed(3)
        ref_v, ref_g = _pooled(enc, batch, False)
        torch.manual_seed(3)
        got_v, got_g = _pooled(enc, batch, True)
        torch.testing.assert_close(got_v, ref_v, **TOL)
        for name in ref_g:
            torch.testing.assert_close(got_g[name], ref_g[name], **TOL, msg=name)


@pytest.mark.parametrize("model_type", [t for t in PACKABLE if t not in ROWS_ONLY])
def test_other_last_layers_run_whole_in_a_packed_batch(model_type):
    enc = _encoder(model_type, PACKABLE[model_type], PromptConfig(prompt_length=3, init_std=0.5), pooler="last"
                   if model_type in DECODERS else "cls")
    assert not enc.architecture.pooled_rows_only
    batch = enc.tokenize(SENTENCES)
    torch.testing.assert_close(_pooled(enc, batch, True)[0], _pooled(enc, batch, False)[0], **TOL)


def test_the_library_packs_exactly_the_architectures_tested_here():
    from fastprompt.model.arch import packable_model_types

    assert sorted(packable_model_types()) == sorted(PACKABLE)


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_gradient_checkpointing_recomputes_the_packed_layers(model_type):
    """Non-reentrant checkpointing replays each layer in backward with the same packed state (the offsets, the
    pooled rows of the last layer): the same vectors and prompt gradients as the padded forward without it."""
    extra = dict(PACKABLE[model_type], **({} if model_type in DECODERS else dict(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))
    enc = _encoder(model_type, extra, PromptConfig(prompt_length=3, init_std=0.5),
                   pooler="last" if model_type in DECODERS else "cls").train()  # checkpointing acts in training
    batch = enc.tokenize(SENTENCES)
    ref_v, ref_g = _pooled(enc, batch, False)
    enc.gradient_checkpointing_enable()
    assert enc.is_gradient_checkpointing
    got_v, got_g = _pooled(enc, batch, True)
    torch.testing.assert_close(got_v, ref_v, **TOL)
    torch.testing.assert_close(got_g["prompt.prefix"], ref_g["prompt.prefix"], **TOL)
