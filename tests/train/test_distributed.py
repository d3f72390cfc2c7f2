"""Two gloo processes on CPU give the same losses and gradients as one process on the global batch.

Each process runs the trainer's step strategy on its shard of the global batch, then the one gradient
all-reduce of a step; its gradients must equal those of a single process on the whole batch. Dropout is off
(processes draw from different RNG streams by design), so the two sides compute the same function with other
shapes (12- vs 24-row forwards, two halves all-reduced): they differ by rounding alone, compared with the rtol of
tests/train/numerics.py ("different forward"), derived from the step's own conditioning.
"""
import copy
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastprompt.data import Batch
from fastprompt.methods.crtd.config import CRTDConfig
from fastprompt.methods.crtd.term import build_crtd_term
from fastprompt.methods.mlm.term import MLMTerm
from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.objectives import Method, WeightSchedule
from fastprompt.ops import contrastive_loss
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.grad_cache import grad_cache_step
from fastprompt.train.steps import CachedStep, LossSide, PlainStep, extras_generators

from ..gloo import free_port, gloo_group, spawn
from .numerics import assert_same_gradients, batchnorm_amplification, conditioning
from .token_term import ReconstructionTerm

PAIRS = [("a man plays the guitar .", "a man plays music"), ("the dog runs", "a dog is running"),
         ("two people sit at a table", "people sit"), ("it is red", "the car is red"),
         ("a woman eats food", "someone is eating"), ("the cat sits", "a cat"),
         ("one big ball", "a small ball"), ("water in the park", "the park has water")]
NEGS = ["the cat runs", "nobody plays", "a table", "blue", "a man sits", "the dog eats", "two cars", "food"]
SEED, STEP = 7, 3
TEMPERATURE, MARGIN = 0.05, 0.2


def _setup(model_dir, with_term):
    """Encoder + method; with_term: D2CSE's BatchNorm-MLP head in training mode and the test token term, or
    "mlm+rtd": that head with DCPCSE's MLM term and D2CSE's CRTD term both on (random replacements)."""
    torch.manual_seed(0)
    if with_term:
        enc = PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, init_std=0.3), pooler="bn_mlp",
                                            mlp="train").train()
        _stronger_attention(enc)
        if with_term == "mlm+rtd":
            terms = [MLMTerm.for_encoder(enc, "tied_new", weight=WeightSchedule(0.5)),
                     build_crtd_term(CRTDConfig(weight=0.5), enc)]
        else:
            terms = [ReconstructionTerm(enc.hidden_size, enc.tokenizer.mask_token_id, WeightSchedule(0.7))]
    else:
        enc = _stronger_attention(PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, init_std=0.3)))
        enc.eval()
        terms = []
    method = Method(SimCSE(temperature=TEMPERATURE, hard_negative_weight=0.5, hinge_weight=1.0, hinge_margin=MARGIN,
                           backend="reference"), terms)
    return enc, method


def _stronger_attention(enc):
    """Without dropout, a random tiny BERT's [CLS] state barely depends on the sentence (std ~3e-3 over rows: its
    attention output is small next to the residual): the [CLS] cosines are within 1e-6 of each other, hardest
    negatives tie within 1e-7 and the prefix gradient is ~1e-5 in all, a step no tolerance could test
    meaningfully, and a BatchNorm head would amplify float noise by ~1/3e-3 (tests/train/numerics.py). A 10x
    stronger attention output makes [CLS] vary like a real encoder's (std ~0.2, cosines <= 0.8)."""
    with torch.no_grad():
        for layer in enc.backbone.encoder.layer:
            layer.attention.self.value.weight.mul_(10)
            layer.attention.output.dense.weight.mul_(10)
    return enc


def _rtol(enc, batch):
    """The rounding rtol of this step (tests/train/numerics.py) from the embeddings the objective sees, after
    checking that the step is well conditioned."""
    with torch.no_grad():
        reps = enc(**batch.model_inputs(), head=False)
        head = enc.pooler.head if enc.pooler.head is not None else torch.nn.Identity()
        amplification = batchnorm_amplification(head, reps)
        emb = copy.deepcopy(head).train()(reps)  # a copy: the BatchNorm running statistics stay as they are
    # With the BatchNorm head (amplification ~50 here, rtol ~1.2e-2), up to 2e-2: the mistakes guarded against
    # (the head applied per process, a term normalised per process, a missing gather) move the gradients by tens
    # of percent (test_without_gathering_the_gradients_differ_by_far_more_than_the_tolerance).
    return conditioning(emb.view(batch.n_views, batch.batch_size, -1), TEMPERATURE, MARGIN,
                        amplification=amplification, max_rtol=2e-2 if amplification > 1 else 1e-3)


