"""Query rows with k negatives through the objective and the trainer: the k negative views are the loss's (k, B, d)
block, padding negatives leave the softmax (text ids), the loss options reach the op, and two processes lay out the
gathered text ids as they lay out the embeddings."""
import json
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.objectives.base import Views
from fastprompt.train import Trainer
from fastprompt.train.distributed import DistributedContext

from ..conftest import make_sentences

NAMES = ("sent0", "sent1", "hard_neg", "hard_neg_2", "hard_neg_3")


def masked_infonce(z, ids, temperature, dims=None, weights=None):
    """Independent reference: each anchor (view 0) against every column of views 1.. (all rows), its positive the
    same row of view 1; a column whose id is negative, or equals the positive's id (other than the positive
    itself), is left out; Matryoshka: the mean over anchors summed over the re-normalised prefixes."""
    n, b, d = z.shape
    total = 0.0
    for dim, w in zip(dims or [d], weights or [1.0] * len(dims or [d])):
        u = F.normalize(z[..., :dim].double(), dim=-1)
        cols, col_ids = u[1:].reshape(-1, dim), ids[1:].reshape(-1)
        logits = u[0] @ cols.T / temperature
        pos = torch.arange(b)
        drop = (col_ids[None, :] < 0) | (col_ids[None, :] == col_ids[pos][:, None])
        drop[pos, pos] = False
        logits = logits.masked_fill(drop, float("-inf"))
        total = total + w * (torch.logsumexp(logits, 1) - logits[pos, pos]).mean()
    return total


@pytest.mark.parametrize("options", [{}, dict(matryoshka_dims=(8, 3), matryoshka_weights=(1.0, 0.5))],
                         ids=["plain", "matryoshka"])
def test_k_negatives_with_padding_equal_the_masked_reference(options):
    torch.manual_seed(0)
    z = torch.randn(5, 6, 8, dtype=torch.float64)
    ids = torch.arange(30).view(5, 6)
    ids[4, 1] = ids[3, 2] = -1  # two padding negatives
    ids[2, 3] = ids[1, 3]  # a row whose first negative repeats its positive's text
    obj = SimCSE(temperature=0.1, backend="reference", **options)
    # float64, the same function summed in another order: the bound of tests/ops/test_contrastive_loss_features.py,
    # (2·7·√M + 2(d + 3)/τ + 16)·u ≈ 3e-14 relative here (M = 24 columns, d = 8, τ = 0.1); 1e-10 is far above it
    # and far below any masking or layout error (a column more or less moves the loss by ~1e-2)
    got = obj(Views(NAMES, z, z, 0, ids)).loss
    want = masked_infonce(z, ids, 0.1, *[list(v) for v in options.values()])
    assert torch.allclose(got, want, rtol=1e-10, atol=0)
    # without ids the padding columns would count: the masked loss differs
    assert not torch.allclose(obj(Views(NAMES, z, z, 0)).loss, want)
    # the C++ kernels, as the trainer runs them on a CPU
    cpu = SimCSE(temperature=0.1, backend="cpu", **options)(Views(NAMES, z, z, 0, ids)).loss
    assert torch.allclose(cpu, want, rtol=1e-10, atol=0)


def test_gathered_columns_keep_each_rows_negatives():
    """Process 1 of 2: its anchors against the gathered columns, offset by its rows; the shares of both processes
    sum to the one-process loss."""
    torch.manual_seed(1)
    z = torch.randn(4, 6, 8, dtype=torch.float64)
    ids = torch.arange(24).view(4, 6)
    ids[3, 4] = -1
    obj = SimCSE(temperature=0.1, backend="reference")
    names = NAMES[:4]
    whole = obj(Views(names, z, z, 0, ids)).loss
    shares = [obj(Views(names, z[:, 3 * r:3 * r + 3], z, 3 * r, ids)).loss * 0.5 for r in range(2)]
    assert torch.allclose(sum(shares), whole, rtol=1e-12, atol=0)


