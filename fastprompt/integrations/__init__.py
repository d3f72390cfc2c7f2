"""Use fastprompt prompts where people already work, and bring theirs in.

One module per integration, each imported only when used (``import fastprompt.integrations`` loads nothing heavy,
and an integration's own library is needed only by that integration):

- :mod:`~fastprompt.integrations.sentence_transformers` — :func:`export_sentence_transformers`: a folder that
  ``SentenceTransformer(folder, trust_remote_code=True)`` loads, with a model card (needs ``sentence-transformers``)
- :mod:`~fastprompt.integrations.peft` — :func:`export_peft` / :func:`import_peft`: PEFT's prefix-tuning adapter
  layout, both ways (no ``peft`` needed)
- :mod:`~fastprompt.integrations.mteb` — :class:`MTEBEncoder`: MTEB 2.x's encoder protocol (``mteb`` optional)
- :mod:`~fastprompt.integrations.papers` — :func:`import_promcse`: PromCSE/DCPCSE checkpoints of the papers' code
- :mod:`~fastprompt.integrations.cli` — ``fastprompt export`` and ``fastprompt import``
"""
import importlib

_LAZY = {
    "export_sentence_transformers": "fastprompt.integrations.sentence_transformers",
    "PromptEncoderModule": "fastprompt.integrations.sentence_transformers",
    "export_peft": "fastprompt.integrations.peft",
    "import_peft": "fastprompt.integrations.peft",
    "MTEBEncoder": "fastprompt.integrations.mteb",
    "import_promcse": "fastprompt.integrations.papers",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fastprompt.integrations' has no attribute {name!r}")