def _global_batch(enc, method):
    """(anchor, positive, hard negative) rows view-major, padded together, with the term's extras."""
    texts = [r[v] for v in range(3) for r in [(a, p, h) for (a, p), h in zip(PAIRS, NEGS)]]
    tok = enc.tokenize(texts)
    batch = Batch(tok["input_ids"], tok["attention_mask"], tok.get("token_type_ids"), n_views=3,
                  batch_size=len(PAIRS))
    return method.add_extras(batch, extras_generators(method, SEED))


def _shard(batch, rank, world):
    """Process ``rank``'s rows of every view (what its collator would produce, padded to the global width)."""
    b = batch.batch_size // world
    idx = torch.cat([torch.arange(v * batch.batch_size + rank * b, v * batch.batch_size + (rank + 1) * b)
                     for v in range(batch.n_views)])
    tt = batch.token_type_ids[idx] if batch.token_type_ids is not None else None
    return Batch(batch.input_ids[idx], batch.attention_mask[idx], tt, batch.n_views, b, batch.view_names,
                 {k: v[idx] for k, v in batch.extras.items()})


def _state(enc, method, loss):
    params = {**dict(enc.named_parameters()), **{f"method.{k}": v for k, v in method.named_parameters()}}
    out = {f"grad.{n}": p.grad.clone() for n, p in params.items() if p.grad is not None}
    out.update({f"buffer.{n}": b.clone() for n, b in enc.pooler.named_buffers()})
    out["loss"] = torch.tensor([loss])
    return out


def _step(ctx, enc, method, batch, cached):
    side = LossSide(method, enc, ctx)
    step = CachedStep(side, micro_batch_size=2, max_tokens=None) if cached else PlainStep(side)
    out = step(batch, STEP, SEED)
    ctx.all_reduce_gradients([*enc.trainable_parameters(), *method.parameters()])
    return out


def _worker(rank, world, model_dirs, port, out_dir):
    """Every variant in one process group (spawning costs more than the steps): plain and gradient-cached
    steps, without and with the token term + BatchNorm head."""
    with gloo_group(rank, world, port) as ctx:
        for with_term, model_dir in zip((False, True, "mlm+rtd"), (*model_dirs, model_dirs[1])):
            for cached in (False, True):
                enc, method = _setup(model_dir, with_term)
                out = _step(ctx, enc, method, _shard(_global_batch(enc, method), rank, world), cached)
                save_file(_state(enc, method, out.loss), os.path.join(out_dir, _name(with_term, cached, rank)))


def _name(with_term, cached, rank):
    kind = with_term if isinstance(with_term, str) else "term" if with_term else "simcse"
    return f"{kind}-{'cached' if cached else 'plain'}-rank{rank}.safetensors"


@pytest.fixture(scope="module")
def gloo_runs(tiny_bert_dir, no_dropout_bert, tmp_path_factory):
    """The two processes' losses, gradients and head buffers of every variant."""
    out = tmp_path_factory.mktemp("gloo")
    spawn(_worker, (2, (str(tiny_bert_dir), str(no_dropout_bert)), free_port(), str(out)))
    return out


@pytest.mark.heavy  # two processes
@pytest.mark.parametrize("cached", [False, True], ids=["plain", "grad-cache"])
def test_two_gloo_processes_match_one_process(tiny_bert_dir, gloo_runs, cached):
    """Plain SimCSE with hard negatives, no head: the reference is the objective on one forward."""
    enc, method = _setup(tiny_bert_dir, with_term=False)
    batch = _global_batch(enc, method)
    rtol = _rtol(enc, batch)
    loss = method.sentence(enc(**batch.model_inputs()).view(3, len(PAIRS), -1)).loss
    loss.backward()
    ref = {"loss": loss.detach().reshape(1), "grad.prompt.prefix": enc.prompt.prefix.grad}
    for rank in range(2):
        got = load_file(str(gloo_runs / _name(False, cached, rank)))
        assert_same_gradients(ref, {k: got[k] for k in ref}, rtol)


