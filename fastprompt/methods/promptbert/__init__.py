"""PromptBERT's training side: every sentence wrapped in a template and pooled at its [MASK] (pooler mask, or
topk), the views' templates and template denoising. Keys: the ``templates`` section
(:class:`.config.TemplateConfig`); its batches and training forward: :mod:`.training` (each row wrapped in, and
pooled at, its view's template). Docs: ``docs/promptbert.md``."""
from fastprompt.methods.promptbert.config import TemplateConfig, check_template_settings
from fastprompt.methods.registry import MethodSpec, register_method

register_method(MethodSpec("promptbert", doc="docs/promptbert.md",
                           section=("templates", TemplateConfig, "templates (PromptBERT)"),
                           check=check_template_settings, collator="fastprompt.methods.promptbert.training:collator",
                           embed="fastprompt.methods.promptbert.training:embedder"))
