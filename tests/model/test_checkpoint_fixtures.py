"""Checkpoints written by an earlier version of fastprompt (tests/fixtures/checkpoints_v1, made once by
tests/fixtures/make_checkpoints_v1.py before the encoder was split into backbone, prompt and pooler) load onto
their base model and encode exactly as they did then: a format or refactoring change that breaks users' saved
prompts fails here."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastprompt import PromptEncoder

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints_v1"
SENTENCES = ["A man plays the guitar.", "the dog runs in the park", "two people sit at a table with water", "a"]
EXPECTED = load_file(str(FIXTURES / "expected.safetensors"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_checkpoint_of_the_v1_format_loads_and_encodes_as_it_did(name):
    enc = PromptEncoder.load(FIXTURES / name, base_model=FIXTURES / "base")
    got = torch.from_numpy(enc.encode(SENTENCES, normalize=False))
    # The fixtures' vectors were computed by the same float32 operations in another code arrangement; a refactor
    # may reassociate a sum (a bias added in another order, a fused product): each such change moves a value by
    # about one float32 ulp (6e-8 relative), and through two layers of hidden size 32 with LayerNorm the
    # accumulated difference stays orders of magnitude below 1e-5 of the vectors' O(1) entries. A format that no
    # longer loads, or loads a tensor into the wrong place, changes them by O(1).
    torch.testing.assert_close(got, EXPECTED[name], rtol=1e-5, atol=1e-5)


def test_every_fixture_is_checked():
    folders = {p.name for p in FIXTURES.iterdir() if p.is_dir()} - {"base"}
    assert folders == set(EXPECTED)
