"""Every architecture fastprompt supports, on tiny random configs built here (no downloads), against references
written apart from the code under test; and the guard that stops a model whose attention bypasses the prefix.

The reference (:func:`_concat_attention`) is a second transformers attention function, registered under its own
name: it concatenates the layer's prefix in front of the keys/values the model hands over (repeating them over the
query heads of each group, as transformers' ``repeat_kv``), takes the token block's mask from the mask transformers
itself built for the model (causal, sliding window, padding: ``sdpa_mask``), adds P always-visible prefix columns,
and runs an explicit softmax. Nothing of ``fastprompt.ops`` runs in it. Everything is float64, so the only
differences are summation order: ~1e-15 relative per op, carried through 2 layers (LayerNorm/RMSNorm-normalised);
1e-10 leaves five orders of magnitude, while a prefix in the wrong slot, a missing causal mask or a prefix hidden
from some tokens changes outputs by ~1e-1.

The no-prompt comparison is against ``AutoModel`` with its default attention (SDPA; eager for MPNet and
DeBERTa-v2) and the same pooling written here. The tests take ~35 s on 2 shared cores (the two Triton-interpreter
cases ~20 s of it).
"""
import copy

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModel, BertTokenizerFast
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.model.attention import register_attention

TOL = dict(rtol=1e-10, atol=1e-10)
REF = "fastprompt_test_concat"
WORDS = "the a man dog plays runs guitar park sits table big small red it is and two people".split()
SENTENCES = ["a man plays the guitar", "the dog", "two people sit at a big table in the park", "it"]
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64)
#: model_type -> config keywords beyond COMMON. Decoders: grouped-query (2 key/value heads for 4 query heads) or
#: multi-query (1), sliding windows shorter than the batch's rows.
ENCODERS = {
    "bert": dict(),
    "roberta": dict(),
    "xlm-roberta": dict(),
    "electra": dict(embedding_size=16),
    "distilbert": dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64),
    # RoPE; layer 0 global, layer 1 local (a bidirectional sliding window of 2 + 1 + 2 tokens)
    "modernbert": dict(bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3, global_attn_every_n_layers=2,
                       local_attention=4),
}
DECODERS = {
    "llama": dict(num_key_value_heads=2),
    "mistral": dict(num_key_value_heads=2, sliding_window=3),
    "qwen2": dict(num_key_value_heads=2),
    "qwen3": dict(num_key_value_heads=2, head_dim=8),
    "gemma": dict(num_key_value_heads=1, head_dim=8),
    "gemma2": dict(num_key_value_heads=2, head_dim=8, sliding_window=3, attn_logit_softcapping=None,
                   final_logit_softcapping=None),
    "gemma3_text": dict(num_key_value_heads=2, head_dim=8, sliding_window=3,
                        layer_types=["sliding_attention", "full_attention"]),
}
#: the architectures whose attention does not go through transformers' attention functions: MPNet's gets the
#: prefix through fastprompt's adapter of its attention module; DeBERTa-v2's is refused
BYPASSING = {"mpnet": dict(), "deberta-v2": dict()}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


#: MPNet's embeddings take 1 as the padding index whatever the config says (the real MPNet's [PAD] id), and number
#: positions by the tokens that are not it: its tiny tokenizer puts [PAD] there
PAD_ID = {"mpnet": 1}


def _tokenizer(padding_side="right", model_type=None):
    special = ["[PAD]", "[UNK]"] if PAD_ID.get(model_type, 0) == 0 else ["[UNK]", "[PAD]"]
    vocab = [*special, "[CLS]", "[SEP]", "[MASK]", *WORDS]
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    tok.padding_side = padding_side
    return tok


def _backbone(model_type, extra, seed=0, dtype=torch.float64):
    tok = _tokenizer(model_type=model_type)
    config = AutoConfig.for_model(model_type, **COMMON, **extra, vocab_size=len(tok),
                                  pad_token_id=PAD_ID.get(model_type, 0))
    torch.manual_seed(seed)
    return AutoModel.from_config(config, attn_implementation=register_attention(), dtype=dtype).eval()


