"""PEFT's prefix-tuning adapter format, both ways: a folder with ``adapter_config.json`` and
``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes it and ``PeftModel.from_pretrained`` reads it.

The layout (read from peft 0.21's ``PrefixEncoder``, ``PeftModel.get_prompt`` and ``get_peft_model_state_dict``):

- the weights file holds one tensor, ``prompt_embeddings``, of shape (num_virtual_tokens, num_layers * 2 * token_dim);
- ``get_prompt`` views it as (batch, P, num_layers * 2, heads, head_dim), permutes to (num_layers * 2, batch, heads, P,
  head_dim) and splits it in pairs: layer l's key is slot 2l, its value slot 2l + 1. So a row is ordered
  (layer, key/value, head, head_dim), and fastprompt's (layers, 2, heads, P, head_dim) prefix is that tensor with P
  moved to the front (P-tuning v2's layout, which PromCSE/DCPCSE share: ``_common.prefix_from_rows``);
- with ``prefix_projection`` PEFT saves the reparameterised prefix (the MLP's output; its config then reads
  ``inference_mode: true``), not the MLP. Export does the same and writes ``prefix_projection: false``: the file
  holds the prefix as PEFT runs it. PEFT (0.21) loads a saved prompt-learning adapter for inference only
  (``PeftModel.from_pretrained(..., is_trainable=True)`` raises "Cannot set a prompt learning adapter to trainable
  when loading pretrained adapter"): train in fastprompt (``import_peft``, then
  ``Trainer(config, encoder=PromptEncoder.load(prompt))``) and export again;
- ``peft_version`` names the PEFT release whose layout the file follows (:data:`PEFT_FORMAT_VERSION`), where PEFT
  records the version that saved an adapter.

PEFT runs prefix tuning with the tokens at positions P..P+S-1 (it leaves ``position_ids`` to the model, which offsets
them by the cache length, and adds P to explicit ones): fastprompt's ``position_mode: shifted``. A prompt trained
with standard positions exports unchanged (fastprompt gets it back exactly), but PEFT will run it shifted; export
warns. An imported adapter without fastprompt's metadata is therefore read as ``shifted``.

The adapter carries the prefix only; ``base_model_name_or_path`` names the model it applies to. A checkpoint of a
fine-tuned backbone (:meth:`PromptEncoder.train_backbone`) holds that backbone in the Hugging Face layout, and its
prefix belongs to it, not to the original base model (whose outputs differ): its adapter names the checkpoint folder
itself (as an absolute path, which ``AutoModel.from_pretrained`` and PEFT's ``AutoPeftModel`` load), with a warning
that the folder must stay available, as PEFT names a locally fine-tuned base. A :class:`PromptEncoder` with a
fine-tuned backbone has no such folder and is refused: save it first.

Decoders with grouped-query attention: PEFT sizes a prefix per key/value head (its ``_prepare_prompt_learning_config``
sets ``num_attention_heads`` to ``num_key_value_heads`` and ``token_dim`` to ``num_key_value_heads * head_dim``),
which is the shape of fastprompt's prefix on these models, so the row layout above holds unchanged. RoPE: PEFT's
cache holds the prefix keys unrotated and runs the tokens at P..P+S-1, i.e. ``position_mode: shifted`` again. PEFT's
prefix tuning does not run on DistilBERT, ModernBERT and MPNet (:mod:`.peft_support`): export refuses them, and import
refuses an adapter naming such a base (:func:`check_peft_runs`). It runs a sliding window or score soft-capping
differently: export warns when the base model applies one (:func:`peft_differences`).

fastprompt's own settings (pooler, template, position mode, ...) travel as safetensors metadata
(``fastprompt_config``), which PEFT ignores and :func:`import_peft` restores. What PEFT's format cannot hold is
refused: a [CLS] prompt, an input-layer-only prompt, and a pooler head applied at inference.
``peft`` itself is not needed for either direction.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastprompt.messages import shown
from fastprompt.model.checkpoint import CheckpointFile
from fastprompt.schema import check_json

from ._common import (
    check_export_target,
    checkpoint_dir,
    layer_prefix_tensor,
    load_foreign_weights,
    prefix_from_rows,
    prefix_to_rows,
    read_prompt_checkpoint,
)
from .peft_support import check_peft_runs

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PREFIX_KEY = "prompt_embeddings"
METADATA_KEY = "fastprompt_config"
#: The PEFT release whose adapter layout export writes (read from its code, loaded by it in the tests); written as
#: ``peft_version``, where PEFT records the version that saved an adapter.
PEFT_FORMAT_VERSION = "0.21.2"
def base_model_config(name: str | os.PathLike):
    """``(config, None)``: the config of base model ``name`` (a folder, an installed model package or a hub id, as
    PEFT and fastprompt load it), read without its weights and running no code of it; ``(None, why)`` when it
    cannot be read here."""
    from transformers import AutoConfig

    from fastprompt.model.resolve import check_hub_model, resolve_model

    try:
        where, kind = resolve_model(name)
        local_only = check_hub_model(where) if kind == "hub" else False
        return AutoConfig.from_pretrained(where, local_files_only=local_only, trust_remote_code=False), None
    except (OSError, ValueError, KeyError) as exc:
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def peft_differences(config) -> list[str]:
    """Where PEFT runs a prefix on the model ``config`` builds differently from fastprompt, one reason each: a
    sliding window some layer applies (the rule :func:`~fastprompt.integrations.peft_attention.sliding_window` reads
    off the layers, here built on the meta device: no weights), score soft-capping."""
    from transformers import AutoModel

    from .peft_attention import sliding_window

    reasons = []
    with torch.device("meta"):
        window = sliding_window(AutoModel.from_config(config, trust_remote_code=False))
    if window is not None:
        reasons.append(f"it attends within a sliding window ({window} tokens), and PEFT's cache puts the prefix at "
                       "positions 0..P-1, so the window hides it from tokens more than a window past it; fastprompt "
                       "keeps it visible to every token")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        reasons.append(f"it caps its attention scores (attn_logit_softcapping = {softcap}), which PEFT runs and a "
                       "fastprompt prefix is trained without")
    return reasons


@dataclass
class PrefixAdapterConfig:
    """The keys of a PEFT prefix-tuning ``adapter_config.json`` that import reads (:mod:`fastprompt.schema`)."""

    peft_type: str
    num_layers: int = field(metadata={"ge": 1})
    num_attention_heads: int = field(metadata={"ge": 1})
    token_dim: int = field(metadata={"ge": 1})
    num_virtual_tokens: int = field(metadata={"ge": 1})
    num_transformer_submodules: int = 1
    base_model_name_or_path: str | None = None


def is_fastprompt_adapter(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a PEFT adapter that fastprompt exported (its weights carry fastprompt's metadata)."""
    from safetensors import safe_open

    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS[0]).is_file():
        return False
    try:
        with safe_open(str(folder / ADAPTER_WEIGHTS[0]), framework="pt") as f:
            return METADATA_KEY in (f.metadata() or {})
    except Exception:  # unreadable or not safetensors: not an export of fastprompt
        return False


