"""ONNX export: a prompt checkpoint as one self-contained ONNX graph that onnxruntime serves without PyTorch or
fastprompt, its sentence vectors equal to :meth:`PromptEncoder.encode`'s.

The folder (written by :func:`export_onnx`):

    model.onnx            the graph: the frozen backbone, every layer's trained prefix keys and values as constants
                          (initialisers; a reparameterised prompt is evaluated through its MLP once, at export),
                          the [CLS] prompt and soft input tokens where the checkpoint has them, the pooler, the head
                          the checkpoint applies at inference and (by default) L2 normalisation
    fastprompt_onnx.json  what the graph expects and returns (inputs, outputs, pooler, normalisation, max_length,
                          padding side, opset, exporter, the versions it was made with, the largest difference to
                          PyTorch measured at export, the files the export wrote)
    tokenizer files       the encoder's tokenizer (``model_max_length`` set to the export's max_length, so
                          ``tokenizer(texts, truncation=True)`` cuts where PromptEncoder.tokenize does)
    config.json           the backbone's Hugging Face config, for servers that read one beside the graph
                          (text-embeddings-inference's ONNX backend; the graph itself needs nothing of it)

Inputs ``input_ids``, ``attention_mask`` (int64, (batch, sequence), both axes dynamic) and ``token_type_ids`` where
the tokenizer returns them; outputs ``sentence_embedding`` (float32, (batch, hidden)) and ``token_embeddings`` (the
last hidden states, (batch, sequence, hidden), for poolers outside the graph). :func:`graph_inputs` builds the
inputs from sentences as :meth:`PromptEncoder.tokenize` does (from the saved tokenizer and the sidecar alone).

``dtype="float16"``: the checked float32 graph converted by onnxruntime's float16 converter
(``onnxruntime.transformers.float16``, weights and activations in half, inputs and outputs kept int64/float32),
then checked against the encoder again within :data:`FP16_CHECK_ATOL`.

How: the encoder runs its own forward (the same code as :meth:`PromptEncoder.encode`: positions, input prompts,
pooler, head) traced by ``torch.onnx.export(dynamo=True)`` (``torch.export`` then onnxscript's translation), with
the attention of every prefixed layer on the plain-PyTorch path (``attn_backend="reference"``: the prefix
concatenated before the token keys/values, visible to every token, padding masked by the attention mask), so the
graph holds MatMul/Softmax-style ONNX ops only, never the fused training kernels. The TorchScript exporter
(``dynamo=False``) fails on that path (``aten::__iand_``, an in-place mask update it does not translate) and is
deprecated in torch 2.9+. After writing, the graph is run once in onnxruntime on padded sentences and compared with
the encoder; a difference above :data:`EXPORT_CHECK_ATOL` fails the export.

What is exported is what the tests check against :meth:`PromptEncoder.encode` (tests/integrations/
test_onnx_export.py): the model types whose family says so (``Family.onnx``, :func:`exportable_model_types`) and the
poolers of
:data:`EXPORTABLE_POOLERS`; anything else is refused, naming what, before any weights load where the checkpoint's
config tells (:func:`config_refusal`, then :func:`onnx_refusal` once the model is loaded).

Needs ``onnx``, ``onnxscript`` and ``onnxruntime`` (``pip install 'fastprompt[onnx]'``); ``import fastprompt``
does not.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fastprompt.choices import POOLERS

logger = logging.getLogger(__name__)

FORMAT = "fastprompt.onnx"
FORMAT_VERSION = 1
GRAPH_FILE = "model.onnx"
#: the weights beside the graph, written only when the graph would pass protobuf's 2 GB limit
GRAPH_DATA_FILE = "model.onnx.data"
CONFIG_FILE = "fastprompt_onnx.json"
#: ONNX opset of the graph: onnxruntime 1.17+ runs it, and it predates opset 23's Attention op, so the
#: attention stays MatMul/Softmax/Where that every ONNX runtime executes
OPSET = 18
EXPORTER = "torch.onnx.export(dynamo=True)"
#: the packages the export needs, and the extra that installs them
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
ONNX_EXTRA = "pip install 'fastprompt[onnx]'"
#: largest |difference| between onnxruntime's and PyTorch's normalised sentence vectors accepted at export (the
#: tests hold the graphs to 1e-5; this check is there to catch a wrong graph, which differs by ~1e-1)
EXPORT_CHECK_ATOL = 1e-4
#: the graph's weight types (``dtype``): float32, or the float32 graph converted to float16 after its check
DTYPES = ("float32", "float16")
#: largest |difference| accepted at export for a float16 graph: its weights and activations are rounded to half
#: precision (unit roundoff 2**-11 = 4.9e-4), measured <= 3.9e-4 on MiniLM's normalised vectors; a wrong graph is
#: ~1e-1
FP16_CHECK_ATOL = 1e-2
#: operators the float16 converter keeps in float32: its own list, and IsInf/IsNaN (opset 18 has no float16 IsInf)
FP16_KEEP_FLOAT32 = ("IsInf", "IsNaN")
#: graphs over this many bytes of weights keep them in GRAPH_DATA_FILE (protobuf cannot hold 2 GB)
EXTERNAL_DATA_BYTES = 1_800_000_000


def exportable_model_types() -> list[str]:
    """Model types whose export the tests compare with PromptEncoder.encode (tiny configs, and real
    all-MiniLM-L6-v2): their family's ``onnx`` (:mod:`fastprompt.model.arch`)."""
    from fastprompt.model.arch import onnx_model_types

    return onnx_model_types()