@pytest.mark.heavy  # two processes
@pytest.mark.parametrize("cached", [False, True], ids=["plain", "grad-cache"])
@pytest.mark.parametrize("with_term", [True, "mlm+rtd"], ids=["test-term", "mlm+rtd"])
def test_two_processes_match_one_with_token_term_and_batchnorm_head(no_dropout_bert, gloo_runs, cached, with_term):
    """The loss-side head sees the whole global batch (BatchNorm statistics and running statistics as one
    process's), and each token term is normalised by the global target count."""
    enc, method = _setup(no_dropout_bert, with_term=with_term)
    batch = _global_batch(enc, method)
    rtol = _rtol(enc, batch)
    ref_out = _step(DistributedContext(), enc, method, batch, cached=False)
    ref = _state(enc, method, ref_out.loss)
    assert {"grad.prompt.prefix", "grad.pooler.head.1.weight", "buffer.head.1.running_var"} <= set(ref)
    stats = ("loss_mlm", "loss_rtd") if with_term == "mlm+rtd" else ("loss_recon",)
    assert all(ref_out.stats[s] > 0 for s in stats), ref_out.stats
    assert all(ref[k].abs().sum() > 0 for k in ref if k.startswith("grad."))
    for rank in range(2):
        assert_same_gradients(ref, load_file(str(gloo_runs / _name(with_term, cached, rank))), rtol)


@pytest.mark.parametrize("with_term", [True, "mlm+rtd"], ids=["test-term", "mlm+rtd"])
def test_without_gathering_the_gradients_differ_by_far_more_than_the_tolerance(no_dropout_bert, with_term):
    """Negative control of the BatchNorm-head comparison's rtol: two processes that each run their half alone
    (their own BatchNorm statistics, term normalisation and negatives) are off by tens of percent."""
    enc, method = _setup(no_dropout_bert, with_term=with_term)
    batch = _global_batch(enc, method)
    rtol = _rtol(enc, batch)
    _step(DistributedContext(), enc, method, batch, cached=False)
    ref = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
    halves = []
    for rank in range(2):
        enc_r, method_r = _setup(no_dropout_bert, with_term=with_term)
        _step(DistributedContext(), enc_r, method_r, _shard(_global_batch(enc_r, method_r), rank, 2), cached=False)
        halves.append({n: p.grad for n, p in enc_r.named_parameters() if p.grad is not None})
    for name in ("prompt.prefix", "pooler.head.0.weight"):
        alone = (halves[0][name] + halves[1][name]) / 2
        assert (alone - ref[name]).abs().max() > 10 * rtol * ref[name].abs().max(), name


def _shutdown_worker(rank, world, port, out_dir):
    from fastprompt.train.distributed import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    ctx = init_distributed("cpu")
    assert ctx.owns_group and ctx.enabled and torch.distributed.is_initialized()
    layer = torch.nn.Linear(3, 1)
    layer(torch.randn(2, 3)).sum().backward()
    ctx.all_reduce_gradients(layer.parameters())  # collective work on gloo's threads just before the teardown
    ctx.shutdown()
    assert not torch.distributed.is_initialized() and not ctx.owns_group
    ctx.shutdown()  # a second call is a no-op
    open(os.path.join(out_dir, f"done{rank}"), "w").close()


