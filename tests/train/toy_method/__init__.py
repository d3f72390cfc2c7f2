"""A toy method for tests/train/test_add_method.py, written as docs/methods.md's "Adding a method" says: this
folder, and the one registration call below. It brings a config section (``toy_weight``, ``toy_rate``), a
sentence objective (``objective: toy``: alignment only) and a token term (masked-token reconstruction through the
prompted encoder, on while ``toy_weight > 0``). Not a method of any paper."""
from fastprompt.methods import MethodSpec, register_method

from .config import ToyConfig

register_method(MethodSpec("toy", doc="docs/methods.md", section=("toy", ToyConfig, "toy method"),
                           objective="toy_method.objective:ToyAlignment", terms="toy_method.terms:toy_terms"))
