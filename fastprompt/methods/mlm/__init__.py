"""DCPCSE's auxiliary masked-language-model term (``do_mlm: true``): ``weight(step) * MLM loss`` through the
prompted encoder. Keys: the ``mlm`` section (:class:`~fastprompt.methods.mlm.config.MLMConfig`, every key run
identity); the term: :class:`fastprompt.methods.mlm.term.MLMTerm`, built by :func:`.terms.mlm_terms`.
Docs: ``docs/mlm.md``."""
from fastprompt.methods.mlm.config import MLMConfig
from fastprompt.methods.registry import MethodSpec, register_method

register_method(MethodSpec("mlm", doc="docs/mlm.md", section=("mlm", MLMConfig, "MLM term"),
                           terms="fastprompt.methods.mlm.terms:mlm_terms"))
