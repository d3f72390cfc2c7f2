"""Import checkpoints of the papers' own code (PromCSE, and DCPCSE, its earlier name: github.com/YJiangcm/PromCSE,
``promcse/models.py``; the January 2022 ``dcpcse/models.py`` has the same classes and key names).

Their checkpoint folder is a ``BertForCL`` / ``RobertaForCL`` saved by the Hugging Face Trainer: ``config.json``, the
tokenizer, and the whole model state in ``model.safetensors`` or ``pytorch_model.bin`` with

- ``bert.*`` / ``roberta.*``: the frozen backbone (no pooler layer);
- ``prefix_encoder.embedding.weight``: (pre_seq_len, layers * 2 * hidden), or with ``prefix_projection``
  (pre_seq_len, hidden) followed by ``prefix_encoder.trans.{0,2}.{weight,bias}`` (Linear(hidden, prefix_hidden_size),
  Tanh, Linear(prefix_hidden_size, layers * 2 * hidden)). ``get_prompt`` reshapes the rows exactly as PEFT does
  (``_common.prefix_from_rows``) and applies dropout with the backbone's ``hidden_dropout_prob``;
- ``mlp.dense.{weight,bias}``: the Linear + Tanh head over [CLS] (created when ``pooler_type`` is ``cls``);
- ``lm_head.*`` with ``do_mlm`` (not needed for embeddings, dropped).

Their model arguments (``pooler_type``, ``mlp_only_train``, ...) are not saved with the model: the number of prompt
tokens, the projection and its width are read off the weights, the pooler must be given (or read from the JSON file
of arguments their ``train.py`` accepts). Their transformers 4.2.1 code left ``position_ids`` to the model, which
offsets them by the prefix length: the imported prompt has ``position_mode: shifted``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastprompt.choices import PAPER_POOLER_TYPES

from ._common import load_foreign_weights, prefix_from_rows

logger = logging.getLogger(__name__)

WEIGHTS = ("model.safetensors", "pytorch_model.bin")
SOURCES = ("promcse", "dcpcse")


def _read_args_file(path: str | os.PathLike) -> dict:
    from fastprompt.io import read_json

    data = read_json(path, what="training arguments file", schema=TheirArguments)
    return {k: data[k] for k in ("pooler_type", "mlp_only_train", "pre_seq_len", "prefix_projection",
                                 "prefix_hidden_size") if k in data}


@dataclass
class TheirArguments:
    """The arguments of PromCSE/DCPCSE's ``train.py`` that import reads from ``--args`` (:mod:`fastprompt.schema`)."""

    pooler_type: str | None = None
    mlp_only_train: bool = False
    pre_seq_len: int = field(default=1, metadata={"ge": 1})
    prefix_projection: bool = False
    prefix_hidden_size: int = field(default=1, metadata={"ge": 1})


def _backbone_prefix(state: dict[str, torch.Tensor]) -> str:
    for prefix in ("bert.", "roberta."):
        if any(k.startswith(prefix) for k in state):
            return prefix
    raise ValueError("the checkpoint holds no bert.* or roberta.* weights: not a BertForCL/RobertaForCL state dict")


