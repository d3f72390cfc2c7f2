"""accelerate_peft: a PEFT prefix-tuning model through fastprompt's fused prefix attention gives PEFT's own outputs
and adapter gradients, and PEFT still saves and loads the adapter.

PEFT 0.21's prefix tuning does drive a BERT/RoBERTa encoder in transformers 5.x (``PeftModelForFeatureExtraction``:
a DynamicCache of the batch-expanded prefix, the attention mask prefixed with P ones, the tokens at positions
P..P+S-1, token_type_ids dropped): the reference of every comparison here is PEFT's own forward.

Tolerances (fp32, 1e-5): with backend "cpu" both paths run the same SDPA over the same concatenated keys, so
they agree to the last bit but for the order of the prefix-gradient sums (PEFT sums over the batch-expanded
copies, we over one shared prefix); "reference" (explicit softmax) and "triton" (online softmax in the
interpreter) round differently: per attention output a few ulps of values of order 1, carried through two
layers (LayerNorm-normalised, so no growth), observed <= 4e-7 in outputs and gradients, well inside 1e-5. A
wrong prefix slot, position shift or mask changes outputs by ~1e-1.
"""
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")
from transformers import AutoModel, AutoTokenizer  # noqa: E402

from fastprompt.integrations.peft_attention import accelerate_peft, peft_prefix, restore_peft  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
SENTENCES = ["a man plays the guitar .", "the dog", "two people sit at a table in the park", "it"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _peft_model(path, prompt_length=3, projection=False, seed=0):
    torch.manual_seed(seed)
    config = peft.PrefixTuningConfig(task_type=peft.TaskType.FEATURE_EXTRACTION, num_virtual_tokens=prompt_length,
                                     prefix_projection=projection, encoder_hidden_size=24)
    model = peft.get_peft_model(AutoModel.from_pretrained(path), config)
    # a prefix of the size of real keys/values (PEFT's N(0, 1) init is far larger than what trains), so that
    # the comparisons exercise softmax weights spread over prefix and tokens
    with torch.no_grad():
        for p in model.prompt_encoder.parameters():
            p.mul_(0.5)
    return model.eval()


def _batch(path):
    return dict(AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, return_tensors="pt"))


def _run(model, inputs, seed=1):
    """Outputs and adapter gradients of a random linear read-out of the last hidden states."""
    model.zero_grad()
    out = model(**inputs).last_hidden_state
    w = torch.randn(out.shape[-1], generator=torch.Generator().manual_seed(seed))
    (out @ w).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], **TOL)
    assert a[1].keys() == b[1].keys() and a[1]
    for k in a[1]:
        torch.testing.assert_close(a[1][k], b[1][k], **TOL, msg=k)


def _token_inputs(inputs):
    return {k: v for k, v in inputs.items() if k != "token_type_ids"}


@pytest.mark.parametrize("projection", [False, True], ids=["prefix", "projection"])
@pytest.mark.parametrize("prompt_length", [1, 3])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_same_outputs_and_adapter_gradients_as_peft(tiny_model_dir, projection, prompt_length, backend):
    _check_against_peft(tiny_model_dir, projection, prompt_length, backend)


def test_same_outputs_and_adapter_gradients_as_peft_triton(tiny_model_dir):
    """The Triton kernels (the GPU path; here in the interpreter, ~6 s per case, hence one case per model)."""
    _check_against_peft(tiny_model_dir, False, 3, "triton")


def _check_against_peft(tiny_model_dir, projection, prompt_length, backend):
    model = _peft_model(tiny_model_dir, prompt_length, projection)
    inputs = _token_inputs(_batch(tiny_model_dir))  # with padding: rows of 3 to 10 tokens
    theirs = _run(model, inputs)
    accelerate_peft(model, backend=backend)
    ours = _run(model, inputs)
    _assert_same(ours, theirs)
    with torch.no_grad():
        plain = model.get_base_model()(**inputs).last_hidden_state
    assert (plain - ours[0]).abs().max() > 1e-2  # the prefix is in effect