def _encoder(model_type, extra, prompt_config=None, padding_side="right", pooler=None, dtype=torch.float64,
             **kwargs):
    backbone = _backbone(model_type, extra, dtype=dtype)
    causal = model_type in DECODERS
    pooler = pooler or ("last" if causal else "mean")
    torch.manual_seed(1)
    enc = PromptEncoder(backbone, _tokenizer(padding_side, model_type), prompt_config, pooler=pooler,
                        **kwargs).to(dtype)
    return enc.eval()


# ------------------------------------------------------------------ the explicit-concatenation reference

def _layer_modules(backbone):
    layers = next(m for m in backbone.modules() if isinstance(m, torch.nn.ModuleList))
    return {id(m): i for i, block in enumerate(layers) for m in block.modules()}


def _concat_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, fastprompt_state=None,
                      **kwargs):
    state = fastprompt_state
    layer = _REF_LAYERS[id(module)]
    state.served.add(layer)
    B, H, S, D = query.shape
    if attention_mask is None:  # transformers leaves a plain causal (or no) mask to SDPA's is_causal
        visible = torch.ones(S, S, dtype=torch.bool)
        if getattr(module, "is_causal", False):
            visible = visible.tril()
        visible = visible.expand(B, 1, S, S)
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask.expand(B, 1, S, S)
    else:
        visible = (attention_mask == 0).expand(B, 1, S, S)
    keys, values = key, value
    entry = state.layers[layer]
    if entry is not None:
        pk, pv = (t if t.dim() == 4 else t.expand(B, -1, -1, -1) for t in entry)
        keys, values = torch.cat([pk, key], 2), torch.cat([pv, value], 2)
        visible = torch.cat([visible.new_ones(B, 1, S, pk.shape[2]), visible], -1)
    group = H // key.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = (query @ keys.transpose(-1, -2)) * (D ** -0.5 if scaling is None else scaling)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    # a row that sees nothing (a padding row of a model run without its prefix) outputs zeros, not NaN
    probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)
    return (probs @ values).transpose(1, 2), None


_REF_LAYERS: dict = {}
AttentionInterface.register(REF, _concat_attention)
AttentionMaskInterface.register(REF, sdpa_mask)


def _run(encoder, batch, weights, attn=None):
    """Last hidden states (real tokens only) and prompt gradients of a random read-out; with ``attn``, the backbone
    runs that attention implementation instead of fastprompt's."""
    backbone = encoder.backbone
    saved = backbone.config._attn_implementation
    if attn is not None:
        _REF_LAYERS.clear()
        _REF_LAYERS.update(_layer_modules(backbone))
        backbone.config._attn_implementation = attn
    try:
        encoder.zero_grad(set_to_none=True)
        hidden = encoder.hidden_states(batch["input_ids"], batch["attention_mask"])
        hidden = hidden * batch["attention_mask"][..., None]
        if hidden.requires_grad:
            (hidden * weights).sum().backward()
    finally:
        backbone.config._attn_implementation = saved
    return hidden.detach(), {n: p.grad.clone() for n, p in encoder.named_parameters() if p.grad is not None}


def _check_against_concatenation(encoder, backend):
    encoder.attn_backend = backend
    batch = {k: v for k, v in encoder.tokenize(SENTENCES).items() if k != "token_type_ids"}
    assert (batch["attention_mask"] == 0).any(), "the batch must contain padding"
    weights = torch.randn(*batch["input_ids"].shape, encoder.hidden_size, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(3))
    out, grads = _run(encoder, batch, weights)
    ref_out, ref_grads = _run(encoder, batch, weights, attn=REF)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert grads.keys() == ref_grads.keys() and any("prompt" in k for k in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=name)
    # the prefix matters: without it the outputs move by far more than the tolerance
    saved, encoder.prompt = encoder.prompt, None
    try:
        plain, _ = _run(encoder, batch, weights, attn=REF)
    finally:
        encoder.prompt = saved
    assert (plain - ref_out).abs().max() > 1e-3


ARCHS = {**ENCODERS, **DECODERS}


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("model_type", list(ARCHS))
def test_prefix_matches_explicit_concatenation(model_type, backend):
    config = PromptConfig(prompt_length=3, init_std=0.5)
    _check_against_concatenation(_encoder(model_type, ARCHS[model_type], config), backend)


