"""Building what a training run needs from its :class:`~fastprompt.train.config.TrainConfig`.

Data (examples, batch sampler, collator), the encoder, the method (objective + token terms), the optimizer
with its schedule and loss scaler, the step strategy, and the STS-B dev data. Each function reads only the
config sections it needs, so the trainer's setup reads as a list of what a run is made of.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastprompt.data import Collator, TrainExamples, UniqueBatchSampler, load_train_file, sentence_keys
from fastprompt.data.multi import MultiDatasetSampler
from fastprompt.data.retrieval import fewest_distinct
from fastprompt.methods import METHODS, load, objective_sections
from fastprompt.objectives.base import Method, TokenTerm
from fastprompt.objectives.registry import objective_from_config
from fastprompt.train.config import TrainConfig
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.steps import CachedStep, LossSide, PlainStep

logger = logging.getLogger(__name__)

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def load_examples(cfg: TrainConfig, path: str | None = None) -> TrainExamples:
    """The rows of ``path`` (default: ``train_file``), read as the config's data section says."""
    d = cfg.data
    ex = load_train_file(path or d.train_file, fmt=d.train_format, on_decode_error=d.on_decode_error,
                         negatives_per_row=d.negatives_per_row, pad_negatives=d.pad_negatives, seed=cfg.run.seed)
    logger.info("training data: %d rows of %s from %s", len(ex), "/".join(ex.columns), ex.source or "memory")
    repeats = len(rows_repeating_their_positive(ex))
    if repeats:
        logger.info("%s: %d row(s) with a negative that is their own positive's text: that column leaves the row's "
                    "softmax (it is no negative)", ex.source or "the training data", repeats)
    return ex


def rows_repeating_their_positive(examples: TrainExamples) -> list[int]:
    """The rows one of whose negatives is their own positive's text (a false negative: the text ids leave that
    column out of the row's softmax)."""
    from fastprompt.data.corpus import PAIR_COLUMNS, is_negative_column

    columns = examples.columns
    if PAIR_COLUMNS[1] not in columns:
        return []
    pos = columns.index(PAIR_COLUMNS[1])
    negatives = [j for j, c in enumerate(columns) if is_negative_column(c)]
    return [i for i, row in enumerate(examples.rows) if any(row[j] == row[pos] for j in negatives)]


def load_datasets(cfg: TrainConfig) -> list[TrainExamples]:
    """The rows of every training file (``train_files``, or ``train_file``)."""
    check_distinct_files(cfg.data.files)
    datasets = [load_examples(cfg, path) for path in cfg.data.files]
    k = cfg.data.negatives_per_row
    if k is not None and not any(ex.query_rows for ex in datasets):
        raise ValueError(f"negatives_per_row={k} is for query/positive/negative rows (JSONL, or a CSV with query and "
                         f"positive columns); no training file has them ({', '.join(cfg.data.files)})")
    return datasets


def check_distinct_files(files: Sequence[str]) -> None:
    """Refuse two entries of ``train_files`` that are one file (the config refuses the same spelling twice):
    ``tf/nli.csv`` and ``./tf/nli.csv``, a symbolic link or a hard link to it; it would train twice per epoch."""
    seen: dict[object, str] = {}
    for name in files:
        key: object = name
        if not name.startswith("builtin:"):
            try:
                st = Path(name).stat()  # follows symbolic links; a hard link has the same inode
                key = (st.st_dev, st.st_ino)
            except OSError:  # missing or unreadable: the reader says so; compare the spelled paths meanwhile
                key = str(Path(name).resolve())
        if key in seen:
            raise ValueError(f"train_files lists one file twice: {seen[key]!r} and {name!r} are the same file "
                             "(another spelling of its path, a symbolic link or a hard link to it), which would "
                             "train twice per epoch; list each file once")
        seen[key] = name


def dataset_names(datasets: Sequence[TrainExamples]) -> list[str]:
    """Short distinct names of the datasets, for their ``loss_data_<name>`` log columns: each file's stem as an
    identifier (``nli-pairs.csv`` -> ``nli_pairs``), numbered when two stems agree."""
    names: list[str] = []
    for i, ex in enumerate(datasets):
        stem = re.sub(r"\W+", "_", Path(ex.source).stem if ex.source else "").strip("_") or f"data{i}"
        name, n = stem, 2
        while name in names:
            name, n = f"{stem}_{n}", n + 1
        names.append(name)
    return names


