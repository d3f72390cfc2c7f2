"""Packed batches in the trainer's steps: the plain step, the gradient cache and two gloo processes, each with the
encoder packed (the trainer's default, ``encoder.packed: null``), give the losses and gradients of one process's
padded plain step on the global batch.

Dropout is off (tests/train/test_distributed.py's setups: the hidden dropout of the tiny BERT stays, but the steps
run in eval mode where it does not act; the BatchNorm-head variant has dropout 0 in its config), so the two sides
compute the same function with other shapes (N real tokens instead of B x S rows, micro-batches, two halves):
rounding alone, compared with the "different forward" rtol of tests/train/numerics.py, derived from the step's own
conditioning. Every variant includes the term forwards (the reconstruction term and DCPCSE's MLM + D2CSE's CRTD
run their own packed encoder passes, CRTD with its conditional input at each sequence's first token).
~40 s on 2 shared cores (one spawn of two processes).
"""
import os

import pytest
from safetensors.torch import load_file, save_file

from fastprompt.train.distributed import DistributedContext

from ..gloo import free_port, gloo_group, spawn
from .numerics import assert_same_gradients
from .test_distributed import _global_batch, _rtol, _setup, _shard, _state, _step

VARIANTS = [(False, False), (False, True), ("mlm+rtd", False), ("mlm+rtd", True)]
IDS = ["simcse-plain", "simcse-grad-cache", "mlm+rtd-plain", "mlm+rtd-grad-cache"]


def _model(tiny_bert_dir, no_dropout_bert, with_term):
    return no_dropout_bert if with_term else tiny_bert_dir


def _packed_setup(model_dir, with_term):
    enc, method = _setup(model_dir, with_term)
    assert enc.packing_refusal() is None
    return enc.pack_sequences(), method


def _reference(model_dir, with_term):
    """One process, the padded plain step on the global batch."""
    enc, method = _setup(model_dir, with_term)
    batch = _global_batch(enc, method)
    assert not batch.attention_mask.bool().all()  # the batch pads: packing has work to drop
    rtol = _rtol(enc, batch)
    out = _step(DistributedContext(), enc, method, batch, cached=False)
    return _state(enc, method, out.loss), rtol


@pytest.mark.parametrize("with_term,cached", VARIANTS, ids=IDS)
def test_packed_steps_give_the_padded_losses_and_gradients(tiny_bert_dir, no_dropout_bert, with_term, cached):
    model_dir = _model(tiny_bert_dir, no_dropout_bert, with_term)
    ref, rtol = _reference(model_dir, with_term)
    enc, method = _packed_setup(model_dir, with_term)
    out = _step(DistributedContext(), enc, method, _global_batch(enc, method), cached=cached)
    got = _state(enc, method, out.loss)
    assert "grad.prompt.prefix" in ref
    assert_same_gradients(ref, got, rtol)


def _worker(rank, world, model_dirs, port, out_dir):
    with gloo_group(rank, world, port) as ctx:
        for (with_term, cached), name in zip(VARIANTS, IDS):
            enc, method = _packed_setup(model_dirs[bool(with_term)], with_term)
            out = _step(ctx, enc, method, _shard(_global_batch(enc, method), rank, world), cached)
            save_file(_state(enc, method, out.loss), os.path.join(out_dir, f"{name}-rank{rank}.safetensors"))


@pytest.fixture(scope="module")
def packed_gloo_runs(tiny_bert_dir, no_dropout_bert, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed-gloo")
    spawn(_worker, (2, (str(tiny_bert_dir), str(no_dropout_bert)), free_port(), str(out)))
    return out


@pytest.mark.heavy  # two processes
@pytest.mark.parametrize("with_term,cached", VARIANTS, ids=IDS)
def test_two_packed_processes_give_the_padded_losses_and_gradients(tiny_bert_dir, no_dropout_bert, packed_gloo_runs,
                                                                   with_term, cached):
    ref, rtol = _reference(_model(tiny_bert_dir, no_dropout_bert, with_term), with_term)
    name = IDS[VARIANTS.index((with_term, cached))]
    for rank in range(2):
        assert_same_gradients(ref, load_file(str(packed_gloo_runs / f"{name}-rank{rank}.safetensors")), rtol)
