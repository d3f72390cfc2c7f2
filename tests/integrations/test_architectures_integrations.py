"""The integrations on every architecture docs/architectures.md lists as supported, on the tiny random configs of
tests/model/test_architectures.py (its builders, float32): sentence-transformers export, PEFT's adapter format both
ways, and accelerate_peft; each refusal before any work. docs/integrations.md's per-architecture table is checked
against what this module tests (:func:`test_docs_table_lists_what_the_tests_cover`).

Tolerances (float32, 1e-5 absolute):

- sentence-transformers: both sides run the very same PromptEncoder forward; they differ only in how the sentences are
  batched and ordered (sentence-transformers sorts by its own length key), which can change the fp32 summation order
  of the matmuls: ~1e-7 relative per op on unit vectors through 2 layers. A wrong pooler, a lost prefix or
  normalisation moves components by 1e-2 or more.
- PEFT round trip: the prefix comes back bit for bit and runs through the same code: equal to rounding of the same
  order (the checkpoint reloads the backbone; nothing else differs).
- fastprompt against PEFT's own forward (the exported adapter in PEFT, accelerate_peft against plain PEFT): the same
  softmax over the same keys, summed in other orders (SDPA or eager over [prefix; tokens] against the fused op), a
  few ulps of values of order 1 per layer (RMSNorm/LayerNorm-normalised, so no growth): 1e-5 absolute on the
  outputs (observed <= 7e-7). The adapter gradients are sums over the batch's B*S = 48 token positions (and, through
  the reparameterisation MLP, over its width) of a read-out of every hidden state; the decoders' reach ~1e3 in
  magnitude, so their rounding is relative to the tensor's scale, not to each element: fp32 summation in another
  order errs by at most ~N*eps = 48 * 6e-8 ~ 3e-6 of the summed magnitudes (observed 2e-7 of the tensor's largest
  entry), so each gradient must agree within 1e-5 of its largest entry. A prefix in the wrong slot, an unshifted
  position or a hidden prefix changes outputs by ~1e-1 and gradients by O(1) of their scale.
"""
import json
import logging
import warnings

import numpy as np
import pytest
import torch

peft = pytest.importorskip("peft")
st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")

from transformers import AutoModel  # noqa: E402