def build_sampler(cfg: TrainConfig, examples: TrainExamples | Sequence[TrainExamples],
                  dist: DistributedContext) -> MultiDatasetSampler:
    """Every process plans the same global batches (and trains on its own equal shard of each); several datasets are
    interleaved by ``dataset_sampling``, each batch from one (:mod:`fastprompt.data.multi`)."""
    datasets = [examples] if isinstance(examples, TrainExamples) else list(examples)
    samplers = []
    for d, ex in enumerate(datasets):
        # dataset 0 keeps the run's seed (one dataset trains exactly as before); the others get their own streams
        seed = cfg.run.seed if d == 0 else int(np.random.SeedSequence([cfg.run.seed, d]).generate_state(1)[0])
        samplers.append(_dataset_sampler(cfg, ex, dist, seed))
    return MultiDatasetSampler(samplers, mode=cfg.data.dataset_sampling, seed=cfg.run.seed)


def _dataset_sampler(cfg: TrainConfig, examples: TrainExamples, dist: DistributedContext,
                     seed: int) -> UniqueBatchSampler:
    if dist.enabled and cfg.optim.batch_size % dist.world_size:
        raise ValueError(f"batch_size={cfg.optim.batch_size} (the global batch) must be divisible by the "
                         f"{dist.world_size} processes")
    sampler = UniqueBatchSampler(sentence_keys(examples.rows), cfg.optim.batch_size, seed=seed,
                                 drop_last=cfg.data.drop_last or dist.enabled)
    if sampler.num_batches(0) == 0:
        distinct = len({s for row in examples.rows for s in row})
        if distinct < min(len(examples), cfg.optim.batch_size):  # duplicates, not the corpus size, are the cause
            raise ValueError(f"{examples.source or 'the training data'} has {len(examples)} rows but only {distinct} "
                             f"distinct sentence(s): a batch never holds a sentence twice (it would be its own "
                             f"negative), so no batch of batch_size={cfg.optim.batch_size} can be formed; "
                             "deduplicate the corpus or add sentences")
        fewest, what = fewest_distinct(examples)
        if fewest < min(len(examples), cfg.optim.batch_size):  # e.g. every row shares one query
            raise ValueError(f"{examples.source or 'the training data'} has {len(examples)} rows but only {what}: a "
                             "batch never holds a sentence twice (rows sharing one would be each other's negatives), "
                             f"so no batch of batch_size={cfg.optim.batch_size} can be formed; add rows or lower "
                             "batch_size")
        raise ValueError(f"{len(examples)} training rows make no batch of batch_size={cfg.optim.batch_size} "
                         f"(drop_last={cfg.data.drop_last}); use a smaller batch_size or more data")
    return sampler


def build_encoder(cfg: TrainConfig, resume_dir: Path | None):
    """A new prompt on the base model, or the prompt of ``resume_dir``."""
    from fastprompt.model import PromptEncoder

    enc = cfg.encoder
    if resume_dir is not None:
        return PromptEncoder.from_pretrained(enc.model, prompt=resume_dir, attn_backend=enc.attn_backend,
                                             prefix_mode=enc.prefix_mode, trust_remote_code=enc.trust_remote_code)
    tpl = cfg.templates
    return PromptEncoder.from_pretrained(enc.model, prompt_config=dataclasses.replace(cfg.prompt), pooler=enc.pooler,
                                         mlp=enc.mlp, attn_backend=enc.attn_backend, prefix_mode=enc.prefix_mode,
                                         template=tpl.template, denoise=tpl.resolved_eval_denoise, topk=tpl.topk,
                                         pooler_head=enc.pooler_head, append_eos=enc.append_eos,
                                         trust_remote_code=enc.trust_remote_code)


def prepare_encoder(cfg: TrainConfig, encoder, device: torch.device, total_steps: int):
    """The encoder on ``device`` in training mode, with what the config turns on: a trainable backbone or LoRA
    adapters, gradient checkpointing, packed batches, ``torch.compile`` (in place: parameter names, checkpoints and
    the module stay).

    ``compile: null`` (auto) is decided on the run's ``total_steps``, not the steps left, so a resumed run
    compiles exactly when the uninterrupted one did (a compiled step draws other dropout masks than an eager one)."""
    from fastprompt.train.backbone import add_lora
    from fastprompt.train.compile import compile_encoder, resolve_compile

    add_lora(cfg, encoder)
    encoder.to(device).train()
    if cfg.backbone.train_backbone:
        encoder.train_backbone()
    if cfg.large_batch.gradient_checkpointing:
        encoder.gradient_checkpointing_enable()
    packed = cfg.encoder.packed
    if packed is None:  # auto: a compiled encoder would recompile for every packed length (and break its graph)
        packed = cfg.run.compile is not True and not cfg.run.cuda_graphs and encoder.packing_refusal() is None
    encoder.pack_sequences(packed)
    if resolve_compile(cfg, encoder, device, total_steps, packed=packed):
        compile_encoder(encoder, cuda_graphs=cfg.run.cuda_graphs)
    return encoder