#: poolers exported: those computed from the last hidden states and the attention mask, "mask" (a template's
#: [MASK] state, with template denoising: its bias is a constant table, one row per sentence length) and "topk"
#: (PromptBERT's top-k of the MLM head's vocabulary distribution at that state: the MLM head, the word embeddings and
#: a TopK operator in the graph); every pooler fastprompt has (a pooler added to fastprompt.choices.POOLERS is
#: exportable only once tests/integrations/test_onnx_export.py's cases cover it: that test fails until they do)
EXPORTABLE_POOLERS = POOLERS
#: the sentences the export is checked on: padded (several lengths), punctuation, digits
CHECK_SENTENCES = ["A man is playing a guitar.", "Two dogs run in the park, 3 times, and then they sleep in the shade "
                   "of a big old tree near the river.", "ok"]


def require_onnx() -> None:
    """ImportError naming the missing packages and the extra that installs them."""
    missing = []
    for name in ONNX_PACKAGES:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(f"the ONNX export needs {', '.join(missing)}, which is not installed: {ONNX_EXTRA} "
                          f"(or pip install {' '.join(ONNX_PACKAGES)})")


def config_refusal(config: dict) -> str | None:
    """What in a prompt checkpoint's config (``fastprompt_config.json``) cannot be exported, None when nothing is
    known to stop it (the backbone is checked once loaded: :func:`onnx_refusal`)."""
    pooler = config.get("pooler")
    if pooler is not None and pooler not in EXPORTABLE_POOLERS:
        return _pooler_refusal(pooler)
    if config.get("template") and config.get("append_eos"):
        return _TEMPLATE_EOS_REFUSAL
    return None


_TEMPLATE_EOS_REFUSAL = ("the ONNX export does not take a template together with append_eos yet (the template's "
                         "recipe in fastprompt_onnx.json has no EOS rule); export a prompt trained without one of them")


def _pooler_refusal(pooler: str) -> str:
    return (f"the ONNX export does not take pooler {pooler!r} (it exports {', '.join(EXPORTABLE_POOLERS)}); export a "
            "prompt trained with one of those")


