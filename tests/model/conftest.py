"""The model tests' own fixtures: the real MPNet folder and the two-thread setting of the real-model tests. The tiny
masked-LM backbones (``tiny_bert_mlm_dir``, ``tiny_roberta_bpe_dir``) are tests/conftest.py's, shared with the
PromptBERT method's tests."""
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def mpnet_dir() -> Path:
    """The real all-mpnet-base-v2, assembled offline by ``bash ../shared/models/fetch-mpnet.sh`` (into
    $FASTPROMPT_MODELS or ~/.cache/fastprompt-models)."""
    import os

    root = Path(os.environ.get("FASTPROMPT_MODELS") or Path.home() / ".cache" / "fastprompt-models")
    path = root / "all-mpnet-base-v2"
    if not (path / ".complete").is_file():
        pytest.skip(f"all-mpnet-base-v2 is not at {path}: assemble it with bash ../shared/models/fetch-mpnet.sh")
    return path


@pytest.fixture
def two_threads():
    """The real models' tests run on two threads, whatever the suite set before."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)