def test_prefix_view_is_peft_layout_without_batch_expansion(tiny_bert_dir):
    """(layers, 2, heads, P, head_dim) viewing PEFT's rows: key of layer l = slot 2l, value = slot 2l + 1."""
    model = _peft_model(tiny_bert_dir, prompt_length=3)
    prefix = peft_prefix(model)
    cfg = model.active_peft_config
    assert prefix.shape == (cfg.num_layers, 2, cfg.num_attention_heads, 3, cfg.token_dim // cfg.num_attention_heads)
    weight = model.prompt_encoder["default"].embedding.weight
    assert prefix.data_ptr() == weight.data_ptr()  # a view of the parameter: no copy, no batch dimension
    cache = model.get_prompt(batch_size=2)  # PEFT's own per-layer (batch, heads, P, head_dim) tensors
    for layer in range(cfg.num_layers):
        torch.testing.assert_close(cache.layers[layer].keys[1], prefix[layer, 0], rtol=0, atol=0)
        torch.testing.assert_close(cache.layers[layer].values[1], prefix[layer, 1], rtol=0, atol=0)


def test_inputs_embeds_position_ids_and_no_mask(tiny_model_dir):
    """The other ways of calling PEFT's forward: inputs_embeds, explicit position_ids (PEFT adds P), no mask."""
    model = _peft_model(tiny_model_dir, prompt_length=2)
    ids = _batch(tiny_model_dir)["input_ids"][:2, :4]  # unpadded rows
    embeds = model.get_base_model().get_input_embeddings()(ids).detach()
    positions = torch.arange(4).unsqueeze(0).expand(2, -1) + (2 if model.config.model_type == "roberta" else 0)
    calls = [dict(inputs_embeds=embeds), dict(input_ids=ids, position_ids=positions), dict(input_ids=ids)]
    theirs = [_run(model, c) for c in calls]
    accelerate_peft(model)
    for call, expected in zip(calls, theirs):
        _assert_same(_run(model, call), expected)


def test_token_type_ids_dropped_as_peft_does(tiny_bert_dir):
    model = _peft_model(tiny_bert_dir)
    inputs = _batch(tiny_bert_dir)
    inputs["token_type_ids"] = torch.ones_like(inputs["input_ids"])
    with pytest.warns(UserWarning, match="Token type ids"):
        theirs = _run(model, inputs)
    accelerate_peft(model)
    with pytest.warns(UserWarning, match="Token type ids"):
        ours = _run(model, inputs)
    _assert_same(ours, theirs)


def test_adapter_saved_and_loaded_by_peft(tiny_bert_dir, tmp_path):
    """save_pretrained after training steps on the fused path writes the trained adapter: PeftModel.from_pretrained
    gives the trained model's outputs, through PEFT's path and accelerated again."""
    inputs = _token_inputs(_batch(tiny_bert_dir))
    model = accelerate_peft(_peft_model(tiny_bert_dir))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        _run(model, inputs)
        opt.step()
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    restore_peft(model)
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
        # PEFT loads prompt-learning adapters for inference only (inference_mode: the stored rows are read as is)
        loaded = peft.PeftModel.from_pretrained(AutoModel.from_pretrained(tiny_bert_dir), tmp_path / "adapter")
        torch.testing.assert_close(loaded.eval()(**inputs).last_hidden_state, expected, **TOL)
        torch.testing.assert_close(accelerate_peft(loaded)(**inputs).last_hidden_state, expected, **TOL)


def test_exported_from_fastprompt():
    import fastprompt
    import fastprompt.integrations

    assert fastprompt.accelerate_peft is accelerate_peft is fastprompt.integrations.accelerate_peft


def test_restore_and_reaccelerate(tiny_bert_dir):
    model = _peft_model(tiny_bert_dir)
    base = model.get_base_model()
    original = base.config._attn_implementation
    accelerate_peft(model)
    assert base.config._attn_implementation == "fastprompt" and "forward" in model.__dict__
    accelerate_peft(model, backend="reference")  # again: only the backend changes
    assert model._fastprompt_backend == "reference"
    restore_peft(model)
    assert base.config._attn_implementation == original and "forward" not in model.__dict__
    with pytest.raises(ValueError, match="not accelerated"):
        restore_peft(model)


def test_training_mode_applies_attention_dropout(tiny_bert_dir):
    """In training, attention dropout runs (fastprompt's seeded masks): two forwards differ, gradients finite."""
    model = accelerate_peft(_peft_model(tiny_bert_dir)).train()
    inputs = _token_inputs(_batch(tiny_bert_dir))
    a, b = _run(model, inputs), _run(model, inputs)
    assert (a[0] - b[0]).abs().max() > 1e-3
    assert all(torch.isfinite(g).all() for g in a[1].values())


def _disable_dropout(model):
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()  # training mode (checkpointing is active only in training), without randomness


def test_gradient_checkpointing_works_fused_but_not_in_peft(tiny_bert_dir):
    """PEFT's path breaks under gradient checkpointing (transformers drops the cache in checkpointed layers, so
    the P-longer mask no longer fits); the fused path needs no cache and gives the gradients of the plain run."""
    inputs = _token_inputs(_batch(tiny_bert_dir))
    model = _disable_dropout(_peft_model(tiny_bert_dir))
    expected = _run(model, inputs)
    base = model.get_base_model()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(RuntimeError, match="size of tensor"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _run(model, inputs)
    accelerate_peft(model)
    calls = []
    hook = base.encoder.layer[0].attention.self.register_forward_hook(lambda *args: calls.append(1))
    ours = _run(model, inputs)
    hook.remove()
    assert len(calls) == 2  # the attention ran again in backward: checkpointing is on
    _assert_same(ours, expected)


def test_refuses_what_it_does_not_support(tiny_bert_dir):
    base = AutoModel.from_pretrained(tiny_bert_dir)
    with pytest.raises(ValueError, match="PeftModelForFeatureExtraction"):
        accelerate_peft(base)
    lora = peft.get_peft_model(AutoModel.from_pretrained(tiny_bert_dir), peft.LoraConfig(
        task_type=peft.TaskType.FEATURE_EXTRACTION, target_modules=["query"]))
    with pytest.raises(ValueError, match="prefix-tuning"):
        accelerate_peft(lora)
    with pytest.raises(ValueError, match="backend"):
        accelerate_peft(_peft_model(tiny_bert_dir), backend="cuda")