def onnx_refusal(encoder) -> str | None:
    """Why ``encoder`` cannot be exported to ONNX, None when it can."""
    if not encoder.architecture.family.onnx:
        return (f"the ONNX export of {encoder.architecture.name} is not implemented: it is tested on "
                f"{', '.join(exportable_model_types())}")
    if encoder.pooler.pooler not in EXPORTABLE_POOLERS:
        return _pooler_refusal(encoder.pooler.pooler)
    if encoder.template is not None and encoder.append_eos:
        return _TEMPLATE_EOS_REFUSAL
    if encoder.lora is not None:
        return ("the ONNX export takes LoRA adapters merged into the weights: export the saved checkpoint folder "
                "(which merges them), or call encoder.merge_lora() first")
    if encoder.prefix_mode != "attention":
        return ("the ONNX export traces the prefix attention path: load the encoder with prefix_mode='attention' "
                "(the default), not 'cache'")
    dtypes = {p.dtype for p in encoder.parameters()}
    if dtypes != {torch.float32}:
        shown = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        return (f"the ONNX export writes a float32 graph, but the encoder's weights are {shown}: load it in "
                "float32 (torch_dtype=None, the default)")
    if encoder.device.type != "cpu":
        return f"the ONNX export runs on the CPU, but the encoder is on {encoder.device}: move it with .to('cpu')"
    return None


class OnnxGraph(nn.Module):
    """What the exported graph computes: :meth:`PromptEncoder.forward` (in eval mode) with every layer's prefix
    held as a constant, then :meth:`PromptEncoder.encode`'s L2 normalisation (``normalize``). Returns
    ``(sentence_embedding, token_embeddings)``. Use it inside :func:`export_mode`."""

    def __init__(self, encoder, normalize: bool = True, max_length: int | None = None):
        super().__init__()
        self.encoder = encoder
        self.normalize = normalize
        tpl = encoder._template
        #: the most sentence tokens a row holds inside the template (its recipe in fastprompt_onnx.json)
        self.sentence_room = None if tpl is None else template_room(encoder, max_length)
        training = encoder.training
        encoder.eval()  # no prompt dropout; an MLP-reparameterised prompt is evaluated once, here
        try:
            with torch.no_grad():
                layers = encoder._layer_prefixes()
                if tpl is not None and encoder.denoise:
                    # template denoising's bias: the [MASK] state of the template alone with the positions it has
                    # around an L-token sentence, for every L the rows can have (what template_bias caches)
                    lengths = torch.arange(self.sentence_room + 1, device=encoder.device)
                    self.register_buffer("template_bias_table", encoder._bias_for(tpl, lengths).float().clone())
        finally:
            encoder.train(training)
        self.prefixed = [i for i, entry in enumerate(layers) if entry is not None]
        shared = {}
        for i in self.prefixed:  # a layer-shared prompt is one tensor per kind, stored once
            for kind, t in zip("kv", layers[i]):
                key = id(t)
                if key not in shared:
                    shared[key] = f"prefix_{kind}_{i}"
                    self.register_buffer(shared[key], t.detach().float().contiguous().clone())
        self._names = [None if layers[i] is None else (shared[id(layers[i][0])], shared[id(layers[i][1])])
                       for i in range(len(layers))]

    def layer_prefixes(self, batch_size: int | None = None):
        return [None if names is None else (getattr(self, names[0]), getattr(self, names[1]))
                for names in self._names]

    def template_bias(self, template, lengths: torch.Tensor) -> torch.Tensor:
        """The table's rows for these sentence lengths (:meth:`PromptEncoder.template_bias`, traceable)."""
        return self.template_bias_table[lengths.clamp(0, self.sentence_room)]

    @staticmethod
    def sentence_lengths(tpl, attention_mask: torch.Tensor) -> torch.Tensor:
        """:meth:`PromptEncoder.sentence_lengths` without its host-side check (rows are built by the recipe)."""
        return (attention_mask.sum(1).long() - tpl.overhead).clamp_min(0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None):
        enc = self.encoder
        hidden = enc.hidden_states(input_ids, attention_mask, token_type_ids)
        vec = enc.pool(hidden, input_ids, attention_mask).float()
        if self.normalize:
            vec = F.normalize(vec, dim=-1)
        return vec, hidden.float()


@contextlib.contextmanager
def export_mode(graph: OnnxGraph):
    """The encoder as the exporter must trace it: eval mode, padded (not packed) batches, the plain-PyTorch
    attention (``attn_backend="reference"``) and the graph's constant prefixes; restored afterwards."""
    enc = graph.encoder
    saved = enc.training, enc.attn_backend, enc.packed
    enc.eval()
    enc.attn_backend, enc.packed = "reference", False
    # instance attributes: the class's methods are untouched
    enc._layer_prefixes = graph.layer_prefixes
    enc.template_bias, enc.sentence_lengths = graph.template_bias, graph.sentence_lengths
    words = enc.template_words
    if words is not None:
        words.apply = _template_words_apply(words)
    try:
        yield graph
    finally:
        del enc._layer_prefixes, enc.template_bias, enc.sentence_lengths
        if words is not None:
            del words.apply
        enc.train(saved[0])
        enc.attn_backend, enc.packed = saved[1:]