@pytest.mark.heavy  # two processes
def test_shutdown_destroys_the_group_init_distributed_created(tmp_path):
    spawn(_shutdown_worker, (2, free_port(), str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done0", "done1"]


def test_shutdown_leaves_a_group_it_did_not_create_alone():
    ctx = DistributedContext(rank=0, world_size=2)  # e.g. a group the user initialised
    assert not ctx.owns_group
    ctx.shutdown()  # must not try to destroy anything


# ------------------------------------------------------------------------------------------------
# the loss's options across processes: each process's anchors against every process's columns

#: A second hard negative per row; "a cat" and "the car is red" repeat positives' texts (false negatives by id).
NEGS2 = ["a cat", "it rains", "the car is red", "green", "a boy", "birds", "one chair", "a lamp"]
OPTION_TEXTS = [[a for a, _ in PAIRS], [p for _, p in PAIRS], NEGS, NEGS2]
#: Every option of the op at once (no hinge: its switch is discontinuous, and the two sides compute the cosines in
#: other orders; the text-id mask is exact). Temperature 0.1 and prefixes of >= 16 of the tiny BERT's 32 dimensions
#: keep the step well conditioned (at 0.05, or with an 8-dimensional prefix, whose cosines reach 0.99, the rounding
#: estimate exceeds 1e-3).
OPTION_TEMPERATURE = 0.1
LOSS_OPTIONS = dict(hardness_mode="all_negatives", hardness_strength=5.0, hard_negative_weight=0.3, symmetric=True,
                    partition_mode="joint", matryoshka_dims=[32, 16], matryoshka_weights=[1.0, 0.5],
                    temperature=OPTION_TEMPERATURE)


def _option_ids():
    """Text ids of the global batch's views (one id per distinct text): (column ids of views 1..3, anchor ids)."""
    flat = [t for view in OPTION_TEXTS for t in view]
    ids = torch.tensor([flat.index(t) for t in flat]).view(4, -1)
    return ids[1:].reshape(-1), ids[0]


def _option_batch(enc):
    tok = enc.tokenize([t for view in OPTION_TEXTS for t in view])
    return Batch(tok["input_ids"], tok["attention_mask"], tok.get("token_type_ids"), n_views=4, batch_size=len(PAIRS))


def _options_loss(ctx, b):
    """This process's share of the global loss from its (4 b, H) embeddings: its anchors against the gathered
    positives and negatives (positive_offset = rank · b), the reverse term against every process's anchors."""
    column_ids, anchor_ids = _option_ids()

    def loss_fn(reps):
        views = reps.view(4, b, -1)
        gathered = ctx.gather_batch(views)
        total = gathered.shape[1]
        loss = contrastive_loss(views[0], gathered[1], gathered[2:], reverse_columns=gathered[0], backend="cpu",
                                column_ids=column_ids, anchor_ids=anchor_ids, positive_offset=ctx.rank * b,
                                **LOSS_OPTIONS)
        return loss * (b / total)

    return loss_fn


def _options_worker(rank, world, model_dir, port, out_dir):
    with gloo_group(rank, world, port) as ctx:
        for cached in (False, True):
            enc, _ = _setup(model_dir, with_term=False)
            local = _shard(_option_batch(enc), rank, world)
            loss_fn = _options_loss(ctx, local.batch_size)
            if cached:
                loss = grad_cache_step(enc, local.model_inputs(), loss_fn, micro_batch_size=3).loss
            else:
                loss = loss_fn(enc(**local.model_inputs()))
                loss.backward()
            ctx.all_reduce_gradients(enc.trainable_parameters())
            state = {"grad.prompt.prefix": enc.prompt.prefix.grad, "loss": ctx.sum(loss.detach()).reshape(1)}
            save_file(state, os.path.join(out_dir, f"options-{'cached' if cached else 'plain'}-rank{rank}.safetensors"))


@pytest.fixture(scope="module")
def gloo_option_runs(tiny_bert_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo-options")
    spawn(_options_worker, (2, str(tiny_bert_dir), free_port(), str(out)))
    return out


@pytest.mark.heavy  # two processes
@pytest.mark.parametrize("cached", [False, True], ids=["plain", "grad-cache"])
def test_two_processes_match_one_with_loss_options(tiny_bert_dir, gloo_option_runs, cached):
    """k = 2 negatives per row, hardness weighting, the text-id false-negative mask, the joint symmetric loss (its
    reverse term over the gathered anchors) and two Matryoshka dimensions: two processes, with and without the
    gradient cache, give the loss and prompt gradient of one process on the global batch. The rtol is the
    "different forward" one (tests/train/numerics.py) of the most ill-conditioned prefix, at the logits' effective
    temperature 1 / (1 / τ + hardness_strength)."""
    enc, _ = _setup(tiny_bert_dir, with_term=False)
    batch = _option_batch(enc)
    column_ids, anchor_ids = _option_ids()
    emb = enc(**batch.model_inputs()).view(4, len(PAIRS), -1)
    loss = contrastive_loss(emb[0], emb[1], emb[2:], backend="reference", column_ids=column_ids,
                            anchor_ids=anchor_ids, **LOSS_OPTIONS)
    loss.backward()
    ref = {"loss": loss.detach().reshape(1), "grad.prompt.prefix": enc.prompt.prefix.grad}
    effective = 1.0 / (1.0 / OPTION_TEMPERATURE + LOSS_OPTIONS["hardness_strength"])
    rtol = max(conditioning(emb.detach()[..., :dim], effective) for dim in LOSS_OPTIONS["matryoshka_dims"])
    for rank in range(2):
        got = load_file(str(gloo_option_runs / f"options-{'cached' if cached else 'plain'}-rank{rank}.safetensors"))
        assert_same_gradients(ref, got, rtol)
