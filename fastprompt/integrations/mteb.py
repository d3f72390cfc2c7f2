"""MTEB (2.x) for a fastprompt model: :class:`MTEBEncoder` satisfies ``mteb.models.EncoderProtocol``.

    import mteb
    from fastprompt.integrations.mteb import MTEBEncoder

    model = MTEBEncoder("runs/quickstart/best")             # a prompt checkpoint, or a PromptEncoder
    results = mteb.evaluate(model, mteb.get_tasks(tasks=["STSBenchmark"]))

MTEB hands ``encode`` a DataLoader of batches (``{"text": [...]}``) plus the task's metadata, split, subset and prompt
type; the wrapper flattens the texts and passes everything to :meth:`PromptEncoder.encode`, which accepts those
keywords (a prompt's embedding does not depend on them). Scores use cosine similarity. ``mteb`` is imported only by
:attr:`MTEBEncoder.mteb_model_meta` (MTEB itself calls it), so the module imports without it.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fastprompt.model import PromptEncoder


class MTEBEncoder:
    """A :class:`PromptEncoder` behind MTEB's encoder protocol.

    ``model``: a PromptEncoder, a prompt checkpoint folder, or a base model name/path (the frozen model without a
    prompt). ``name``: MTEB's ``organization/model`` name for the results (default ``fastprompt/<folder or base>``);
    the revision is a digest of the trained weights (the prompt, and a fine-tuned backbone or LoRA adapters), so
    results of different models never share a cache entry.
    ``device`` and ``kwargs`` (e.g. ``pooler``, ``max_length``) go to the loader when ``model`` is a path.
    """

    def __init__(self, model: PromptEncoder | str | os.PathLike, revision: str | None = None, *,
                 name: str | None = None, device: str | None = None, batch_size: int = 64, **kwargs):
        if isinstance(model, PromptEncoder):
            encoder, label = model, Path(str(model.base_model or "model")).name
        else:
            path = Path(model)
            if (path / "fastprompt_config.json").is_file():
                encoder, label = PromptEncoder.load(path, **kwargs), path.resolve().name
            else:
                encoder, label = PromptEncoder.from_pretrained(model, **kwargs), path.name
        if device is not None:
            encoder = encoder.to(device)
        self.encoder = encoder.eval()
        self.name = name or f"fastprompt/{label}"
        self.revision = revision or self._weights_digest()
        self.batch_size = batch_size
        self._meta = None

    def _weights_digest(self) -> str:
        enc = self.encoder
        state = dict(enc.prompt_state_dict())
        if enc.backbone_trained or enc.lora is not None:  # a fine-tuned backbone or LoRA adapters are trained weights
            state.update({f"backbone.{k}": v for k, v in enc.backbone.state_dict().items()
                          if enc.backbone_trained or ".lora_" in k})
        digest = hashlib.sha256()
        for key, value in sorted(state.items()):
            digest.update(key.encode())
            digest.update(value.detach().float().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()[:12]

    def encode(self, inputs, *, task_metadata=None, hf_split: str | None = None, hf_subset: str | None = None,
               prompt_type=None, **kwargs) -> np.ndarray:
        """Embeddings (N, hidden), L2-normalised, of every text in ``inputs`` (MTEB's DataLoader of ``{"text": [...]}``
        batches, or a list of strings)."""
        texts = []
        for item in inputs:
            if isinstance(item, str):
                texts.append(item)
            else:
                texts.extend(item["text"])
        kwargs.setdefault("batch_size", self.batch_size)
        return self.encoder.encode(texts, task_metadata=task_metadata, hf_split=hf_split, hf_subset=hf_subset,
                                   prompt_type=prompt_type, **kwargs)

    def similarity(self, embeddings1, embeddings2) -> torch.Tensor:
        """Cosine similarity matrix (n1, n2)."""
        a, b = (F.normalize(torch.atleast_2d(torch.as_tensor(e)).float(), dim=-1) for e in (embeddings1, embeddings2))
        return a @ b.T

    def similarity_pairwise(self, embeddings1, embeddings2) -> torch.Tensor:
        """Cosine similarity of each row of ``embeddings1`` with the same row of ``embeddings2``."""
        a, b = (F.normalize(torch.atleast_2d(torch.as_tensor(e)).float(), dim=-1) for e in (embeddings1, embeddings2))
        return (a * b).sum(-1)

    @property
    def mteb_model_meta(self):
        """MTEB's ``ModelMeta`` of this model (built on first use; needs ``mteb``)."""
        if self._meta is None:
            from mteb.models import ModelMeta

            enc = self.encoder
            self._meta = ModelMeta.create_empty(overwrites={
                "name": self.name, "revision": self.revision,
                "n_parameters": sum(p.numel() for p in enc.parameters()),
                "max_tokens": enc.max_length or min(enc.tokenizer.model_max_length, 512),
                "embed_dim": enc.hidden_size, "framework": ["PyTorch"], "similarity_fn_name": "cosine",
                "use_instructions": False, "modalities": ["text"],
                "adapted_from": str(enc.base_model) if enc.base_model else None,
            })
        return self._meta