def _ids_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ctx = DistributedContext(rank=rank, world_size=2)
        local = torch.arange(3 * 2).view(3, 2) + 100 * rank  # (views, rows of this process)
        ids = ctx.gather_ids(local)
        emb = ctx.gather_batch(local.double().unsqueeze(-1)).squeeze(-1).long()
        torch.save({"ids": ids, "emb": emb}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.heavy  # two processes
def test_two_processes_gather_text_ids_as_they_gather_embeddings(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ids_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["ids"], got["emb"])
        assert got["ids"].tolist() == [[0, 1, 100, 101], [2, 3, 102, 103], [4, 5, 104, 105]]


@pytest.fixture(scope="module")
def ragged_rows(tmp_path_factory):
    """16 query rows with 1 to 3 negatives each."""
    s = make_sentences(16 * 5, seed=9)
    rows = [{"query": s[5 * i], "pos": [s[5 * i + 1]], "neg": s[5 * i + 2:5 * i + 3 + i % 3]} for i in range(16)]
    path = tmp_path_factory.mktemp("ragged") / "ragged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_trainer_trains_padded_k_negatives_under_the_gradient_cache(base_config, ragged_rows, tiny_sts_dir):
    """k = 3 negatives with padding, the gradient cache, hardness weighting and Matryoshka from the config: batches
    carry 5 views and the padding's text ids, the options reach the op, the run trains (finite losses, the prompt
    moves), and the final STS table is scored at each Matryoshka dimension. (Not fn_margin: the tiny random BERT's
    [CLS] cosines are all within a few 1e-3 of each other, so a GISTEmbed margin masks every negative and nothing
    trains; its config path is tested in test_config.py, the op's mask in tests/ops.)"""
    cfg = base_config(train_file=str(ragged_rows), negatives_per_row=3, pad_negatives=True, micro_batch_size=8,
                      max_steps=3, eval_steps=3, sts_dir=str(tiny_sts_dir), hardness_mode="all_negatives",
                      hardness_strength=5.0, matryoshka_dims=[32, 16])
    trainer = Trainer(cfg)
    trainer.setup()
    assert trainer.examples.columns == NAMES
    _, (dataset, rows) = next(trainer.sampler.iter_from(0))
    batch = trainer.make_batch(rows, 0, dataset)
    assert batch.n_views == 5 and batch.text_ids is not None and (batch.text_ids < 0).any()
    opts = trainer.objective.loss_options()
    assert opts == dict(hardness_mode="all_negatives", hardness_strength=5.0, matryoshka_dims=[32, 16])
    before = {k: v.clone() for k, v in trainer.encoder.prompt_state_dict().items()}
    seen = []
    trainer.callbacks.append(lambda t, out: seen.append(out))
    summary = trainer.train()
    assert summary["status"] == "completed"
    tables = summary["test_matryoshka"]
    assert list(tables) == ["32", "16"] and tables["32"] == pytest.approx(summary["test"])
    assert tables["16"] != tables["32"]
    assert len(seen) == 3 and all(math.isfinite(out.loss) and not out.skipped for out in seen)
    after = trainer.encoder.prompt_state_dict()
    assert any(not torch.equal(before[k], after[k].cpu()) for k in before)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("pad_negatives", [True, False])
def test_a_negative_repeating_its_positive_leaves_the_softmax(base_config, tmp_path, pad_negatives):
    """Issue 40, item 6: rows whose negative is their own positive (none padded) trained that column as a negative,
    with pad_negatives as without (the batches had no text ids): docs/retrieval-data.md says it leaves the row's
    softmax. The batches now carry text ids, which the loss masks by (its masking: the reference test above)."""
    s = make_sentences(16 * 3, seed=11)
    rows = [{"query": s[3 * i], "pos": [s[3 * i + 1]], "neg": [s[3 * i + 1] if i % 2 else s[3 * i + 2]]}
            for i in range(16)]
    cfg = base_config(train_file=str(_jsonl(tmp_path / "rows.jsonl", rows)), negatives_per_row=1,
                      pad_negatives=pad_negatives)
    trainer = Trainer(cfg)
    trainer.setup()
    _, (dataset, batch_rows) = next(trainer.sampler.iter_from(0))
    batch = trainer.make_batch(batch_rows, 0, dataset)
    ids = batch.text_ids.view(batch.n_views, batch.batch_size)
    repeats = [r[1] == r[2] for r in (trainer.datasets[dataset].rows[i] for i in batch_rows)]
    assert any(repeats) and (ids[2] == ids[1]).tolist() == repeats


@pytest.mark.parametrize("pad_negatives", [True, False])
def test_a_nul_text_is_refused_not_trained_as_an_empty_text(tmp_path, pad_negatives):
    """Issue 40, item 6: a JSON "\\u0000" negative was logged as padding and, with pad_negatives=false, trained as
    an empty text; a text holding a NUL anywhere is refused (with pad_negatives, a lone NUL negative is padding)."""
    from fastprompt.train.build import load_examples
    from fastprompt.train.config import TrainConfig

    s = make_sentences(8 * 3, seed=12)
    rows = [{"query": s[3 * i], "pos": [s[3 * i + 1]], "neg": [s[3 * i + 2]]} for i in range(8)]
    rows[2]["neg"] = ["a\u0000b" if pad_negatives else "\u0000"]
    cfg = TrainConfig(train_file=str(_jsonl(tmp_path / "nul.jsonl", rows)), negatives_per_row=1,
                      pad_negatives=pad_negatives)
    with pytest.raises(ValueError, match=r"nul.jsonl:3: the negative holds a NUL character at character "):
        load_examples(cfg)