@pytest.mark.parametrize("model_type", list(DECODERS))
def test_decoder_left_padding_matches_explicit_concatenation(model_type):
    config = PromptConfig(prompt_length=2, init_std=0.5, prefix_projection=True, projection_hidden_size=8)
    _check_against_concatenation(_encoder(model_type, DECODERS[model_type], config, padding_side="left"), "cpu")


#: PEFT's prefix tuning runs on these (DistilBERT: it fails with a size mismatch, DistilBERT takes no cache). Not
#: on the sliding-window configs: PEFT's cache puts the prefix at positions 0..P-1, so a sliding window hides it
#: from every token more than a window past it; fastprompt keeps it visible to every token (P-tuning v2).
PEFT_DECODERS = ["llama", "qwen2", "qwen3", "gemma"]


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("model_type", PEFT_DECODERS)
def test_decoder_prefix_matches_peft_prefix_tuning(model_type, padding_side):
    """float32, fused C++ kernel against PEFT's DynamicCache of the batch-expanded prefix and stock SDPA. PEFT runs
    the tokens after a cache of P positions, at positions P..P+S-1: position_mode "shifted" does the same (RoPE
    rotates the queries by their position, and the prefix keys are used unrotated, so the shift matters between
    a query and the prefix). Agreement up to float32 rounding: a few ulps of values of order 1 through 2 layers,
    and summation order in the prefix gradients; 1e-5 as in tests/integrations/test_peft_attention.py."""
    peft = pytest.importorskip("peft")
    config = PromptConfig(prompt_length=3, position_mode="shifted")
    encoder = _encoder(model_type, DECODERS[model_type], config, padding_side=padding_side, dtype=torch.float32)
    stock = copy.deepcopy(encoder.backbone)
    stock.config._attn_implementation = "sdpa"
    config = peft.PrefixTuningConfig(task_type=peft.TaskType.FEATURE_EXTRACTION, num_virtual_tokens=3)
    torch.manual_seed(0)
    theirs = peft.get_peft_model(stock, config).eval()
    rows = theirs.prompt_encoder["default"].embedding.weight  # (P, layers * 2 * kv_heads * head_dim)
    L, H, D = encoder.num_layers, encoder.num_heads, encoder.head_dim
    with torch.no_grad():
        rows.mul_(0.5)
        encoder.prompt.load_prefix_(rows.view(3, L, 2, H, D).permute(1, 2, 3, 0, 4))
    batch = {k: v for k, v in encoder.tokenize(SENTENCES).items() if k != "token_type_ids"}
    mask = batch["attention_mask"][..., None]
    weights = torch.randn(*batch["input_ids"].shape, encoder.hidden_size, generator=torch.Generator().manual_seed(3))
    encoder.attn_backend = "cpu"
    ours = encoder.hidden_states(batch["input_ids"], batch["attention_mask"]) * mask
    (ours * weights).sum().backward()
    peft_out = theirs(**batch).last_hidden_state * mask
    (peft_out * weights).sum().backward()
    torch.testing.assert_close(ours, peft_out, rtol=1e-5, atol=1e-5)
    grad = rows.grad.view(3, L, 2, H, D).permute(1, 2, 3, 0, 4)
    torch.testing.assert_close(encoder.prompt.prefix.grad, grad, rtol=1e-5, atol=1e-5)


def _pool(hidden, mask, pooler):
    if pooler == "mean":
        m = mask[..., None].to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1)
    if pooler == "last":  # written for each padding side apart
        if bool(mask[:, -1].all()):  # left padding (or none): the last column
            return hidden[:, -1]
        return hidden[torch.arange(len(hidden)), mask.sum(1) - 1]
    return hidden[:, 0]


@pytest.mark.parametrize("model_type,padding_side", [(m, "right") for m in [*ENCODERS, *BYPASSING]]
                         + [(m, side) for m in DECODERS for side in ("right", "left")])