def import_promcse(checkpoint_dir: str | os.PathLike, output: str | os.PathLike, *, pooler_type: str | None = None,
                   mlp_only_train: bool | None = None, base_model: str | os.PathLike | None = None,
                   args_file: str | os.PathLike | None = None, overwrite: bool = False,
                   trust_remote_code: bool = False) -> Path:
    """Convert a PromCSE/DCPCSE checkpoint folder into a fastprompt prompt checkpoint at ``output``.

    ``pooler_type``: their ``--pooler_type`` (``cls`` or ``cls_before_pooler``); ``mlp_only_train``: their
    flag (the head over [CLS] is then used in training only). Both may come from ``args_file`` (the JSON of arguments
    given to their ``train.py``); explicit values win. ``base_model`` defaults to the checkpoint folder itself, which
    holds the frozen backbone; a different base is checked against the checkpoint's backbone weights. ``output``
    must be new, empty or an earlier prompt checkpoint (it is replaced) unless ``overwrite``.
    """
    from fastprompt.io import check_apart, read_json
    from fastprompt.model import PromptConfig, PromptEncoder
    from fastprompt.model.backbone import ModelConfigFile
    from fastprompt.model.checkpoint import check_save_target

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {checkpoint_dir}")
    check_apart(output, (checkpoint_dir,), "output")  # the input is never replaced, even with overwrite
    check_save_target(output, overwrite)  # before anything loads
    args = _read_args_file(args_file) if args_file else {}
    pooler_type = pooler_type or args.get("pooler_type")
    mlp_only_train = bool(args.get("mlp_only_train", False)) if mlp_only_train is None else mlp_only_train
    if pooler_type not in PAPER_POOLER_TYPES:
        raise ValueError(f"give the checkpoint's pooler type, one of {', '.join(PAPER_POOLER_TYPES)} (their "
                         "--pooler_type: the papers' unsupervised models use cls_before_pooler, the supervised ones "
                         f"cls; their avg poolers fail with prompts); got {pooler_type!r}")
    state = load_foreign_weights(checkpoint_dir, WEIGHTS, "checkpoint weights")
    backbone_prefix = _backbone_prefix(state)
    if "prefix_encoder.embedding.weight" not in state:
        raise ValueError(f"{checkpoint_dir} has no prefix_encoder.embedding.weight: not a PromCSE/DCPCSE checkpoint")
    embedding = state["prefix_encoder.embedding.weight"].float()
    projection = "prefix_encoder.trans.0.weight" in state
    P = embedding.shape[0]
    for key, value in (("pre_seq_len", P), ("prefix_projection", projection)):
        if key in args and args[key] != value:
            raise ValueError(f"the arguments file says {key}={args[key]!r}, the checkpoint's weights say {value!r}")
    if projection and "prefix_hidden_size" in args and args["prefix_hidden_size"] != state[
            "prefix_encoder.trans.0.weight"].shape[0]:
        raise ValueError("the arguments file's prefix_hidden_size does not match the checkpoint's weights")

    pooler, mlp = ("cls", "train" if mlp_only_train else "always") if pooler_type == "cls" else (pooler_type, "none")
    if mlp != "none" and "mlp.dense.weight" not in state:
        raise ValueError("pooler_type cls needs the checkpoint's mlp.dense head, which it does not have")
    if base_model is None and not (checkpoint_dir / WEIGHTS[0]).is_file():
        # the prompt's tensors were read above with the restricted unpickler; the backbone would be a model loaded
        # from a pickle every time the prompt is used, and fastprompt loads models from safetensors only
        raise ValueError(f"{checkpoint_dir} holds its backbone only as a PyTorch pickle ({WEIGHTS[1]}), and "
                         "fastprompt loads models from safetensors only; pass the base model the prompt was trained "
                         "on (--model / base_model=, e.g. bert-base-uncased): its weights are compared with the "
                         "checkpoint's")
    base = base_model or checkpoint_dir.resolve()
    # get_prompt's dropout is the backbone's hidden dropout: keep it for further training
    their_config = checkpoint_dir / "config.json"
    dropout = (read_json(their_config, "model config", schema=ModelConfigFile).get("hidden_dropout_prob", 0.0)
               if their_config.is_file() else 0.0)
    config_kwargs = {"prompt_length": P, "prefix_projection": projection, "position_mode": "shifted",
                     "prompt_dropout": dropout}
    if projection:
        config_kwargs["projection_hidden_size"] = state["prefix_encoder.trans.0.weight"].shape[0]
    encoder = PromptEncoder.from_pretrained(base, prompt_config=PromptConfig(**config_kwargs), pooler=pooler, mlp=mlp,
                                            trust_remote_code=trust_remote_code)

    prompt_state = {}
    if projection:
        prompt_state["prompt.embedding.weight"] = embedding
        for i in (0, 2):
            for part in ("weight", "bias"):
                prompt_state[f"prompt.projection.{i}.{part}"] = state[f"prefix_encoder.trans.{i}.{part}"].float()
    else:
        prompt_state["prompt.prefix"] = prefix_from_rows(embedding, encoder.num_layers, encoder.num_heads)
    if mlp != "none":
        prompt_state["pooler.head.0.weight"] = state["mlp.dense.weight"].float()
        prompt_state["pooler.head.0.bias"] = state["mlp.dense.bias"].float()
    own = encoder.prompt_state_dict()
    bad = [f"{k}: checkpoint {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in prompt_state.items()
           if k in own and v.shape != own[k].shape]
    if bad or set(prompt_state) != set(own):
        raise ValueError(f"the checkpoint's prompt does not fit base model {str(base)!r}: " + "; ".join(
            bad or [f"keys {sorted(set(prompt_state) ^ set(own))}"]))
    encoder.load_state_dict(prompt_state, strict=False)
    if base_model is not None:
        _check_backbone(encoder, state, backbone_prefix, base_model)
    return encoder.save(output, overwrite=overwrite)


def _check_backbone(encoder, state: dict[str, torch.Tensor], prefix: str, base_model) -> None:
    """Warn when the given base model is not the frozen backbone the prompt was trained on."""
    own = encoder.backbone.state_dict()
    theirs = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    common = [k for k in theirs if k in own]
    differing = [k for k in common if not torch.equal(theirs[k].float(), own[k].float().cpu())]
    if not common or differing:
        logger.warning("base model %s is not the backbone stored in the checkpoint (%d of %d shared tensors differ, "
                       "e.g. %s): the imported prompt will not reproduce the checkpoint's embeddings",
                       base_model, len(differing), len(common), differing[:1] or "none shared")
