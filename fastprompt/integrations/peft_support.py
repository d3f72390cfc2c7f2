"""Where PEFT's prefix tuning runs: the check that export, import and ``accelerate_peft`` share (its own module, so
that :mod:`.peft` and :mod:`.peft_attention` both read it without importing each other). The reasons are the model
families' (:attr:`fastprompt.model.arch.Family.peft`)."""
from __future__ import annotations


def peft_refusal(model_type: str | None) -> str | None:
    """Why PEFT's prefix tuning does not run on ``model_type`` (peft 0.21.2, transformers 5.24; each tested), None
    when it does (or fastprompt does not know the family)."""
    from fastprompt.model.arch import FAMILIES

    family = FAMILIES.get(model_type)
    return None if family is None else family.peft


def check_peft_runs(model_type: str | None, consequence: str) -> None:
    """ValueError when PEFT's prefix tuning does not run on ``model_type`` (:func:`peft_refusal`), giving the reason
    and then ``consequence`` (what that means for the caller)."""
    reason = peft_refusal(model_type)
    if reason is not None:
        raise ValueError(f"PEFT's prefix tuning does not run on {model_type!r} models ({reason}), "
                         f"so {consequence}")
