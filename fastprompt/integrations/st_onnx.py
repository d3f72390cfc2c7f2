"""sentence-transformers with ``backend="onnx"``: the ONNX graph inside a sentence-transformers export, run by
onnxruntime.

``fastprompt export --to sentence-transformers --onnx`` writes, beside the PyTorch model, the subfolder ``onnx/``
(sentence-transformers' place for a model's ONNX graph): a complete ``--to onnx`` export (``model.onnx`` with the
prefix, pooler and head baked in, its tokenizer and ``fastprompt_onnx.json``). Loaded with
``SentenceTransformer(folder, backend="onnx", trust_remote_code=True)``, the first module
(:class:`~fastprompt.integrations.sentence_transformers.PromptEncoderModule`) becomes an
:class:`OnnxPromptModule`: the graph in an onnxruntime session and the tokenizer saved beside it, no PyTorch
weights loaded.

Why not sentence-transformers' own ONNX backend: it loads a ``Transformer`` module's graph through optimum's
``ORTModelForFeatureExtraction`` (optimum-onnx), reads its ``last_hidden_state`` and pools it in its ``Pooling``
module. optimum-onnx 0.1.0, the newest release, requires transformers < 4.58 and fails to import with transformers 5
(``is_offline_mode`` moved), which fastprompt requires; and its pooling cannot express fastprompt's template
(``mask``) or ``bn_mlp`` poolers or its heads. So the module runs the graph itself; its ``sentence_embedding`` is
the pooled vector, the same graph as ``--to onnx`` (docs/deploy.md).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from sentence_transformers.base.modules import InputModule

from fastprompt.integrations.onnx import CONFIG_FILE, GRAPH_FILE, graph_inputs, is_onnx_export, require_onnx

logger = logging.getLogger(__name__)

#: the subfolder of a sentence-transformers export that holds its ONNX graph (sentence-transformers' convention)
ONNX_SUBFOLDER = "onnx"


class OnnxPromptModule(InputModule):
    """A sentence-transformers input module running a fastprompt ONNX export (``folder``: the ``onnx/`` subfolder)
    with onnxruntime: tokenisation by :func:`~fastprompt.integrations.onnx.graph_inputs`, then the graph's
    ``sentence_embedding`` (and ``token_embeddings``). ``provider``: onnxruntime's execution provider."""

    def __init__(self, folder: str | os.PathLike, provider: str = "CPUExecutionProvider"):
        super().__init__()
        import onnxruntime as ort
        from transformers import AutoTokenizer

        from fastprompt.io import read_json

        require_onnx()
        self.folder = Path(folder)
        self.info = read_json(self.folder / CONFIG_FILE, CONFIG_FILE)
        # the tokenizer files the export wrote: no code from the folder runs, whatever sentence-transformers was given
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.folder), trust_remote_code=False)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(self.folder / GRAPH_FILE), options, providers=[provider])

    @property
    def max_seq_length(self) -> int:
        return self.info["max_length"]

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        if value == self.info["max_length"]:
            return
        raise ValueError("the ONNX graph's max_length is fixed at export (fastprompt_onnx.json); export again with "
                         "--max-length to change it")

    def get_embedding_dimension(self) -> int:
        return self.info["dimension"]

    def preprocess(self, inputs, prompt: str | None = None, **kwargs) -> dict[str, torch.Tensor]:
        texts = list(inputs)
        if prompt:
            texts = self._prepend_prompt(texts, prompt)
        return {n: torch.from_numpy(a) for n, a in graph_inputs(self.tokenizer, self.info, texts).items()}

    def forward(self, features: dict, **kwargs) -> dict:
        feeds = {n: features[n].cpu().numpy() for n in self.info["inputs"]}
        sentence, tokens = self.session.run(["sentence_embedding", "token_embeddings"], feeds)
        features["sentence_embedding"] = torch.from_numpy(sentence)
        features["token_embeddings"] = torch.from_numpy(tokens)
        return features

    def save(self, output_path: str, *args, **kwargs) -> None:
        raise NotImplementedError("a sentence-transformers model loaded with backend='onnx' is saved by the "
                                  "fastprompt export that made it (fastprompt export --to sentence-transformers "
                                  "--onnx); load the folder with the torch backend to save it")

    @classmethod
    def from_export(cls, folder: str | os.PathLike, model_kwargs: dict | None = None) -> "OnnxPromptModule":
        """The module for the sentence-transformers export at ``folder`` (its ``onnx/`` subfolder); a clear error
        when the export has none. ``model_kwargs``' ``provider`` picks onnxruntime's execution provider."""
        onnx_dir = Path(folder) / ONNX_SUBFOLDER
        if not is_onnx_export(onnx_dir):
            raise ValueError(f"{folder} holds no ONNX graph of fastprompt ({onnx_dir / CONFIG_FILE} is missing): "
                             "export it with fastprompt export --to sentence-transformers --onnx, or load it with "
                             "backend='torch'")
        provider = (model_kwargs or {}).get("provider", "CPUExecutionProvider")
        return cls(onnx_dir, provider=provider)


def check_onnx_possible(prompt, dtype: str) -> None:
    """Before a sentence-transformers export with ``onnx`` writes anything: the ONNX packages are there, ``dtype``
    is one the export writes, and nothing in ``prompt`` (a checkpoint folder, checked from its config; a loaded
    encoder; None: nothing to check yet) is refused by the ONNX export (ValueError naming it)."""
    from fastprompt.integrations.onnx import check_dtype, config_refusal, onnx_refusal
    from fastprompt.model.checkpoint import read_checkpoint_config

    require_onnx()
    check_dtype(dtype)
    if prompt is None:
        return
    if isinstance(prompt, (str, os.PathLike)):
        refusal = config_refusal(read_checkpoint_config(Path(prompt)))
    else:
        refusal = onnx_refusal(prompt)
    if refusal is not None:
        raise ValueError(f"cannot add the ONNX graph (--onnx) to the sentence-transformers export: {refusal}")


def write_onnx_subfolder(encoder, folder: Path, *, normalize: bool, dtype: str) -> Path:
    """The ONNX export of ``encoder`` as ``folder/onnx`` (the whole ``--to onnx`` folder)."""
    from fastprompt.integrations.onnx import export_onnx

    return export_onnx(encoder, Path(folder) / ONNX_SUBFOLDER, normalize=normalize, dtype=dtype)


__all__ = ["OnnxPromptModule", "ONNX_SUBFOLDER", "check_onnx_possible", "write_onnx_subfolder"]