from fastprompt import cli  # noqa: E402
from fastprompt.integrations.peft import export_peft, import_peft  # noqa: E402
from fastprompt.integrations.peft_attention import accelerate_peft  # noqa: E402
from fastprompt.integrations.sentence_transformers import export_sentence_transformers  # noqa: E402
from fastprompt.model import PromptConfig, PromptEncoder  # noqa: E402
from fastprompt.model.arch import FAMILIES  # noqa: E402
from tests.integrations.test_peft_attention import _run  # noqa: E402
from tests.model.test_architectures import (  # noqa: E402
    BYPASSING,
    DECODERS,
    ENCODERS,
    SENTENCES,
    _backbone,
    _encoder,
    _tokenizer,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOL = dict(rtol=1e-5, atol=1e-5)
#: every architecture docs/architectures.md lists as supported
ARCHS = {**ENCODERS, "mpnet": BYPASSING["mpnet"], **DECODERS}
#: PEFT's prefix tuning runs these (PEFT_FAILS: not the others), equal to fastprompt's with position_mode "shifted"
#: where no sliding window hides PEFT's prefix: the sliding-window configs get a window longer than prefix + tokens
PEFT_FAILS = {t: f.peft for t, f in FAMILIES.items() if f.peft is not None}
PEFT_RUNS = [m for m in ARCHS if m not in PEFT_FAILS]
WIDE_WINDOW = 64
#: the test configs that attend within a sliding window, where PEFT's prefix tuning differs (export warns)
SLIDING = [m for m in ARCHS if ARCHS[m].get("sliding_window") is not None]
#: accelerate_peft reproduces PEFT on these (test_peft_attention.py: BERT and RoBERTa, more cases)
ACCELERATED = [m for m in PEFT_RUNS if m not in SLIDING]
#: and refuses these (ValueError before anything changes), each with the reason it names
ACCELERATE_REFUSED = {"distilbert": "does not run on", "modernbert": "does not run on", "mpnet": "does not run on",
                      "mistral": r"sliding window \(3 tokens\)", "gemma2": r"sliding window \(3 tokens\)",
                      "gemma3_text": r"sliding window \(3 tokens\)"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """model_type (, config overrides) -> a saved tiny float32 model folder with its tokenizer, built once: what a
    user loads with PromptEncoder.from_pretrained, so the tokenizer is the one transformers gives that model type.
    For Qwen2 that is Qwen2Tokenizer whatever the folder says, which reads the builders' WordPiece vocabulary
    poorly (most words become one repeated token): a weaker input, but the same tokens on both sides compared."""
    folders = {}

    def get(model_type, **overrides):
        key = (model_type, tuple(sorted(overrides.items())))
        if key not in folders:
            path = tmp_path_factory.mktemp(model_type)
            _backbone(model_type, {**ARCHS[model_type], **overrides}, dtype=torch.float32).save_pretrained(path)
            _tokenizer().save_pretrained(path)
            folders[key] = path
        return folders[key]

    return get


def _from_folder(folder, model_type, **config):
    torch.manual_seed(1)
    pooler = "last" if model_type in DECODERS else "mean"
    prompt_config = PromptConfig(**{"prompt_length": 3, "init_std": 0.5, **config})
    return PromptEncoder.from_pretrained(folder, prompt_config=prompt_config, pooler=pooler).eval()


def _hidden(encoder):
    batch = {k: v for k, v in encoder.tokenize(SENTENCES).items() if k != "token_type_ids"}
    with torch.no_grad():
        out = encoder.hidden_states(batch["input_ids"], batch["attention_mask"])
    return out * batch["attention_mask"][..., None], batch


# ------------------------------------------------------------------ sentence-transformers


def _load_st(folder):
    return st.SentenceTransformer(str(folder), trust_remote_code=True, device="cpu")


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_sentence_transformers_export_round_trips(model_type, model_dir, tmp_path):
    """The Python path from an encoder and the CLI path from a saved checkpoint: SentenceTransformer's encode equals
    PromptEncoder.encode, and the prompt is in effect (the frozen model alone encodes otherwise)."""
    folder = model_dir(model_type)
    encoder = _from_folder(folder, model_type)
    ours = encoder.encode(SENTENCES)
    model = _load_st(export_sentence_transformers(encoder, tmp_path / "st"))
    assert type(model[0].encoder.backbone) is type(encoder.backbone)
    np.testing.assert_allclose(model.encode(SENTENCES), ours, **TOL)
    encoder.save(tmp_path / "ckpt")
    assert cli.main(["export", "--prompt", str(tmp_path / "ckpt"), "--to", "sentence-transformers",
                     "--output", str(tmp_path / "st-cli")]) == 0
    np.testing.assert_allclose(_load_st(tmp_path / "st-cli").encode(SENTENCES), ours, **TOL)
    plain = PromptEncoder.from_pretrained(folder, pooler=encoder.pooler.pooler).encode(SENTENCES)
    assert np.abs(plain - ours).max() > 1e-3


def test_sentence_transformers_export_refuses_a_tokenizer_that_would_not_load_back(tmp_path):
    """transformers loads a Qwen2 folder's tokenizer as Qwen2Tokenizer whatever the files say: an encoder built in
    memory with a WordPiece tokenizer would export a model that tokenises otherwise. Refused; nothing is written."""
    encoder = _encoder("qwen2", DECODERS["qwen2"], PromptConfig(prompt_length=2), dtype=torch.float32)
    with pytest.raises(ValueError, match="does not load back from the exported folder.*Qwen2Tokenizer"):
        export_sentence_transformers(encoder, tmp_path / "st")
    assert not (tmp_path / "st").exists()


# ------------------------------------------------------------------ PEFT's adapter format


@pytest.mark.parametrize("model_type", PEFT_RUNS)
def test_peft_export_import_round_trip_and_peft_runs_it(model_type, model_dir, tmp_path, caplog):
    """fastprompt -> PEFT adapter -> fastprompt encodes the same; PEFT itself runs the adapter (on a window longer
    than the inputs where the config has one) with fastprompt's outputs (position_mode "shifted", as PEFT runs)."""
    window = {"sliding_window": WIDE_WINDOW} if "sliding_window" in ARCHS[model_type] else {}
    folder = model_dir(model_type, **window)
    encoder = _from_folder(folder, model_type, position_mode="shifted")
    with caplog.at_level(logging.WARNING, logger="fastprompt.integrations.peft"):
        adapter = export_peft(encoder, tmp_path / "adapter")
    assert ("PEFT may run this" in caplog.text) == (model_type in SLIDING)
    config = json.loads((adapter / "adapter_config.json").read_text())
    # PEFT's sizing: one prefix key/value per key/value head
    model_config = encoder.backbone.config
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    assert (config["num_attention_heads"], config["token_dim"]) == (kv_heads, kv_heads * encoder.head_dim)
    back = PromptEncoder.load(import_peft(adapter, tmp_path / "back", base_model=folder)).eval()
    assert torch.equal(back.prompt.prefix, encoder.prompt.prefix)
    np.testing.assert_allclose(back.encode(SENTENCES), encoder.encode(SENTENCES), **TOL)
    ours, batch = _hidden(encoder)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on the base model and token_type_ids
        theirs = peft.PeftModel.from_pretrained(AutoModel.from_pretrained(folder), adapter).eval()(**batch)
    torch.testing.assert_close(ours, theirs.last_hidden_state * batch["attention_mask"][..., None], **TOL)


@pytest.mark.parametrize("model_type", [m for m in DECODERS if m not in SLIDING])
def test_decoder_adapter_peft_wrote_imports(model_type, model_dir, tmp_path):
    """An adapter PEFT trained and saved on a decoder (grouped-query: PEFT sizes it per key/value head) imports
    with position_mode "shifted" and gives PEFT's outputs."""
    folder = model_dir(model_type)
    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModel.from_pretrained(folder), peft.PrefixTuningConfig(
        task_type="FEATURE_EXTRACTION", num_virtual_tokens=3))
    with torch.no_grad():
        model.prompt_encoder["default"].embedding.weight.mul_(0.5)
    model.save_pretrained(tmp_path / "adapter")
    encoder = PromptEncoder.load(import_peft(tmp_path / "adapter", tmp_path / "prompt", base_model=folder,
                                             pooler="last")).eval()
    assert encoder.prompt_config.position_mode == "shifted"
    ours, batch = _hidden(encoder)
    with torch.no_grad():
        theirs = model.eval()(**batch).last_hidden_state * batch["attention_mask"][..., None]
    torch.testing.assert_close(ours, theirs, **TOL)


@pytest.mark.parametrize("model_type", sorted(PEFT_FAILS))
def test_peft_export_refuses_what_peft_cannot_run(model_type, model_dir, tmp_path):
    """PEFT's prefix tuning fails on these (checked here, so that the refusal stays true), and export says so
    before writing anything."""
    folder = model_dir(model_type)
    base = AutoModel.from_pretrained(folder)
    with pytest.raises((ValueError, RuntimeError), match="token_dim|size of tensor"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(base, peft.PrefixTuningConfig(task_type="FEATURE_EXTRACTION",
                                                                  num_virtual_tokens=2))
        model(**_hidden(_from_folder(folder, model_type))[1])
    encoder = _from_folder(folder, model_type)
    with pytest.raises(ValueError, match=f"does not run on '{model_type}'"):
        export_peft(encoder, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_peft_export_warns_where_a_sliding_window_hides_peft_prefix(model_dir, tmp_path, caplog):
    """Mistral with a window of 3: PEFT hides its prefix (at positions 0..P-1) from tokens more than 3 past it, so
    its outputs differ from fastprompt's, which keeps the prefix visible; export warns, and the adapter still comes
    back into fastprompt exactly."""
    folder = model_dir("mistral")
    encoder = _from_folder(folder, "mistral", position_mode="shifted")
    with caplog.at_level(logging.WARNING, logger="fastprompt.integrations.peft"):
        adapter = export_peft(encoder, tmp_path / "adapter")
    assert "sliding window (3 tokens)" in caplog.text
    ours, batch = _hidden(encoder)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(AutoModel.from_pretrained(folder), adapter).eval()(**batch)
    assert (ours - theirs.last_hidden_state * batch["attention_mask"][..., None]).abs().max() > 1e-2
    back = PromptEncoder.load(import_peft(adapter, tmp_path / "back", base_model=folder)).eval()
    np.testing.assert_allclose(back.encode(SENTENCES), encoder.encode(SENTENCES), **TOL)


@pytest.mark.parametrize("model_type,overrides,warns", [
    ("mistral", {"sliding_window": None}, False),  # Mistral 7B v0.2 and later: no window
    ("qwen2", {}, False),  # use_sliding_window defaults to false
    ("qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}, True),
    ("gemma2", {"sliding_window": 3}, True),
])
def test_peft_export_warns_exactly_when_the_base_model_applies_a_sliding_window(model_type, overrides, warns,
                                                                                 model_dir, tmp_path, caplog):
    """The warning follows the base model the adapter names (read from its config, as PEFT will load it), not the
    model type: Mistral without a window does not warn, Qwen2 with one does; and the window is real (PEFT's outputs
    then differ from fastprompt's)."""
    folder = model_dir(model_type, **overrides)
    encoder = _from_folder(folder, model_type, position_mode="shifted")
    encoder.save(tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING, logger="fastprompt.integrations.peft"):
        adapter = export_peft(tmp_path / "ckpt", tmp_path / "adapter")
    assert ("sliding window (3 tokens)" in caplog.text) == warns, caplog.text
    assert ("PEFT may run this" in caplog.text) == warns
    ours, batch = _hidden(encoder)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(AutoModel.from_pretrained(folder), adapter).eval()(**batch)
    differs = float((ours - theirs.last_hidden_state * batch["attention_mask"][..., None]).abs().max())
    assert differs > 1e-2 if warns else differs < 1e-5


def test_peft_export_warns_when_the_base_model_cannot_be_read(model_dir, tmp_path, caplog):
    """A checkpoint whose base model is gone: export still writes the adapter (the prefix does not need the base)
    and says that it could not check for a sliding window."""
    encoder = _from_folder(model_dir("llama"), "llama", position_mode="shifted")
    encoder.save(tmp_path / "ckpt")
    config_file = tmp_path / "ckpt" / "fastprompt_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "base_model": str(tmp_path / "moved-away")}))
    with caplog.at_level(logging.WARNING, logger="fastprompt.integrations.peft"):
        export_peft(tmp_path / "ckpt", tmp_path / "adapter")
    assert "could not read the config of base model" in caplog.text and "sliding window" in caplog.text


@pytest.mark.parametrize("model_type", sorted(PEFT_FAILS))
def test_peft_import_refuses_a_base_peft_cannot_run(model_type, model_dir, tmp_path, monkeypatch):
    """An adapter (well formed, PEFT's layout) that names a base PEFT's prefix tuning fails on cannot come from
    PEFT: import refuses it with export's reason, before the base model loads and without writing anything."""
    from safetensors.torch import save_file

    folder = model_dir(model_type)
    backbone = AutoModel.from_pretrained(folder)
    shape = PromptEncoder(backbone, _tokenizer(), PromptConfig(prompt_length=2))
    L, H, D = shape.num_layers, shape.num_heads, shape.head_dim
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "PREFIX_TUNING", "task_type": "FEATURE_EXTRACTION", "num_virtual_tokens": 2, "num_layers": L,
        "num_attention_heads": H, "token_dim": H * D, "base_model_name_or_path": str(folder)}))
    save_file({"prompt_embeddings": torch.randn(2, L * 2 * H * D)}, str(adapter / "adapter_model.safetensors"))

    def no_load(*args, **kwargs):
        raise AssertionError("the base model was loaded")

    monkeypatch.setattr(PromptEncoder, "from_pretrained", no_load)
    for base in (None, folder):  # the adapter's base, or the one passed (CLI --model)
        with pytest.raises(ValueError, match=f"does not run on '{model_type}'.*no PEFT adapter can hold"):
            import_peft(adapter, tmp_path / "prompt", base_model=base)
        assert not (tmp_path / "prompt").exists()


def test_peft_adapter_carries_append_eos(tiny_llama_dir, tmp_path):
    """append_eos rides along in the adapter's fastprompt metadata, so the imported prompt tokenises as trained."""
    encoder = PromptEncoder.from_pretrained(tiny_llama_dir, pooler="last", append_eos=True,
                                            prompt_config=PromptConfig(prompt_length=2, position_mode="shifted"))
    back = PromptEncoder.load(import_peft(export_peft(encoder, tmp_path / "adapter"), tmp_path / "back"))
    assert back.append_eos
    np.testing.assert_allclose(back.encode(SENTENCES), encoder.encode(SENTENCES), **TOL)


# ------------------------------------------------------------------ accelerate_peft


def _peft_model(model_type, projection=False, **overrides):
    backbone = _backbone(model_type, {**ARCHS[model_type], **overrides}, dtype=torch.float32)
    backbone.set_attn_implementation("eager" if model_type in ("mpnet", "gemma2") else "sdpa")
    torch.manual_seed(0)
    config = peft.PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=3,
                                     prefix_projection=projection, encoder_hidden_size=24)
    if model_type == "distilbert":  # PEFT cannot read these off DistilBertConfig
        config.num_layers, config.num_attention_heads, config.token_dim = 2, 4, 32
    model = peft.get_peft_model(backbone, config)
    with torch.no_grad():  # a prefix of the size of real keys/values (see test_peft_attention.py)
        for p in model.prompt_encoder.parameters():
            p.mul_(0.5)
    return model.eval()