def test_no_prompt_encoding_equals_automodel_and_pooling(model_type, padding_side):
    """The frozen model as AutoModel runs it (its default attention: SDPA, or eager for MPNet and DeBERTa-v2)."""
    encoder = _encoder(model_type, {**ARCHS, **BYPASSING}[model_type], padding_side=padding_side)
    # a copy: from_config writes the attention implementation into the config it is given
    stock = AutoModel.from_config(copy.deepcopy(encoder.backbone.config), dtype=torch.float64).eval()
    stock.load_state_dict(encoder.backbone.state_dict())
    batch = {k: v for k, v in encoder.tokenize(SENTENCES).items() if k != "token_type_ids"}
    pooler = encoder.pooler.pooler
    with torch.no_grad():
        ours = encoder(batch["input_ids"], batch["attention_mask"])
        theirs = _pool(stock(**batch).last_hidden_state, batch["attention_mask"], pooler)
    torch.testing.assert_close(ours, theirs, **TOL)


def _mpnet_concat_forward(encoder, layer_of, module, hidden_states, attention_mask=None, position_bias=None,
                          output_attentions=False, **kwargs):
    """MPNet's eager self-attention (transformers' code) over the explicit concatenation [prefix ; tokens]: the
    relative position bias and the additive padding mask on the token columns, nothing on the prefix columns."""
    layer = layer_of[id(module)]
    encoder.architecture.own_attention.state.served.add(layer)  # the guard counts the layers served
    pk, pv = encoder.prompt.layer_prefixes()[layer]
    B, S, _ = hidden_states.shape
    q, k, v = (lin(hidden_states).view(B, S, -1, module.attention_head_size).transpose(1, 2)
               for lin in (module.q, module.k, module.v))
    P = pk.shape[1]
    k, v = torch.cat([pk.expand(B, -1, -1, -1), k], 2), torch.cat([pv.expand(B, -1, -1, -1), v], 2)
    scores = q @ k.transpose(-1, -2) / module.attention_head_size ** 0.5
    token_bias = position_bias.expand(B, -1, -1, -1) + (0 if attention_mask is None else attention_mask)
    scores = scores + torch.cat([token_bias.new_zeros(B, token_bias.shape[1], S, P), token_bias], -1)
    out = scores.softmax(-1) @ v
    return (module.o(out.transpose(1, 2).reshape(B, S, -1)),)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_mpnet_prefix_matches_explicit_concatenation(backend):
    import functools

    encoder = _encoder("mpnet", {}, PromptConfig(prompt_length=3, init_std=0.5), attn_backend=backend)
    batch = encoder.tokenize(SENTENCES)
    weights = torch.randn(*batch["input_ids"].shape, encoder.hidden_size, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(3))
    out, grads = _run(encoder, batch, weights)
    modules = [m for m in encoder.backbone.modules() if type(m).__name__ == "MPNetSelfAttention"]
    adapters = [m.forward for m in modules]
    layer_of = {id(m): i for i, m in enumerate(modules)}
    for m in modules:
        m.forward = functools.partial(_mpnet_concat_forward, encoder, layer_of, m)
    try:
        ref_out, ref_grads = _run(encoder, batch, weights)
    finally:
        for m, f in zip(modules, adapters):
            m.forward = f
    torch.testing.assert_close(out, ref_out, **TOL)
    assert grads.keys() == ref_grads.keys() and "prompt.prefix" in grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=name)
    # the backbone called on its own runs without the prefix (the adapter holds no state between forwards)
    plain = encoder.backbone(**batch).last_hidden_state * batch["attention_mask"][..., None]
    assert (plain - out).abs().max() > 1e-3


# ------------------------------------------------------------------ the guard


REFUSED = ["deberta-v2"]


@pytest.mark.parametrize("model_type", REFUSED)
def test_a_prefix_the_attention_bypasses_is_an_error(model_type):
    """DeBERTa-v2 computes attention in its own modules: the prefix would change nothing."""
    encoder = _encoder(model_type, BYPASSING[model_type], PromptConfig(prompt_length=2))
    batch = encoder.tokenize(SENTENCES)
    with pytest.raises(RuntimeError, match=r"never reached the attention of .*layers 0-1 hold a prefix.*not supported"):
        encoder.hidden_states(batch["input_ids"], batch["attention_mask"])
    with pytest.raises(RuntimeError, match="never reached the attention"):
        _encoder(model_type, BYPASSING[model_type], PromptConfig(prompt_length=2, init="vocab"))


