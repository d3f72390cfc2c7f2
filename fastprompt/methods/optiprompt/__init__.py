"""PromptBERT's OptiPrompt (``optiprompt: true``): the template's words become trainable vectors initialised from
their static embeddings. Its key is the prompt section's ``optiprompt`` (the prompt kind lives with the model:
:class:`fastprompt.model.PromptConfig`, run identity); this method holds its rules against the template keys.
Docs: ``docs/promptbert.md``."""
from fastprompt.methods.optiprompt.checks import check_optiprompt
from fastprompt.methods.registry import MethodSpec, register_method

register_method(MethodSpec("optiprompt", doc="docs/promptbert.md", check=check_optiprompt))
