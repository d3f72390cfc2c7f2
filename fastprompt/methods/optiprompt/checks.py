"""OptiPrompt's rules against the template keys (standard library only: they run when a config is built)."""
from __future__ import annotations


def check_optiprompt(config) -> None:
    """OptiPrompt trains one template's words: it needs a template, and no second one (``config``: a TrainConfig)."""
    if not config.prompt.optiprompt:
        return
    tpl = config.templates
    if tpl.second_template not in (None, tpl.template):
        raise ValueError("optiprompt trains the vectors of one template's words: second_template must be null")
    if not config.uses_template:
        raise ValueError("optiprompt makes the template's words trainable: set template (or pooler=mask/topk)")