def _assert_same(ours, theirs):
    """Outputs within 1e-5; each adapter gradient within 1e-5 of its largest entry (the module docstring)."""
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    assert ours[1].keys() == theirs[1].keys() and ours[1]
    for name, grad in theirs[1].items():
        torch.testing.assert_close(ours[1][name], grad, rtol=0, atol=1e-5 * float(grad.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def _batch(padding_side="right"):
    tok = _tokenizer(padding_side)
    return {k: v for k, v in tok(SENTENCES, padding=True, return_tensors="pt").items() if k != "token_type_ids"}


#: (model_type, padding side, backend): every model on the C++ kernel, decoders padded on either side; the
#: reference backend once per model
ACCELERATE_CASES = [(m, side, backend) for m in ACCELERATED
                    for side, backend in ([("right", "cpu"), ("left", "cpu"), ("left", "reference")] if m in DECODERS
                                          else [("right", "cpu"), ("right", "reference")])]


@pytest.mark.parametrize("model_type,padding_side,backend", ACCELERATE_CASES)
def test_accelerate_peft_equals_peft(model_type, padding_side, backend):
    """Outputs and adapter gradients of PEFT's own forward (Llama through the reparameterisation MLP)."""
    model = _peft_model(model_type, projection=model_type == "llama")
    inputs = _batch(padding_side)
    theirs = _run(model, inputs)
    accelerate_peft(model, backend=backend)
    _assert_same(_run(model, inputs), theirs)


def test_accelerate_peft_on_mistral_without_a_sliding_window():
    """Mistral configs with sliding_window None (Mistral 7B v0.2 and later) run like Llama."""
    model = _peft_model("mistral", sliding_window=None)
    inputs = _batch("left")
    theirs = _run(model, inputs)
    _assert_same(_run(accelerate_peft(model, backend="cpu"), inputs), theirs)


def test_accelerate_peft_decoder_triton():
    """The Triton kernels' grouped-query causal path (in the interpreter, ~20 s) against PEFT on Llama."""
    pytest.importorskip("triton")
    model = _peft_model("llama")
    inputs = _batch("left")
    theirs = _run(model, inputs)
    _assert_same(_run(accelerate_peft(model, backend="triton"), inputs), theirs)


@pytest.mark.parametrize("model_type,overrides,message", [
    *((m, {}, why) for m, why in ACCELERATE_REFUSED.items()),
    ("gemma2", {"sliding_window": None, "attn_logit_softcapping": 50.0}, r"attn_logit_softcapping = 50\.0"),
])
def test_accelerate_peft_refuses_before_changing_anything(model_type, overrides, message):
    model = _peft_model(model_type, **overrides)
    base = model.get_base_model()
    attn = base.config._attn_implementation
    with pytest.raises(ValueError, match=message):
        accelerate_peft(model)
    assert base.config._attn_implementation == attn and "forward" not in model.__dict__


# ------------------------------------------------------------------ the docs' table


def _table_rows() -> list[str]:
    """The rows docs/integrations.md must have: what this module tests."""
    rows = []
    for model_type in ARCHS:
        if model_type in PEFT_FAILS:
            peft_export = accelerated = "refused (PEFT fails on it)"
        else:
            peft_export = "yes" + (", warns (PEFT hides the prefix beyond a sliding window)"
                                   if model_type in SLIDING else "")
            accelerated = "yes" if model_type in ACCELERATED else {
                "mistral": "without a sliding window", "gemma2": "refused (sliding window, soft-capping)"}.get(
                model_type, "refused (sliding window)")
        rows.append(f"| {model_type} | yes | {peft_export} | {accelerated} |")
    return rows


def test_docs_table_lists_what_the_tests_cover():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text(encoding="utf-8")
    table = text.split("<!-- integrations-table")[1].split("<!-- /integrations-table -->")[0]
    documented = [line for line in table.splitlines() if line.startswith("| ") and "model_type" not in line]
    expected = _table_rows()
    assert documented == expected, "docs/integrations.md's table should read:\n" + "\n".join(expected)