def _template_words_apply(words):
    """OptiPrompt's :meth:`~fastprompt.model.promptbert.TemplateWords.apply` without its host-side check that the rows
    are the template's (a data-dependent branch torch.export cannot trace; the rows are built by the recipe, and
    the export's check compares the graph with the encoder): the trained vectors put at the template words'
    positions."""
    def apply(embeds: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pos = words.positions(attention_mask)
        rows = torch.arange(embeds.shape[0], device=embeds.device).unsqueeze(1).expand_as(pos)
        values = words.embedding.to(embeds.dtype).unsqueeze(0).expand(embeds.shape[0], -1, -1)
        return embeds.index_put((rows, pos), values)

    return apply


def template_room(encoder, max_length: int | None) -> int:
    """The most sentence tokens a row holds inside the encoder's template: ``max_length`` (the sentence's own
    tokens, PromptBERT's rule), within what the model's positions leave (as
    :func:`fastprompt.model.template.wrap_batch` cuts)."""
    room = encoder.model_max_tokens() - encoder._template.overhead
    return room if max_length is None else min(room, max_length)


def template_recipe(encoder, room: int) -> dict:
    """How a server builds a row from a sentence for a template export (the ids PromptEncoder.tokenize gives)."""
    tpl = encoder._template
    return {"text": tpl.text, "lead": list(tpl.lead), "before": list(tpl.before), "after": list(tpl.after),
            "trail": list(tpl.trail), "space_before_sentence": tpl.space_before_sentence,
            "max_sentence_tokens": room, "denoise": encoder.denoise,
            "recipe": "input_ids = lead + before + tokenizer(text, add_special_tokens=False).input_ids"
                      "[:max_sentence_tokens] + after + trail, with text = ' ' + sentence.strip() when "
                      "space_before_sentence else sentence.strip(); attention_mask 1 per id; pad on padding_side "
                      "with the tokenizer's pad id"}


def is_onnx_export(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds an ONNX export of fastprompt (its ``fastprompt_onnx.json`` says so)."""
    from fastprompt.io import read_json

    try:
        return read_json(Path(folder) / CONFIG_FILE, CONFIG_FILE).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def check_onnx_target(output: str | os.PathLike, source: str | os.PathLike | None, overwrite: bool) -> None:
    """The output folder must be new or empty; ``overwrite`` lets it hold other files (the export replaces only the
    files it writes, and those an earlier ONNX export there listed). The input checkpoint, a folder holding it and
    a folder inside it are refused even with ``overwrite``; so is a file."""
    from fastprompt.io import check_apart

    out = Path(output)
    check_apart(out, (source,), "export target")
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise FileExistsError(f"cannot export to {out}: it is a file; choose a folder name")
    names = sorted(p.name for p in out.iterdir())
    if names and not overwrite:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise FileExistsError(f"cannot export to {out}: the folder is not empty (it holds {shown}); choose a new or "
                              "empty folder, or pass overwrite=True (CLI: --overwrite) to replace the files the export "
                              "writes there (other files are kept)")


def _previous_files(folder: Path) -> list[str]:
    """The files an earlier ONNX export in ``folder`` listed as its own (plain names only)."""
    from fastprompt.io import read_json

    if not is_onnx_export(folder):
        return []
    files = read_json(folder / CONFIG_FILE, CONFIG_FILE).get("files") or []
    return [f for f in files if isinstance(f, str) and f and Path(f).name == f and f not in (".", "..")]


def _move_into(tmp: Path, out: Path) -> None:
    """Replace, in the existing folder ``out``, the files an earlier export listed and the files in ``tmp``; other
    files stay. The sidecar JSON goes last, so a folder never names files it does not hold yet."""
    for name in _previous_files(out):
        target = out / name
        if target.is_file() or target.is_symlink():
            target.unlink()
    names = sorted(p.name for p in tmp.iterdir())
    for name in [n for n in names if n != CONFIG_FILE] + [CONFIG_FILE]:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            raise FileExistsError(f"cannot export to {out}: {target} is a folder where the export writes a file")
        os.replace(tmp / name, target)


def _versions() -> dict[str, str]:
    out = {}
    for name in ("fastprompt", "torch", "transformers", "onnx", "onnxscript", "onnxruntime"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def export_onnx(prompt, output: str | os.PathLike, *, base_model: str | os.PathLike | None = None,
                normalize: bool = True, max_length: int | None = None, overwrite: bool = False,
                trust_remote_code: bool = False, dtype: str = "float32") -> Path:
    """Write ``prompt`` (a checkpoint folder or a :class:`~fastprompt.model.PromptEncoder`) as an ONNX graph with
    its tokenizer and ``fastprompt_onnx.json`` in the folder ``output`` (see the module docstring).

    ``base_model`` overrides the base the checkpoint names; ``normalize`` L2-normalises ``sentence_embedding``
    (:meth:`PromptEncoder.encode`'s default); ``max_length`` the longest input the saved tokenizer keeps (default:
    the encoder's, else what the model takes, at most 512); ``dtype`` the graph's weights (:data:`DTYPES`: "float16"
    halves the file; docs/deploy.md has its accuracy and speed). ``output`` must be new or empty unless ``overwrite``,
    which replaces only the files the export writes. Refuses (ValueError) what it cannot export, before any
    weights load where the checkpoint tells (:func:`config_refusal`, :func:`onnx_refusal`). Returns ``output``.
    """
    from fastprompt.integrations._common import check_tokenizer_reloads
    from fastprompt.io import write_json_atomic
    from fastprompt.model import PromptEncoder
    from fastprompt.model.checkpoint import read_checkpoint_config

    require_onnx()
    check_dtype(dtype)
    source = None if isinstance(prompt, PromptEncoder) else Path(prompt)
    check_onnx_target(output, source, overwrite)
    if source is not None:
        refusal = config_refusal(read_checkpoint_config(source))
        if refusal is not None:
            raise ValueError(f"cannot export {source} to ONNX: {refusal}")
        # LoRA adapters folded into the weights: the graph then is a fine-tuned backbone's (the same outputs)
        encoder = PromptEncoder.load(source, base_model=base_model, trust_remote_code=trust_remote_code).merge_lora()
    else:
        encoder = prompt
    refusal = onnx_refusal(encoder)
    if refusal is not None:
        raise ValueError(f"cannot export to ONNX: {refusal}")
    encoder.check_max_length(max_length)
    # without a template: the whole row's tokens; with one: the sentence's own (PromptBERT's rule, as tokenize())
    limit = max_length or encoder.max_length or (None if encoder.template is not None else encoder.model_max_tokens())
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    # written beside the target (the same file system, so the files move in with os.replace), removed on any failure
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.onnx-", dir=out.parent))
    try:
        info = _write_graph(encoder, tmp, normalize=normalize, max_length=limit, dtype=dtype)
        tokenizer = copy.deepcopy(encoder.tokenizer)
        tokenizer.model_max_length = info["max_length"]
        tokenizer.save_pretrained(str(tmp))
        # the backbone's config: what servers that load a model folder read beside model.onnx (text-embeddings-
        # inference's ONNX backend: hidden size, layers, pad token id; docs/deploy.md). With it there, transformers
        # may load the tokenizer as its own class for that model type: kept only if the tokenizer still loads back
        # as the encoder's, giving every input the graph takes
        encoder.backbone.config.to_json_file(str(tmp / "config.json"))
        if not _tokenizer_reloads(encoder.tokenizer, tmp, list(info["inputs"])):
            (tmp / "config.json").unlink()
            logger.warning("the export holds no config.json: with it, transformers loads this model type's own "
                           "tokenizer class instead of the encoder's %s", type(encoder.tokenizer).__name__)
        check_tokenizer_reloads(encoder.tokenizer, tmp)
        info["config_json"] = (tmp / "config.json").is_file()
        info["files"] = sorted([p.name for p in tmp.iterdir()] + [CONFIG_FILE])
        write_json_atomic(tmp / CONFIG_FILE, info, CONFIG_FILE)
        out.mkdir(exist_ok=True)
        _move_into(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote the ONNX export to %s (largest difference to PyTorch %.2g)", out, info["check"]["max_abs_diff"])
    return out


def check_dtype(dtype: str) -> None:
    """ValueError unless ``dtype`` is one of :data:`DTYPES`."""
    if dtype not in DTYPES:
        raise ValueError(f"the ONNX export writes a float32 or float16 graph (dtype {' or '.join(map(repr, DTYPES))}), "
                         f"got {dtype!r}")


def _write_graph(encoder, folder: Path, *, normalize: bool, max_length: int | None, dtype: str = "float32") -> dict:
    """Export ``encoder`` to ``folder/model.onnx``, check it in onnxruntime, and return the sidecar's contents.
    ``max_length``: the row's tokens, or with a template the sentence's own (None: what the model leaves);
    ``dtype`` "float16": the checked float32 graph converted, then checked again (:data:`FP16_CHECK_ATOL`)."""
    import onnx

    graph = OnnxGraph(encoder, normalize=normalize, max_length=max_length).eval()
    tok = encoder.tokenize(CHECK_SENTENCES, max_length)
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if "token_type_ids" in tok else [])
    args = tuple(tok[n] for n in names)
    if args[0].shape[1] < 2:  # torch.export would specialise a sequence axis of size 1
        raise ValueError(f"max_length {max_length} leaves the export's example batch one token wide; give a "
                         "max_length of at least 2")
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    dynamic = {n: {0: batch, 1: sequence} for n in names}
    weights = sum(t.numel() * t.element_size() for t in list(graph.parameters()) + list(graph.buffers()))
    external = weights > EXTERNAL_DATA_BYTES
    path = folder / GRAPH_FILE
    expected = _encoder_vectors(encoder, args, normalize)  # the encoder's own path (its backend, packing)
    with export_mode(graph), torch.no_grad(), _quiet_exporter():
        program = torch.onnx.export(graph, args, input_names=names, output_names=["sentence_embedding",
                                    "token_embeddings"], dynamic_shapes=dynamic, opset_version=OPSET, dynamo=True,
                                    optimize=False, verbose=False)
    program.save(str(path), external_data=external)
    if external and not (folder / GRAPH_DATA_FILE).is_file():
        raise RuntimeError(f"the exporter wrote no {GRAPH_DATA_FILE} beside {GRAPH_FILE} for this model's "
                           f"{weights / 2**30:.1f} GB of weights; please report this")
    model = onnx.load(str(path), load_external_data=False)
    foreign = sorted({f"{n.domain}::{n.op_type}" for n in model.graph.node if n.domain not in ("", "ai.onnx")})
    if foreign:
        raise RuntimeError(f"the exported graph holds operators outside the standard ONNX domain ({', '.join(foreign)})"
                           ": it would not run on every ONNX runtime; please report this")
    diff = _check_graph(path, names, args, expected)
    if diff > EXPORT_CHECK_ATOL:
        raise RuntimeError(f"the exported graph's sentence vectors differ from PyTorch's by {diff:.3g} (more than "
                           f"{EXPORT_CHECK_ATOL:g}) on the check sentences: the graph is wrong for this model; "
                           "please report this (nothing was written)")
    fp32_diff, atol = diff, EXPORT_CHECK_ATOL
    if dtype == "float16":
        _to_float16(path, external)
        diff, atol = _check_graph(path, names, args, expected), FP16_CHECK_ATOL
        if diff > FP16_CHECK_ATOL:
            raise RuntimeError(f"the float16 graph's sentence vectors differ from PyTorch's by {diff:.3g} (more than "
                               f"{FP16_CHECK_ATOL:g}) on the check sentences: half precision is too coarse for this "
                               "model; export it in float32 (nothing was written)")
    cfg = encoder.backbone.config
    tokenizer = encoder.tokenizer
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "graph": GRAPH_FILE,
        "inputs": {n: {"dtype": "int64", "shape": ["batch", "sequence"]} for n in names},
        "outputs": {"sentence_embedding": {"dtype": "float32", "shape": ["batch", encoder.hidden_size],
                                           "normalized": normalize},
                    "token_embeddings": {"dtype": "float32", "shape": ["batch", "sequence", encoder.hidden_size]}},
        "normalized": normalize, "dimension": encoder.hidden_size, "similarity": "cosine",
        "pooler": encoder.pooler.pooler,
        # the pooler's trained head, in the graph when the checkpoint applies it at inference (mlp: always)
        "head": (None if encoder.pooler.head is None or encoder.pooler.mlp != "always"
                 else "mlm_transform" if encoder.pooler.head_kind == "mlm_transform"
                 else "bn_mlp" if encoder.pooler.pooler == "bn_mlp" else "linear_tanh"),
        "template_words": encoder.template_words is not None,
        # the longest row (special tokens included); with a template the sentence's tokens are bounded by the
        # recipe's max_sentence_tokens and the row is the template's overhead longer
        "max_length": (max_length if encoder.template is None
                       else graph.sentence_room + encoder._template.overhead),
        "padding_side": getattr(tokenizer, "padding_side", "right"), "append_eos": encoder.append_eos,
        "eos_token_id": encoder._eos_id,
        "template": None if encoder.template is None else template_recipe(encoder, graph.sentence_room),
        "prompt": {"prefix_length": encoder.prompt_length, "input_prompt_length": encoder.input_prompt_length,
                   "cls_prompt": encoder.cls_prompt is not None},
        "model_type": getattr(cfg, "model_type", None), "base_model": str(encoder.base_model),
        "opset": OPSET, "exporter": EXPORTER, "external_data": GRAPH_DATA_FILE if external else None,
        "dtype": dtype,
        "check": {"sentences": len(CHECK_SENTENCES), "max_abs_diff": diff, "atol": atol,
                  "float32_max_abs_diff": fp32_diff},
        "versions": _versions(),
    }


def _to_float16(path: Path, external: bool) -> None:
    """Rewrite the graph at ``path`` in float16 (onnxruntime's converter; inputs and outputs keep their types). The
    final L2 normalisation stays in float32 (:func:`_normalisation_nodes`), so the vectors are unit length to
    float32's precision, not float16's (1.7e-4 off on MiniLM when converted too)."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    model = onnx.load(str(path))
    kept = _normalisation_nodes(model.graph)
    with _quiet_exporter():
        half = convert_float_to_float16(model, keep_io_types=True,
                                        op_block_list=list(DEFAULT_OP_BLOCK_LIST) + list(FP16_KEEP_FLOAT32),
                                        node_block_list=kept)
    _drop_round_trips(half.graph, set(kept))
    if external:
        (path.parent / GRAPH_DATA_FILE).unlink()
    onnx.save(half, str(path), save_as_external_data=external, location=GRAPH_DATA_FILE)


def _normalisation_nodes(graph) -> list[str]:
    """The nodes of the graph's L2 normalisation: each ReduceL2 (the norm) and every node computed from its output
    (clamp, expand, the division giving ``sentence_embedding``); none without normalisation."""
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    todo = [n for n in graph.node if n.op_type == "ReduceL2"]
    seen: dict[str, None] = {}
    while todo:
        node = todo.pop()
        if node.name in seen:
            continue
        seen[node.name] = None
        for out in node.output:
            todo.extend(consumers.get(out, []))
    return list(seen)


def _drop_round_trips(graph, kept: set[str]) -> None:
    """The converter surrounds every node it keeps in float32 with casts, so a float32 value passed from one kept
    node to the next (or to the graph's float32 output) is rounded to float16 and back on the way: each such
    ``Cast(to float32)`` of a ``Cast(to float16)`` of a kept node's output becomes an Identity of that output."""
    from onnx import TensorProto, helper

    producer = {out: node for node in graph.node for out in node.output}

    def cast_to(node) -> int | None:
        return next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None

    for i, node in enumerate(list(graph.node)):
        first = producer.get(node.input[0]) if cast_to(node) == TensorProto.FLOAT else None
        source = producer.get(first.input[0]) if first is not None and cast_to(first) == TensorProto.FLOAT16 else None
        if source is not None and source.name in kept:
            graph.node[i].CopyFrom(helper.make_node("Identity", [first.input[0]], list(node.output), name=node.name))
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    dead = [n for n in graph.node if cast_to(n) == TensorProto.FLOAT16 and not set(n.output) & used]
    for node in dead:
        graph.node.remove(node)


def graph_inputs(tokenizer, info: dict, sentences: list[str]) -> dict:
    """The graph's inputs (numpy int64) for ``sentences``, built from the export's tokenizer and its sidecar
    ``info`` (``fastprompt_onnx.json``) as :meth:`PromptEncoder.tokenize` builds them: truncated to
    ``max_length``, with the EOS appended (``append_eos``) or inside the template (its recipe), padded on
    ``padding_side``. What a server written in Python does; the tests check it gives ``encode()``'s vectors."""
    import numpy as np

    from fastprompt.model.template import end_with_eos

    tokenizer.padding_side = info["padding_side"]
    tpl = info.get("template")
    if tpl is not None:
        texts = [(" " + t.strip()) if tpl["space_before_sentence"] else t.strip() for t in sentences]
        own = tokenizer(texts, add_special_tokens=False)["input_ids"]
        rows = [tpl["lead"] + tpl["before"] + ids[:tpl["max_sentence_tokens"]] + tpl["after"] + tpl["trail"]
                for ids in own]
    elif info.get("append_eos"):
        limit = info["max_length"]
        eos = info.get("eos_token_id", tokenizer.eos_token_id)
        rows = [end_with_eos(ids, eos, limit)
                for ids in tokenizer(list(sentences), truncation=True, max_length=limit)["input_ids"]]
    else:
        feeds = tokenizer(list(sentences), padding=True, truncation=True, max_length=info["max_length"],
                          return_tensors="np")
        return {n: np.asarray(feeds[n], dtype=np.int64) for n in info["inputs"]}
    feeds = tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="np")
    return {n: np.asarray(feeds[n], dtype=np.int64) for n in info["inputs"]}


def _tokenizer_reloads(tokenizer, folder: Path, inputs: list[str]) -> bool:
    """Whether ``AutoTokenizer`` loads ``folder``'s tokenizer into one that splits the probe texts as ``tokenizer``
    does and returns every one of the graph's ``inputs``."""
    from transformers import AutoTokenizer

    from fastprompt.integrations._common import TOKENIZER_PROBE

    try:
        loaded = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError):
        return False
    theirs = loaded(TOKENIZER_PROBE)
    return theirs["input_ids"] == tokenizer(TOKENIZER_PROBE)["input_ids"] and all(n in theirs for n in inputs)


def _encoder_vectors(encoder, args: tuple, normalize: bool) -> torch.Tensor:
    """What :meth:`PromptEncoder.encode` returns for the rows ``args`` (one batch, in eval mode)."""
    training = encoder.training
    encoder.eval()
    try:
        with torch.no_grad():
            vec = encoder(*args).float()
    finally:
        encoder.train(training)
    return F.normalize(vec, dim=-1) if normalize else vec


def _check_graph(path: Path, names: list[str], args: tuple, expected: torch.Tensor) -> float:
    """Largest |difference| between onnxruntime's sentence vectors for ``args`` and PyTorch's ``expected``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    got = session.run(["sentence_embedding"], {n: a.numpy() for n, a in zip(names, args)})[0]
    return float((torch.from_numpy(got) - expected).abs().max())


@contextlib.contextmanager
def _quiet_exporter():
    """torch.onnx's progress lines and torch.export's warnings about the model's own code are not the user's
    business; an error still raises."""
    import warnings

    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(_Null()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _Null:
    def write(self, text):
        return len(text)

    def flush(self):
        pass


__all__ = ["export_onnx", "is_onnx_export", "graph_inputs", "check_dtype", "DTYPES", "onnx_refusal",
           "config_refusal", "require_onnx", "OnnxGraph", "export_mode", "exportable_model_types",
           "EXPORTABLE_POOLERS"]