def build_method(cfg: TrainConfig, encoder, terms: Sequence[TokenTerm] = ()) -> Method:
    """The config's sentence-level objective with ``terms`` and the token terms the config turns on (each
    registered method's ``terms`` builder, from its config section and the ``encoder`` it runs through: hidden
    size, tokenizer, heads)."""
    terms = list(terms)
    for spec in METHODS.values():
        if spec.terms is not None:
            terms.extend(load(spec.terms)(cfg, encoder))
    dims = cfg.loss.matryoshka_dims
    if dims and max(dims) > encoder.hidden_size:
        raise ValueError(f"matryoshka_dims {dims} go beyond the {encoder.hidden_size} dimensions of "
                         f"{cfg.encoder.model}'s embeddings")
    return Method(objective_from_config(cfg.loss, objective_sections(cfg)), terms)


def _method_hook(cfg: TrainConfig, hook: str, *args):
    """What the one registered method whose ``hook`` (collator, embed) answers for this config returns, or None;
    two methods answering is an error (they would each want the batches their own way)."""
    found = [(spec.name, out) for spec in METHODS.values() if getattr(spec, hook) is not None
             for out in [load(getattr(spec, hook))(cfg, *args)] if out is not None]
    if len(found) > 1:
        raise ValueError(f"methods {', '.join(name for name, _ in found)} each bring their own {hook}: this run "
                         "can only use one of them")
    return found[0][1] if found else None


def build_collator(cfg: TrainConfig, encoder, examples: TrainExamples, method: Method) -> Collator:
    """The collator of a dataset's rows (a method's own, e.g. PromptBERT's templates, when the config asks for
    it); with text ids (``Batch.text_ids``) when the loss masks by them; padding to a few fixed widths with
    ``cuda_graphs``."""
    views = method.sentence.views_for(examples.columns)
    ids = needs_text_ids(cfg, examples)
    collator = _method_hook(cfg, "collator", encoder, examples.columns, views, ids)
    if collator is None:
        pad = encoder.tokenizer.pad_token_id
        collator = Collator(encoder.tokenize, cfg.data.max_length, columns=examples.columns, views=views,
                            pad_token_id=pad if pad is not None else 0, text_ids=ids)
    if cfg.run.cuda_graphs:  # a few static widths, one CUDA graph each (train.compile.graph_widths)
        from fastprompt.train.compile import graph_widths

        if not isinstance(collator, Collator):
            raise ValueError(f"cuda_graphs: true pads batches to a few widths, which this method's collator "
                             f"({type(collator).__name__}, not a fastprompt Collator) cannot do")
        collator.pad_widths = graph_widths(cfg.data.max_length)
    return collator


def needs_text_ids(cfg: TrainConfig, examples: TrainExamples) -> bool:
    """Whether the loss reads the rows' text ids: always with ``pad_negatives`` (padding negatives, id -1, leave
    every softmax; a column repeating a row's positive text leaves that row's), and wherever a row's negative is
    its own positive (docs/retrieval-data.md)."""
    return cfg.data.pad_negatives or bool(rows_repeating_their_positive(examples))


def build_embed(cfg: TrainConfig, encoder, examples: TrainExamples, method: Method) -> Callable | None:
    """The training forward, model inputs -> pre-head vectors; None: the encoder's own (``head=False``).
    A method may bring its own (PromptBERT: each row pooled at its own template's [MASK], denoised per
    ``denoise``)."""
    return _method_hook(cfg, "embed", encoder, method.sentence.views_for(examples.columns))


def count_total_steps(cfg: TrainConfig, sampler: MultiDatasetSampler) -> int:
    opt = cfg.optim
    if opt.max_steps > 0:
        return opt.max_steps
    full, frac = int(opt.epochs), opt.epochs - int(opt.epochs)
    total = sum(sampler.num_batches(e) for e in range(full))
    if frac > 0:
        total += int(frac * sampler.num_batches(full))
    if total == 0:
        raise ValueError(f"epochs={opt.epochs} of {sampler.num_batches(0)} batches is less than one step")
    return total


