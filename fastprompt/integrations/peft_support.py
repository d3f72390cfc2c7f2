"""Where PEFT's prefix tuning runs: the one list that export, import and ``accelerate_peft`` consult (its own module,
so that :mod:`.peft` and :mod:`.peft_attention` both read it without importing each other)."""
from __future__ import annotations

#: model_type -> why PEFT's prefix tuning does not run it (peft 0.21.2, transformers 5.24; each tested): export
#: refuses to write an adapter PEFT cannot apply, and accelerate_peft has no PEFT behaviour to reproduce
PEFT_FAILS = {
    "distilbert": "PEFT cannot size its prefix (DistilBertConfig has no hidden_size: 'Please specify token_dim') "
                  "and DistilBERT takes no key/value cache",
    "modernbert": "ModernBERT does not take PEFT's key/value cache (its mask keeps the token length: a size "
                  "mismatch at the first forward)",
    "mpnet": "MPNet computes attention in its own modules and its position bias does not cover PEFT's cache (a size "
             "mismatch at the first forward)",
}


def check_peft_runs(model_type: str | None, consequence: str) -> None:
    """ValueError when PEFT's prefix tuning does not run on ``model_type`` (:data:`PEFT_FAILS`), giving the reason
    and then ``consequence`` (what that means for the caller)."""
    if model_type in PEFT_FAILS:
        raise ValueError(f"PEFT's prefix tuning does not run on {model_type!r} models ({PEFT_FAILS[model_type]}), "
                         f"so {consequence}")
