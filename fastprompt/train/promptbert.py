"""PromptBERT's training side now lives with its method, :mod:`fastprompt.methods.promptbert.training`; this
module keeps the old import path."""
from fastprompt.methods.promptbert.training import (
    TemplateCollator,
    TemplateViewEmbedder,
    check_token_budget,
    template_collator,
    template_embedder,
    view_templates,
)

__all__ = ["TemplateCollator", "TemplateViewEmbedder", "check_token_budget", "template_collator",
           "template_embedder", "view_templates"]
