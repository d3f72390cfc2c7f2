"""SKICSE on two gloo processes equals one process on the global batch (plain step and gradient cache), for both
row layouts: supervised (sent0, sent1, hard_neg, ski) and unsupervised (sent0, sent0, ski: the sentence twice and
its SKI, as ``SKICSE.views_for`` reads a ``sent0,ski`` file).

Each process holds its shard of every view, the SKI view included; the objective contrasts its local anchors
against the all-gathered columns with ``positive_offset`` (the L_ski2 anchors are the local SKIs). Dropout is
off (eval mode), so both sides compute the same function with other shapes (4- vs 8-row forwards, two halves
all-reduced): they differ by rounding alone, compared with the rtol of tests/train/numerics.py ("different
forward") derived from the step's conditioning, with the sentences and the SKIs as anchors. In the unsupervised
layout the two sent0 views are then equal (L_simcse's positive cosine is exactly 1, a term whose gradient is
zero on both sides); the conditioning is that of the distinct views (sent0, ski), whose in-batch negatives, the
gathered columns and L_ski are what the comparison tests. The encoder's attention output is made 10x stronger
as in test_distributed.py: the tiny BERT's [CLS] vectors otherwise have cosines within 2e-6 of each other
(kappa ~ 600) and a prefix gradient of ~1e-5 in all, below any meaningful tolerance.
"""
import itertools
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastprompt.data import Batch
from fastprompt.methods.skicse.objective import SKICSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.objectives import Method, Views
from fastprompt.train.steps import CachedStep, LossSide, PlainStep

from ...gloo import free_port, gloo_group, spawn
from ...train.numerics import assert_same_gradients, conditioning
from ...train.test_distributed import NEGS, PAIRS, _shard, _stronger_attention

pytestmark = pytest.mark.heavy  # two processes

SKIS = ["a guitar has strings", "dogs are animals", "a table is furniture", "red is a colour", "food is eaten",
        "cats are pets", "balls are round", "parks are green"]
LAYOUTS = {"sup": ("sent0", "sent1", "hard_neg", "ski"), "unsup": SKICSE().views_for(("sent0", "ski"))}
SEED, STEP = 11, 2
TEMPERATURE = 0.05


def _setup(model_dir, layout):
    torch.manual_seed(0)
    enc = _stronger_attention(PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, init_std=0.3)))
    enc.eval()
    method = Method(SKICSE(temperature=TEMPERATURE, hard_negative_weight=0.5, backend="reference"))
    rows = [{"sent0": a, "sent1": p, "hard_neg": h, "ski": k} for (a, p), h, k in zip(PAIRS, NEGS, SKIS)]
    views = LAYOUTS[layout]
    tok = enc.tokenize([r[v] for v in views for r in rows])
    batch = Batch(tok["input_ids"], tok["attention_mask"], tok.get("token_type_ids"), n_views=len(views),
                  batch_size=len(rows), view_names=views)
    return enc, method, batch


def _name(layout, cached, rank):
    return f"{layout}-{'cached' if cached else 'plain'}-rank{rank}.safetensors"


def _worker(rank, world, model_dir, port, out_dir):
    with gloo_group(rank, world, port) as ctx:
        for layout, cached in itertools.product(LAYOUTS, (False, True)):
            enc, method, batch = _setup(model_dir, layout)
            side = LossSide(method, enc, ctx)
            step = CachedStep(side, micro_batch_size=3, max_tokens=None) if cached else PlainStep(side)
            out = step(_shard(batch, rank, world), STEP, SEED)
            ctx.all_reduce_gradients(list(enc.trainable_parameters()))
            save_file({"loss": torch.tensor([out.loss]), "grad": enc.prompt.prefix.grad.contiguous()},
                      os.path.join(out_dir, _name(layout, cached, rank)))


@pytest.fixture(scope="module")
def gloo_skicse(tiny_bert_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo-skicse")
    spawn(_worker, (2, str(tiny_bert_dir), free_port(), str(out)))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("cached", [False, True], ids=["plain", "grad-cache"])
def test_two_processes_match_one_with_the_ski_view(tiny_bert_dir, gloo_skicse, layout, cached):
    enc, method, batch = _setup(tiny_bert_dir, layout)
    emb = enc(**batch.model_inputs()).view(batch.n_views, batch.batch_size, -1)
    distinct = [i for i, name in enumerate(batch.view_names) if name not in batch.view_names[:i]]
    rtol = conditioning(emb.detach()[distinct], TEMPERATURE, anchor_views=(0, len(distinct) - 1))
    loss = method.sentence(Views.single(emb, batch.view_names)).loss
    loss.backward()
    ref = {"loss": loss.detach().reshape(1), "grad": enc.prompt.prefix.grad}
    for rank in range(2):
        got = load_file(str(gloo_skicse / _name(layout, cached, rank)))
        assert_same_gradients(ref, got, rtol)