def test_a_layer_the_function_skips_is_an_error():
    """A model whose attention runs the function on some layers only: layer 1 gets its own config copy that asks
    for stock SDPA."""
    encoder = _encoder("distilbert", ENCODERS["distilbert"], PromptConfig(prompt_length=2))
    attn = encoder.backbone.transformer.layer[1].attention
    attn.config = copy.copy(attn.config)
    attn.config._attn_implementation = "sdpa"
    batch = encoder.tokenize(SENTENCES)
    with pytest.raises(RuntimeError, match="DistilBertModel .*layers 1 hold a prefix"):
        encoder.hidden_states(batch["input_ids"], batch["attention_mask"])


def test_input_prompts_still_reach_a_bypassing_model():
    """Soft input tokens go through the embeddings, which every model reads: they work on MPNet."""
    encoder = _encoder("mpnet", {}, PromptConfig(prompt_type="input", input_prompt_length=2, init_std=0.5))
    batch = encoder.tokenize(SENTENCES)
    before = encoder(batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        encoder.input_prompt.embedding.mul_(3)
    # a tiny random model mixes tokens weakly (~1e-4 here); bypassed, the change would be exactly 0
    assert (encoder(batch["input_ids"], batch["attention_mask"]) - before).abs().max() > 1e-6


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta", "mpnet", "bert", "distilbert", "modernbert"])
def test_position_ids_are_numbered_as_the_model_numbers_them(model_type):
    """RoBERTa's embeddings number positions from padding_idx + 1 with a method, MPNet's with a function of their
    module: fastprompt's explicit ids (packed batches, soft input tokens, a [CLS] prompt, shifted prompts) must be
    theirs, on both. The models that count from 0 have no offset."""
    import sys

    from fastprompt.model.arch.positions import max_input_length, offset_position_ids, padding_offset

    encoder = _encoder(model_type, {**ENCODERS, **BYPASSING}[model_type])
    model = encoder.backbone
    batch = encoder.tokenize(SENTENCES)
    ids = batch["input_ids"]
    if model_type in ("bert", "distilbert", "modernbert"):
        assert padding_offset(model) is None
        return
    pad = padding_offset(model)
    emb = model.embeddings
    assert pad == emb.padding_idx == encoder.tokenizer.pad_token_id == PAD_ID.get(model_type, 0)
    assert max_input_length(model) == model.config.max_position_embeddings - pad - 1
    own = getattr(emb, "create_position_ids_from_input_ids", None)
    for shift in (0, 3):
        if own is None:  # MPNet: a function of the module, without a shift
            if shift:
                continue
            want = sys.modules[type(emb).__module__].create_position_ids_from_input_ids(ids, pad)
        else:
            want = own(ids, pad, shift)
        assert torch.equal(offset_position_ids(ids, pad, shift), want)
        assert torch.equal(encoder.architecture.position_ids(ids, batch["attention_mask"], shift=shift,
                                                             explicit=True), want)


def test_mpnet_with_zero_soft_input_tokens_is_the_plain_model():
    """Soft input tokens make fastprompt pass explicit position ids; with none inserted, MPNet's hidden states
    must be those it computes on its own (they were not, when MPNet's positions started at 0 instead of 2)."""
    plain = _encoder("mpnet", {})
    soft = _encoder("mpnet", {}, PromptConfig(prompt_type="input", input_prompt_length=0))
    batch = plain.tokenize(SENTENCES)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        a = plain.hidden_states(batch["input_ids"], batch["attention_mask"])
        b = soft.hidden_states(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(b[real], a[real], **TOL)


def test_decoder_refuses_first_token_pooling_and_a_cls_prompt_it_cannot_place():
    with pytest.raises(ValueError, match="pooler 'cls' reads the first token.*use pooler 'last'"):
        _encoder("llama", DECODERS["llama"], pooler="cls")
    with pytest.raises(ValueError, match="under left padding is a padding token"):
        _encoder("llama", DECODERS["llama"], PromptConfig(prompt_length=2, cls_prompt=True), padding_side="left")


def test_softcapped_attention_is_refused():
    extra = {**DECODERS["gemma2"], "attn_logit_softcapping": 50.0}
    encoder = _encoder("gemma2", extra, PromptConfig(prompt_length=2))
    batch = encoder.tokenize(SENTENCES)
    with pytest.raises(NotImplementedError, match="attn_logit_softcapping"):
        encoder.hidden_states(batch["input_ids"], batch["attention_mask"])


# ------------------------------------------------------------------ the docs' table


def _table_rows() -> list[str]:
    """The rows docs/architectures.md must have: what this module tests, and against what (packed batches:
    tests/model/test_packed.py)."""
    from .test_packed import PACKABLE, ROWS_ONLY

    rows = []
    for model_type in [*ENCODERS, "mpnet", *DECODERS, *REFUSED]:
        status = "refused" if model_type in REFUSED else "supported"
        if model_type == "gemma2":  # test_softcapped_attention_is_refused
            status += " without score soft-capping"
        pooling = "last, mean" if model_type in DECODERS else "cls, mean, mask, ..."
        compared = [] if model_type in REFUSED else ["explicit concatenation"]
        compared.append("AutoModel")
        if model_type == "mpnet":
            compared.append("sentence-transformers (real weights)")  # tests/model/test_mpnet_real.py
        if model_type in PEFT_DECODERS:
            compared.append("PEFT")
        packed = "yes, last layer for the pooled rows only" if model_type in ROWS_ONLY else \
            "yes" if model_type in PACKABLE else "no"
        rows.append(f"| {model_type} | {status} | {pooling} | {packed} | {', '.join(compared)} |")
    return rows


def test_docs_table_lists_what_the_tests_cover():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "architectures.md").read_text(encoding="utf-8")
    table = text.split("<!-- architectures-table")[1].split("<!-- /architectures-table -->")[0]
    documented = [line for line in table.splitlines() if line.startswith("| ") and "model_type" not in line]
    expected = _table_rows()
    assert documented == expected, "docs/architectures.md's table should read:\n" + "\n".join(expected)
    # ... and the families' specs (fastprompt/model/arch/) say the same, in the same order
    from fastprompt.model.arch import FAMILIES

    assert [f.docs_row() for f in FAMILIES.values()] == expected


def test_cache_reference_path_refuses_what_it_cannot_compute():
    """prefix_mode='cache' (PEFT's DynamicCache): DistilBERT takes no cache; under a sliding window shorter than
    prefix + tokens the cache would hide the prefix from distant tokens, unlike the attention path. Where neither
    applies it equals the attention path."""
    config = PromptConfig(prompt_length=3, init_std=0.5)
    batch = _encoder("llama", DECODERS["llama"]).tokenize(SENTENCES)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with pytest.raises(ValueError, match="DistilBertModel .*does not take"):
        _encoder("distilbert", ENCODERS["distilbert"], config, prefix_mode="cache").hidden_states(ids, mask)
    with pytest.raises(ValueError, match=r"sliding window \(3\)"):
        _encoder("mistral", DECODERS["mistral"], config, prefix_mode="cache").hidden_states(ids, mask)
    fast = _encoder("llama", DECODERS["llama"], config)
    ref = _encoder("llama", DECODERS["llama"], config, prefix_mode="cache")
    ref.load_state_dict(fast.state_dict())
    m = mask[..., None]
    torch.testing.assert_close(fast.hidden_states(ids, mask) * m, ref.hidden_states(ids, mask) * m, **TOL)


def test_a_tokenizer_without_padding_token_pads_with_eos():
    """Llama/Mistral tokenizers have no padding token: the encoder pads with EOS (masked either way)."""
    tok = _tokenizer("left")
    tok.eos_token, tok.pad_token = "[SEP]", None
    backbone = _backbone("llama", DECODERS["llama"])
    encoder = PromptEncoder(backbone, tok, PromptConfig(prompt_length=2), pooler="last").double().eval()
    assert tok.pad_token == "[SEP]"
    assert encoder.encode(SENTENCES).shape == (len(SENTENCES), 32)


def test_vocab_init_on_mpnet_reads_its_own_keys_and_values():
    """init='vocab' reads the keys/values the attention sees: the MPNet adapter captures them on every layer (the
    encoder raises the guard's error for a layer it did not capture)."""
    encoder = _encoder("mpnet", {}, PromptConfig(prompt_length=2, init="vocab"))
    assert encoder.prompt.prefix.abs().sum() > 0
    batch = encoder.tokenize(SENTENCES)
    assert torch.isfinite(encoder(batch["input_ids"], batch["attention_mask"])).all()



@pytest.mark.parametrize("model_type", ["mistral", "modernbert"])
def test_triton_backend_matches_the_cpu_kernel(model_type):
    """The GPU path's kernels (here in the Triton interpreter) through the model: grouped-query heads, causal and
    sliding-window blocks (Mistral), a bidirectional window (ModernBERT). float32: both online-softmax kernels
    round differently by a few ulps per output (values of order 1) through 2 layers, and the prefix gradients sum
    B * S such terms in different orders: 1e-5, as tests/integrations/test_peft_attention.py."""
    pytest.importorskip("triton")
    extra = {**ENCODERS, **DECODERS}[model_type]
    config = PromptConfig(prompt_length=3, init_std=0.5)
    encoder = _encoder(model_type, extra, config, dtype=torch.float32)
    batch = {k: v for k, v in encoder.tokenize(SENTENCES).items() if k != "token_type_ids"}
    weights = torch.randn(*batch["input_ids"].shape, encoder.hidden_size, generator=torch.Generator().manual_seed(3))
    results = []
    for backend in ("cpu", "triton"):
        encoder.attn_backend = backend
        results.append(_run(encoder, batch, weights))
    (out, grads), (tri_out, tri_grads) = results
    torch.testing.assert_close(tri_out, out, rtol=1e-5, atol=1e-5)
    assert grads.keys() == tri_grads.keys() and "prompt.prefix" in grads
    for name in grads:
        torch.testing.assert_close(tri_grads[name], grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_decoder_from_a_model_folder_trains_saves_and_loads(tiny_llama_dir, tmp_path):
    """A saved Llama (a causal-LM checkpoint, grouped-query) through from_pretrained, a prompt step, save and load:
    the checkpoint's prefix has the key/value heads, and the loaded prompt encodes the same."""
    config = PromptConfig(prompt_length=2, init_std=0.5)
    encoder = PromptEncoder.from_pretrained(tiny_llama_dir, pooler="last", prompt_config=config)
    assert encoder.prompt.prefix.shape[2] == encoder.backbone.config.num_key_value_heads
    batch = encoder.tokenize(["the cat sat on the mat", "a dog ran"])
    encoder.train()
    encoder(batch["input_ids"], batch["attention_mask"]).sum().backward()
    assert encoder.prompt.prefix.grad.abs().sum() > 0
    encoder.save(tmp_path / "ckpt")
    loaded = PromptEncoder.load(tmp_path / "ckpt", base_model=tiny_llama_dir)
    torch.testing.assert_close(loaded.encode(["the cat sat"]), encoder.encode(["the cat sat"]), rtol=0, atol=0)


# ------------------------------------------------------------------ an appended EOS (decoder embedders)

EOS_SENTENCES = ["the cat sat on the mat", "a dog", "it was the dog </s>", "the cat sat on the mat in the park"]
INSTRUCTION = "what you know about [X]"  # an instruction format: nothing after the text, so the EOS follows it


def _eos_rows(encoder, sentences, **kwargs):
    """(real token ids of each row, the batch): the tokenizer of tiny_llama_dir adds no special token at all."""
    batch = encoder.tokenize(sentences, **kwargs)
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    return rows, batch


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("template", [None, INSTRUCTION])
def test_append_eos_ends_every_row_with_one_eos_that_last_token_pooling_reads(tiny_llama_dir, padding_side,
                                                                                template):
    """append_eos: every row ends with the tokenizer's EOS (which this tokenizer never appends itself), once even
    when the text ends with it, on either padding side, with or without an instruction template; pooler 'last'
    returns the EOS token's hidden state."""
    encoder = PromptEncoder.from_pretrained(tiny_llama_dir, pooler="last", template=template, append_eos=True,
                                            prompt_config=PromptConfig(prompt_length=2, init_std=0.5)).eval()
    encoder.tokenizer.padding_side = padding_side
    eos = encoder.tokenizer.eos_token_id
    plain = PromptEncoder.from_pretrained(tiny_llama_dir, pooler="last", template=template)
    plain.tokenizer.padding_side = padding_side
    rows, batch = _eos_rows(encoder, EOS_SENTENCES)
    plain_rows, _ = _eos_rows(plain, EOS_SENTENCES)
    for row, without, text in zip(rows, plain_rows, EOS_SENTENCES):
        assert row[-1] == eos and row[-2] != eos, (text, row)
        # the text's own EOS stands in for the appended one; any other row gets exactly one more token
        assert row == (without if text.endswith("</s>") else [*without, eos])
    assert all(r[-1] != eos for r, t in zip(plain_rows, EOS_SENTENCES) if not t.endswith("</s>"))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if padding_side == "left":
        assert bool((ids[:, -1] == eos).all()) and bool(mask[:, -1].all())
    last = mask.sum(1) - 1 if padding_side == "right" else torch.full((len(rows),), ids.shape[1] - 1)
    assert bool((ids[torch.arange(len(rows)), last] == eos).all())
    with torch.no_grad():
        hidden = encoder.hidden_states(ids, mask)
        pooled = encoder(ids, mask)
    torch.testing.assert_close(pooled, hidden[torch.arange(len(rows)), last], rtol=0, atol=0)


@pytest.mark.parametrize("template", [None, INSTRUCTION])
def test_append_eos_survives_truncation(tiny_llama_dir, template):
    """The text is cut one token earlier so that the EOS always fits: without a template max_length bounds the whole
    sequence; with one it bounds the text's own tokens and the template and the EOS come on top."""
    encoder = PromptEncoder.from_pretrained(tiny_llama_dir, pooler="last", template=template, append_eos=True)
    eos, long = encoder.tokenizer.eos_token_id, EOS_SENTENCES[-1]
    full = encoder.tokenizer(long, add_special_tokens=False)["input_ids"]
    (row,), _ = _eos_rows(encoder, [long], max_length=5)
    if template is None:
        assert row == [*full[:4], eos]
    else:
        overhead = len(encoder.tokenizer("what you know about", add_special_tokens=False)["input_ids"])
        assert row[overhead:] == [*full[:5], eos]
    assert encoder.model_max_tokens() == 256
    (row,), _ = _eos_rows(encoder, [" ".join(["the"] * 300)])
    assert len(row) == 256 and row[-1] == eos


def test_append_eos_round_trips_through_a_checkpoint_the_config_and_the_cli(tiny_llama_dir, tmp_path):
    """Saved in the checkpoint's config, so the loaded prompt encodes the same (an explicit append_eos=False
    overrides it); the training config and `--append-eos` of the model options build such an encoder."""
    import argparse
    import json

    from fastprompt.cli.options import add_model_args, load_encoder
    from fastprompt.train import build
    from fastprompt.train.config import TrainConfig

    config = PromptConfig(prompt_length=2, init_std=0.5)
    encoder = PromptEncoder.from_pretrained(tiny_llama_dir, pooler="last", prompt_config=config,
                                            append_eos=True).eval()
    encoder.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "fastprompt_config.json").read_text())["append_eos"] is True
    loaded = PromptEncoder.load(tmp_path / "ckpt", base_model=tiny_llama_dir)
    assert loaded.append_eos
    torch.testing.assert_close(loaded.encode(EOS_SENTENCES), encoder.encode(EOS_SENTENCES), rtol=0, atol=0)
    off = PromptEncoder.load(tmp_path / "ckpt", base_model=tiny_llama_dir, append_eos=False)
    assert not off.append_eos and abs(off.encode(EOS_SENTENCES) - encoder.encode(EOS_SENTENCES)).max() > 1e-3
    cfg = TrainConfig(model=str(tiny_llama_dir), pooler="last", append_eos=True, prompt_length=2)
    assert build.build_encoder(cfg, None).append_eos and "append_eos" in cfg.to_dict()
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args(["--prompt", str(tmp_path / "ckpt"), "--model", str(tiny_llama_dir)])
    assert load_encoder(args).append_eos  # the checkpoint's
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--pooler", "last", "--append-eos"])
    assert load_encoder(args).append_eos


def test_append_eos_without_an_eos_token_is_an_error():
    """A tokenizer without an EOS token (BERT's WordPiece here) cannot end sequences with one: a clear error when
    the encoder is built, before anything runs."""
    with pytest.raises(ValueError, match="append_eos=True .* has no EOS token"):
        PromptEncoder(_backbone("llama", DECODERS["llama"]), _tokenizer(), pooler="last", append_eos=True)