def _base_model_name(prompt, path: Path, config: dict) -> str:
    """``base_model_name_or_path`` of the adapter: the base model, or the checkpoint folder itself when it holds a
    fine-tuned backbone (the prefix belongs to that backbone)."""
    from fastprompt.model import PromptEncoder
    from fastprompt.model.checkpoint import holds_backbone_weights

    if not holds_backbone_weights(config):
        return config["base_model"]
    if isinstance(prompt, PromptEncoder):
        raise ValueError("this encoder's backbone is fine-tuned (train_backbone) and a PEFT adapter carries only the "
                         "prefix: save the encoder first (encoder.save(folder)) and export that folder, which the "
                         "adapter then names as its base model")
    logger.warning("checkpoint %s holds a fine-tuned backbone (train_backbone), which the prefix was trained with: "
                   "the adapter names this folder as its base model (base_model_name_or_path), not %r, so it must "
                   "stay available where the adapter is used (on the original base model PEFT gives other outputs)",
                   path, config["base_model"])
    return str(path.resolve())


_LORA_REFUSAL = ("this checkpoint holds LoRA adapters, which it already stores in PEFT's own layout "
                 "(adapter_model.safetensors + adapter_config.json in the checkpoint folder): load that folder with "
                 "PeftModel.from_pretrained(base_model, folder); export peft writes prefix-tuning adapters")