def linear_schedule(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Linear warmup from 0 to 1 over ``warmup_steps``, then linear decay to 0 at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


@dataclass
class Optimization:
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None  # fp16 only

    def step(self, params: list[torch.nn.Parameter], max_grad_norm: float,
             finite_loss: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, clip (``max_grad_norm`` > 0), step, all on the device: returns (gradient norm, applied) as 0-d
        tensors, read by nobody here. A non-finite gradient, or a loss that ``finite_loss`` (a 0-d bool tensor)
        says is not finite, skips the update inside the fused AdamW kernel (its ``found_inf``, as GradScaler uses
        it), so deciding it never waits for the GPU."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        if max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
        elif grads:
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        else:
            norm = torch.zeros((), device=self.device)
        ok = torch.isfinite(norm)
        if finite_loss is not None:
            ok = ok & finite_loss.to(ok.device)
        if self.scaler is not None:
            # the scaler skips the update itself on inf/nan gradients (a normal event while it calibrates its
            # scale); a non-finite loss gives non-finite gradients, so it skips those steps too
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.grad_scale = None
            self.optimizer.found_inf = (~ok).float()
            self.optimizer.step()
        # The fused kernel updates the weights without bumping their version counters: bump them, so that what
        # keys a cache on them (PromptBERT's template biases) sees the change, as after any in-place update.
        torch.autograd.graph.increment_version([p for g in self.optimizer.param_groups for p in g["params"]])
        return norm, ok

    @property
    def device(self) -> torch.device:
        return next(p.device for g in self.optimizer.param_groups for p in g["params"])


def check_warmup(cfg: TrainConfig, total_steps: int) -> None:
    """Refuse a ``warmup_steps`` that is not shorter than the run: the learning rate would still be rising when
    training ends and never reach ``learning_rate`` (a ``warmup_ratio`` is below 1 by its bounds)."""
    warmup = cfg.optim.warmup_steps
    if warmup >= total_steps:
        raise ValueError(f"warmup_steps={warmup} is not shorter than the run ({total_steps} steps): the learning "
                         f"rate would still be warming up when training ends (at {total_steps / (warmup + 1):.0%} of "
                         f"learning_rate at the last step); set warmup_steps below {total_steps}, or give "
                         "warmup_ratio (a share of the run) instead")


def build_optimization(cfg: TrainConfig, params: list[torch.nn.Parameter], total_steps: int,
                       device: torch.device, encoder=None) -> Optimization:
    """AdamW + linear schedule (+ fp16 scaler); with ``train_backbone``, the backbone's weights of ``encoder``
    form their own group (:func:`fastprompt.train.backbone.optimizer_groups`)."""
    from fastprompt.train.backbone import optimizer_groups

    opt = cfg.optim
    warmup = opt.warmup_steps or int(math.ceil(opt.warmup_ratio * total_steps))
    # fused: one kernel per step, and it takes found_inf (a skipped update decided on the device, no host read)
    optimizer = torch.optim.AdamW(optimizer_groups(cfg, params, encoder), lr=opt.learning_rate,
                                  betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_epsilon,
                                  weight_decay=opt.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(warmup, total_steps))
    scaler = torch.amp.GradScaler(device.type) if cfg.run.precision == "fp16" else None
    return Optimization(optimizer, scheduler, scaler)


def autocast_factory(cfg: TrainConfig, device: torch.device,
                     precision: str | None = None) -> Callable[[], contextlib.AbstractContextManager]:
    """The autocast of the training forwards (``cfg.run.precision``), or of ``precision`` (evaluation's)."""
    dtype = _AUTOCAST_DTYPES.get(precision or cfg.run.precision)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def build_step(cfg: TrainConfig, loss_side: LossSide) -> PlainStep | CachedStep:
    """The step strategy: the gradient cache when a micro-batch budget is set, else one graph per batch."""
    lb = cfg.large_batch
    if lb.enabled:
        return CachedStep(loss_side, micro_batch_size=lb.micro_batch_size or None,
                          max_tokens=lb.max_tokens_per_micro_batch or None)
    return PlainStep(loss_side)


def load_dev_data(cfg: TrainConfig):
    """STS-B dev pairs for model selection, or None without ``sts_dir``."""
    if cfg.evaluation.sts_dir is None:
        logger.warning("no sts_dir: no STS-B dev evaluation, best/ will hold the final prompt")
        return None
    from fastprompt.eval.sts import load_sts_tasks

    return load_sts_tasks(cfg.evaluation.sts_dir, ["stsb"], stsb_split="dev")
