"""Use fastprompt prompts where people already work, and bring theirs in.

One module per integration, each imported only when used (``import fastprompt.integrations`` loads nothing heavy,
and an integration's own library is needed only by that integration); their commands, ``fastprompt export`` and
``fastprompt import``, are in :mod:`fastprompt.cli.integrations`:

- :mod:`~fastprompt.integrations.sentence_transformers` — :func:`export_sentence_transformers`: a folder that
  ``SentenceTransformer(folder, trust_remote_code=True)`` loads, with a model card (needs ``sentence-transformers``)
- :mod:`~fastprompt.integrations.peft` — :func:`export_peft` / :func:`import_peft`: PEFT's prefix-tuning adapter
  layout, both ways (no ``peft`` needed)
- :mod:`~fastprompt.integrations.peft_attention` — :func:`accelerate_peft` / :func:`restore_peft`: a PEFT
  prefix-tuning model runs fastprompt's fused prefix attention (needs ``peft``)
- :mod:`~fastprompt.integrations.st_loss` — ``MultipleNegativesRankingLoss``, ``CachedMultipleNegativesRankingLoss``
  and the symmetric variants: sentence-transformers losses computed by fastprompt's fused contrastive loss
  (needs ``sentence-transformers``)
- :mod:`~fastprompt.integrations.onnx` — :func:`export_onnx`: one ONNX graph with the prefix baked in, served by
  onnxruntime without PyTorch (needs ``onnx``, ``onnxscript``, ``onnxruntime``: ``fastprompt[onnx]``)
- :mod:`~fastprompt.integrations.mteb` — :class:`MTEBEncoder`: MTEB 2.x's encoder protocol (``mteb`` optional)
- :mod:`~fastprompt.integrations.papers` — :func:`import_promcse`: PromCSE/DCPCSE checkpoints of the papers' code
"""
from typing import TYPE_CHECKING

from fastprompt._lazy import lazy_getattr

if TYPE_CHECKING:  # the definitions, for type checkers and IDEs; at run time a name loads on first use
    from fastprompt.integrations.mteb import MTEBEncoder as MTEBEncoder
    from fastprompt.integrations.onnx import export_onnx as export_onnx
    from fastprompt.integrations.papers import import_promcse as import_promcse
    from fastprompt.integrations.peft import export_peft as export_peft
    from fastprompt.integrations.peft import import_peft as import_peft
    from fastprompt.integrations.peft_attention import accelerate_peft as accelerate_peft
    from fastprompt.integrations.peft_attention import restore_peft as restore_peft
    from fastprompt.integrations.sentence_transformers import PromptEncoderModule as PromptEncoderModule
    from fastprompt.integrations.sentence_transformers import (
        export_sentence_transformers as export_sentence_transformers,
    )
    from fastprompt.integrations.st_loss import CachedMultipleNegativesRankingLoss as CachedMultipleNegativesRankingLoss
    from fastprompt.integrations.st_loss import (
        CachedMultipleNegativesSymmetricRankingLoss as CachedMultipleNegativesSymmetricRankingLoss,
    )
    from fastprompt.integrations.st_loss import MultipleNegativesRankingLoss as MultipleNegativesRankingLoss
    from fastprompt.integrations.st_loss import (
        MultipleNegativesSymmetricRankingLoss as MultipleNegativesSymmetricRankingLoss,
    )

_LAZY = {
    "export_sentence_transformers": "fastprompt.integrations.sentence_transformers",
    "PromptEncoderModule": "fastprompt.integrations.sentence_transformers",
    "export_peft": "fastprompt.integrations.peft",
    "import_peft": "fastprompt.integrations.peft",
    "MTEBEncoder": "fastprompt.integrations.mteb",
    "export_onnx": "fastprompt.integrations.onnx",
    "import_promcse": "fastprompt.integrations.papers",
    "accelerate_peft": "fastprompt.integrations.peft_attention",
    "restore_peft": "fastprompt.integrations.peft_attention",
    "MultipleNegativesRankingLoss": "fastprompt.integrations.st_loss",
    "MultipleNegativesSymmetricRankingLoss": "fastprompt.integrations.st_loss",
    "CachedMultipleNegativesRankingLoss": "fastprompt.integrations.st_loss",
    "CachedMultipleNegativesSymmetricRankingLoss": "fastprompt.integrations.st_loss",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