def export_peft(prompt, output: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``prompt`` (a checkpoint folder or a :class:`~fastprompt.model.PromptEncoder`) as a PEFT prefix-tuning
    adapter folder that ``PeftModel.from_pretrained(base_model, output)`` loads. Returns ``output``.

    ``output`` must be new, empty or an earlier PEFT export of fastprompt (it is replaced) unless ``overwrite``.
    A checkpoint with a fine-tuned backbone names its own folder as the base model (see the module docstring).
    """
    from safetensors.torch import save_file

    from fastprompt.io import atomic_directory, write_json_atomic
    from fastprompt.model import PromptEncoder

    check_export_target(output, "PEFT adapter", is_fastprompt_adapter, overwrite=overwrite,
                        source=None if isinstance(prompt, PromptEncoder) else prompt)
    with checkpoint_dir(prompt) as path:
        config, tensors = read_prompt_checkpoint(path)
        if config.get("lora"):
            raise ValueError(_LORA_REFUSAL)
        base_name = _base_model_name(prompt, path, config)
    prompt_config = config["prompt_config"] or {}
    if prompt_config.get("prompt_type") == "none":
        raise ValueError("this checkpoint has no prompt (prompt_type: none; a fully fine-tuned backbone): there is no "
                         "prefix to write as a PEFT adapter; export it to sentence-transformers instead")
    check_peft_runs(config["backbone"].get("model_type"), "a PEFT adapter of this prompt could not be used; keep "
                    "the fastprompt checkpoint, or export it to sentence-transformers")
    # what PEFT will run: the base model the adapter names (checkpoints do not record its sliding window)
    base_config, why = base_model_config(base_name)
    if base_config is None:
        logger.warning("could not read the config of base model %r (%s): if it attends within a sliding window or "
                       "caps its attention scores, PEFT runs this prompt differently from fastprompt", base_name, why)
    for reason in peft_differences(base_config) if base_config is not None else []:
        logger.warning("PEFT may run this prompt differently from fastprompt on %r: %s (importing the adapter back "
                       "into fastprompt restores the trained behaviour)", base_name, reason)
    if prompt_config.get("cls_prompt"):
        raise ValueError("PEFT's prefix-tuning format cannot hold a [CLS] prompt (cls_prompt: true)")
    if config["mlp"] == "always":
        raise ValueError(f"PEFT's prefix-tuning format cannot hold the {config['pooler']!r} pooler head that "
                         "this prompt applies at inference (mlp: always)")
    prefix = layer_prefix_tensor(config, tensors)  # refuses input-layer-only prompts
    if prompt_config.get("position_mode", "standard") != "shifted":
        logger.warning("this prompt was trained with standard token positions; PEFT runs prefix tuning with "
                       "positions shifted by the prompt length, so PEFT's outputs will differ from fastprompt's "
                       "(importing the adapter back into fastprompt restores the trained behaviour)")
    if config["mlp"] == "train":
        logger.info("the training-only pooler head (mlp: train) is not exported")
    shape = config["backbone"]
    L, H, D = shape["num_layers"], shape["num_heads"], shape["head_dim"]
    adapter_config = {
        "auto_mapping": None,
        "base_model_name_or_path": base_name,
        "encoder_hidden_size": H * D,
        "inference_mode": True,
        "init_weights": None,
        "modules_to_save": None,
        "num_attention_heads": H,
        "num_layers": L,
        "num_transformer_submodules": 1,
        "num_virtual_tokens": prefix.shape[3],
        "peft_type": "PREFIX_TUNING",
        "peft_version": PEFT_FORMAT_VERSION,
        "prefix_projection": False,
        "revision": None,
        "task_type": "FEATURE_EXTRACTION",
        "token_dim": H * D,
    }
    metadata = {"format": "pt", METADATA_KEY: json.dumps(config, sort_keys=True)}
    with atomic_directory(output) as tmp:
        save_file({PREFIX_KEY: prefix_to_rows(prefix)}, str(tmp / ADAPTER_WEIGHTS[0]), metadata=metadata)
        write_json_atomic(tmp / ADAPTER_CONFIG, adapter_config)
    logger.info("wrote PEFT prefix-tuning adapter (%d layers, %d virtual tokens) to %s", L, prefix.shape[3], output)
    return Path(output)


def read_peft_adapter(adapter_dir: str | os.PathLike) -> tuple[dict, torch.Tensor, dict | None]:
    """(adapter config, prefix (layers, 2, heads, P, head_dim), fastprompt metadata or None) of a PEFT folder."""
    from safetensors import safe_open

    from fastprompt.io import read_json

    adapter_dir = Path(adapter_dir)
    config = read_json(adapter_dir / ADAPTER_CONFIG, what="PEFT adapter config")
    if config.get("peft_type") != "PREFIX_TUNING":
        raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: only prefix-tuning adapters can become a fastprompt "
                         f"prompt, this one is {shown(config.get('peft_type'))}")
    check_json(config, PrefixAdapterConfig, f"PEFT adapter config {adapter_dir / ADAPTER_CONFIG}")
    if config.get("num_transformer_submodules", 1) != 1:
        raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: an encoder-decoder adapter "
                         f"(num_transformer_submodules={config['num_transformer_submodules']}) has no encoder-only "
                         "equivalent")
    state = load_foreign_weights(adapter_dir, ADAPTER_WEIGHTS, "PEFT adapter weights")
    if PREFIX_KEY not in state:
        raise ValueError(f"PEFT adapter weights in {adapter_dir} have no {PREFIX_KEY!r} tensor "
                         f"(found {sorted(state)[:5]}); expected a folder written by PeftModel.save_pretrained")
    weights = state[PREFIX_KEY]
    L, H, P = config["num_layers"], config["num_attention_heads"], config["num_virtual_tokens"]
    if tuple(weights.shape) != (P, L * 2 * config["token_dim"]):
        raise ValueError(f"{PREFIX_KEY} has shape {tuple(weights.shape)}, the adapter config says "
                         f"({P}, {L * 2 * config['token_dim']})")
    metadata = None
    weights_file = adapter_dir / ADAPTER_WEIGHTS[0]
    if weights_file.is_file():
        with safe_open(str(weights_file), framework="pt") as f:
            raw = (f.metadata() or {}).get(METADATA_KEY)
        if raw:
            where = f"the fastprompt metadata ({METADATA_KEY}) of {weights_file}"
            try:
                metadata = json.loads(raw)
            except (ValueError, RecursionError):
                raise ValueError(f"{where} is not valid JSON") from None
            check_json(metadata, CheckpointFile, where)
            if metadata["prompt_config"] is None:
                raise ValueError(f"{where}: key 'prompt_config' must be an object, got null")
    return config, prefix_from_rows(weights.float(), L, H), metadata


def import_peft(adapter_dir: str | os.PathLike, output: str | os.PathLike, *,
                base_model: str | os.PathLike | None = None, pooler: str | None = None,
                overwrite: bool = False, trust_remote_code: bool = False) -> Path:
    """Convert a PEFT prefix-tuning adapter folder into a fastprompt prompt checkpoint at ``output``.

    ``base_model`` defaults to the adapter's ``base_model_name_or_path`` (what PEFT loads, and what a user edits to
    move the adapter), else the base model in fastprompt's metadata. An adapter exported by fastprompt gets its
    pooler, template, position mode and other settings back; any other adapter gets ``position_mode: shifted``
    (how PEFT ran it) and ``pooler`` (default ``cls``). ``output`` must be new, empty or an earlier prompt
    checkpoint (it is replaced) unless ``overwrite``. The base model's own code runs only with ``trust_remote_code``.
    A base model PEFT's prefix tuning does not run on (:mod:`.peft_support`) is refused before it loads.
    """
    from fastprompt.io import check_apart
    from fastprompt.model import PromptConfig, PromptEncoder
    from fastprompt.model.checkpoint import check_save_target

    check_apart(output, (adapter_dir,), "output")  # the input is never replaced, even with overwrite
    check_save_target(output, overwrite)  # before the base model loads
    config, prefix, saved = read_peft_adapter(adapter_dir)
    base = base_model or config.get("base_model_name_or_path") or (saved or {}).get("base_model")
    if not base:
        raise ValueError(f"the adapter in {adapter_dir} names no base model; pass the base model")
    base_config, _ = base_model_config(base)  # unreadable: loading the base model below says why
    model_type = (getattr(base_config, "model_type", None) if base_config is not None
                  else (saved or {}).get("backbone", {}).get("model_type"))
    check_peft_runs(model_type, f"no PEFT adapter can hold a prompt for base model {shown(str(base))}; train a "
                    "fastprompt prompt on it (PromptEncoder) instead")
    if saved is not None:
        # the prefix arrives evaluated and per layer; "normal" skips a data-dependent init it would overwrite
        fields = dict(saved["prompt_config"], prefix_projection=False, shared_across_layers=False, init="normal")
        settings = {"pooler": pooler or saved["pooler"], "max_length": saved.get("max_length"),
                    "template": saved.get("template"), "append_eos": saved.get("append_eos", False)}
    else:
        fields = {"position_mode": "shifted"}
        settings = {"pooler": pooler or "cls"}
    prompt_config = PromptConfig.from_dict({**fields, "prompt_length": prefix.shape[3]})
    encoder = PromptEncoder.from_pretrained(base, prompt_config=prompt_config, trust_remote_code=trust_remote_code,
                                            **settings)
    if (encoder.num_layers, encoder.num_heads, encoder.head_dim) != tuple(prefix.shape[i] for i in (0, 2, 4)):
        raise ValueError(f"the adapter's prefix {tuple(prefix.shape)} does not fit base model {base!r} "
                         f"({encoder.num_layers} layers, {encoder.num_heads} heads of {encoder.head_dim})")
    encoder.prompt.load_prefix_(prefix.to(encoder.prompt.prefix.dtype))
    return encoder.save(output, overwrite=overwrite)
