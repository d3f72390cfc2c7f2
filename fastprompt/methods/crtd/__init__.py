"""D2CSE's conditional replaced-token detection (CRTD, on while ``rtd_weight > 0``): a discriminator through the
(prompted) encoder tells which tokens a generator replaced, conditioned on the sentence embedding. Keys: the
``rtd`` section (:class:`~fastprompt.methods.crtd.config.CRTDConfig`); the term:
:class:`fastprompt.methods.crtd.term.CRTDTerm`; its data preparation: replacements made ahead of training
(:mod:`fastprompt.data.replacements`, ``fastprompt make-replacements``). Docs: ``docs/crtd.md``."""
from fastprompt.methods.crtd.commands import add_make_replacements_parser
from fastprompt.methods.crtd.config import CRTDConfig
from fastprompt.methods.registry import MethodSpec, register_method

register_method(MethodSpec("crtd", doc="docs/crtd.md", section=("rtd", CRTDConfig, "replaced-token detection term"),
                           terms="fastprompt.methods.crtd.terms:crtd_terms",
                           commands={"make-replacements": add_make_replacements_parser}))
