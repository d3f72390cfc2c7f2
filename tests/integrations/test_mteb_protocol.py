"""MTEB 2.x: PromptEncoder.encode takes MTEB's keywords; MTEBEncoder passes mteb's own protocol check and its mock
tasks (in-memory data: nothing is downloaded)."""
import inspect
import logging

import numpy as np
import pytest
import torch

from fastprompt.integrations.mteb import MTEBEncoder
from fastprompt.model import PromptConfig, PromptEncoder

SENTENCES = ["a man plays guitar on the street", "the dog", "two people sitting at a table with water ."]


@pytest.fixture(scope="module")
def encoder(tiny_bert_dir):
    torch.manual_seed(0)
    return PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=3)).eval()


def test_encode_accepts_the_keywords_mteb_passes(encoder, caplog):
    # Bit-for-bit comparisons only between the same batches: another batching pads to other lengths, and the
    # matrix products of other shapes may round differently (they do under MKL_CBWR=COMPATIBLE).
    expected = encoder.encode(SENTENCES, batch_size=2)
    got = encoder.encode(SENTENCES, task_metadata=object(), hf_split="test", hf_subset="default",
                         prompt_type="query", batch_size=2, show_progress_bar=False, precision="float32")
    np.testing.assert_array_equal(got, expected)
    with caplog.at_level(logging.WARNING):
        np.testing.assert_array_equal(encoder.encode(SENTENCES, request_qid="q1"), encoder.encode(SENTENCES))
    assert "ignores the keyword arguments request_qid" in caplog.text
    with pytest.raises(ValueError, match="precision 'int8' is not supported"):
        encoder.encode(SENTENCES, precision="int8")


def test_wrapper_has_the_protocol_surface_without_mteb(encoder):
    """Structural check that needs no mteb: the members and keyword names of mteb's EncoderProtocol."""
    wrapper = MTEBEncoder(encoder)
    params = inspect.signature(wrapper.encode).parameters
    for name in ("task_metadata", "hf_split", "hf_subset", "prompt_type"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    batches = [{"text": SENTENCES[:2]}, {"text": SENTENCES[2:]}]  # what MTEB's DataLoader yields
    emb = wrapper.encode(batches, task_metadata=None, hf_split="test", hf_subset="default")
    np.testing.assert_array_equal(emb, encoder.encode(SENTENCES))
    sim = wrapper.similarity(emb, emb)
    torch.testing.assert_close(torch.diagonal(sim), torch.ones(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(wrapper.similarity_pairwise(emb, emb[::-1].copy()),
                               sim[torch.arange(3), torch.tensor([2, 1, 0])], atol=1e-6, rtol=0)
    assert len(wrapper.revision) == 12


#: One mock task of each kind MTEB runs on text encoders (each calls encode differently: queries/documents, pairs, ...)
MOCK_TASKS = ("MockSTSTask", "MockRetrievalTask", "MockRerankingTask", "MockClassificationTask", "MockClusteringTask",
              "MockPairClassificationTask", "MockBitextMiningTask")


def test_mteb_accepts_the_wrapper_and_runs_its_mock_tasks(encoder):
    mteb = pytest.importorskip("mteb", reason="mteb is not installed")
    from mteb.mocks import ALL_MOCK_TASK_TEST_GRID
    from mteb.models import EncoderProtocol

    wrapper = MTEBEncoder(encoder, name="fastprompt/tiny-test")
    assert isinstance(wrapper, EncoderProtocol)
    meta = wrapper.mteb_model_meta
    assert (meta.name, meta.embed_dim, meta.similarity_fn_name) == ("fastprompt/tiny-test", 32, "cosine")
    tasks = [t for t in ALL_MOCK_TASK_TEST_GRID if t.metadata.name in MOCK_TASKS]
    assert len(tasks) == len(MOCK_TASKS)
    results = mteb.evaluate(wrapper, tasks, cache=None, show_progress_bar=False, raise_error=True)
    assert results.model_name == "fastprompt/tiny-test"
    assert sorted(r.task_name for r in results.task_results) == sorted(MOCK_TASKS)
    assert all(np.isfinite(r.get_score()) for r in results.task_results)


@pytest.mark.slow
def test_mteb_mock_run_passes_every_text_task(encoder):
    """mteb.mock_run: all 28 text mock tasks (about a minute on two busy cores)."""
    mteb = pytest.importorskip("mteb", reason="mteb is not installed")
    run = mteb.mock_run(MTEBEncoder(encoder))
    assert run.all_passed, run.to_markdown()


def test_wrapper_loads_a_checkpoint_folder(encoder, tmp_path):
    ckpt = encoder.save(tmp_path / "my-prompt")
    wrapper = MTEBEncoder(str(ckpt))
    assert wrapper.name == "fastprompt/my-prompt"
    assert wrapper.revision == MTEBEncoder(encoder).revision  # the same prompt, the same revision
    np.testing.assert_allclose(wrapper.encode(SENTENCES, task_metadata=None, hf_split="test", hf_subset="default"),
                               encoder.encode(SENTENCES), atol=1e-6, rtol=0)
