"""Loading the frozen Hugging Face backbone strictly: a folder that holds no model, weights that do not fit the
config, or a hub model that cannot be reached are clear errors, never silently random layers."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from fastprompt.io import read_json
from fastprompt.remote_code import refusing_remote_code

from .resolve import check_hub_model, resolve_model

CONFIG_FILE = "config.json"
#: The weights fastprompt loads: safetensors only (a pickle can run code when it is loaded).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
#: PyTorch pickles, named in the error for a folder that holds only those.
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model")


@dataclass
class ModelConfigFile:
    """The keys of a Hugging Face ``config.json`` that fastprompt or transformers compute with, typed (the
    schema of :mod:`fastprompt.schema`; other keys are the model's business). A string where a count belongs
    (``num_attention_heads: "twelve"``) fails here in one line instead of inside transformers."""

    model_type: str | None = None
    architectures: list[str] | None = None
    num_hidden_layers: int = field(default=1, metadata={"ge": 1})
    num_attention_heads: int = field(default=1, metadata={"ge": 1})
    num_key_value_heads: int | None = field(default=None, metadata={"ge": 1})
    hidden_size: int = field(default=1, metadata={"ge": 1})
    head_dim: int | None = field(default=None, metadata={"ge": 1})
    intermediate_size: int = field(default=1, metadata={"ge": 1})
    max_position_embeddings: int = field(default=1, metadata={"ge": 1})
    vocab_size: int = field(default=1, metadata={"ge": 1})
    type_vocab_size: int = field(default=0, metadata={"ge": 0})
    pad_token_id: int | None = None
    layer_norm_eps: float = field(default=1e-12, metadata={"gt": 0})
    hidden_dropout_prob: float = field(default=0.0, metadata={"ge": 0, "le": 1})
    attention_probs_dropout_prob: float = field(default=0.0, metadata={"ge": 0, "le": 1})


def check_model_folder(path: str | os.PathLike, tokenizer: bool = True) -> None:
    """A local model folder must hold a config of the right types, safetensors weights and (unless ``tokenizer`` is
    false: a model that works on another model's token ids) a tokenizer; say which is missing or wrong
    (transformers would instead guess at a tokenizer class and ask for sentencepiece, or fail deep inside on a
    malformed config)."""
    path = Path(path)
    names = sorted(p.name for p in path.iterdir())
    holds = f"it holds {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}" if names else "it is empty"
    if CONFIG_FILE not in names:
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder: it has no {CONFIG_FILE} ({holds})")
    read_json(path / CONFIG_FILE, "model config", schema=ModelConfigFile)
    if not any(f in names for f in WEIGHT_FILES) and not any(n.endswith(".safetensors") for n in names):
        pickles = [f for f in PICKLE_FILES if f in names]
        if pickles:
            raise ValueError(f"{path} holds its weights only as a PyTorch pickle ({', '.join(pickles)}): fastprompt "
                             "loads only safetensors, because loading a pickle can run code; convert the folder "
                             "once where you trust it (AutoModel.from_pretrained(folder).save_pretrained(out))")
        raise FileNotFoundError(f"{path} has no model weights ({' or '.join(WEIGHT_FILES[:2])}; {holds})")
    if tokenizer and not any(f in names for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...; {holds})")


def _harmless_missing(key: str, model) -> bool:
    """A backbone weight absent from the checkpoint that changes nothing fastprompt computes: a buffer (constant
    position or token-type ids, rebuilt from the config) or the backbone's own pooler (Linear + Tanh over [CLS],
    whose output fastprompt never reads: its poolers work on the last hidden states)."""
    return key in dict(model.named_buffers()) or (key.startswith("pooler.") and hasattr(model, "pooler"))


def _harmless_unexpected(key: str, model) -> bool:
    """A checkpoint tensor the backbone has no place for is harmless when it belongs to another task's head
    (e.g. BERT's ``cls.predictions``) or is a buffer; one inside the backbone's own modules (``encoder.layer.7``
    when the config builds 6 layers) means the config describes another model."""
    children = {name for name, _ in model.named_children()}
    return key.split(".", 1)[0] not in children or key in dict(model.named_buffers())


def check_loading_info(info: dict, model, where: str) -> None:
    """Raise ValueError when the weights in ``where`` do not fit the model its config builds."""
    mismatched = sorted(info.get("mismatched_keys") or [])
    missing = sorted(k for k in info.get("missing_keys") or [] if not _harmless_missing(k, model))
    unexpected = sorted(k for k in info.get("unexpected_keys") or [] if not _harmless_unexpected(k, model))
    problems = []
    if mismatched:
        key, ckpt, built = mismatched[0]
        problems.append(f"{len(mismatched)} tensors have other shapes than the config gives (e.g. {key}: weights "
                        f"{tuple(ckpt)}, config {tuple(built)})")
    if missing:
        problems.append(f"{len(missing)} weights the config asks for are missing (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} weights have no place in the model the config builds "
                        f"(e.g. {', '.join(unexpected[:3])})")
    if info.get("error_msgs"):
        problems.append("; ".join(info["error_msgs"])[:500])
    if problems:
        raise ValueError(f"the config.json of {where} does not match its weights: {'; '.join(problems)}. "
                         "Fix the config (num_hidden_layers, hidden_size, ...) or use the model it was saved with")


@contextlib.contextmanager
def _quiet_transformers():
    """transformers prints its own load report (a table of MISSING/UNEXPECTED keys) before our error says the
    same in one line: silence it for the load."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_backbone(name_or_path: str | os.PathLike, *, attn_implementation: str, dtype=None,
                  trust_remote_code: bool = False):
    """(tokenizer, model) of a local folder, an installed model package or a hub id, loaded strictly. The model's
    own code runs only with ``trust_remote_code`` (:mod:`fastprompt.remote_code`)."""
    from safetensors import SafetensorError
    from transformers import AutoModel, AutoTokenizer

    where, kind = resolve_model(name_or_path)
    local_only = False
    if kind == "hub":
        local_only = check_hub_model(where)  # fails at once when the hub cannot be reached and nothing is cached
    else:
        check_model_folder(where)
    try:
        with _quiet_transformers(), refusing_remote_code(where, trust_remote_code):
            tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=local_only,
                                                      trust_remote_code=trust_remote_code)
            model, info = AutoModel.from_pretrained(where, attn_implementation=attn_implementation, dtype=dtype,
                                                    local_files_only=local_only, output_loading_info=True,
                                                    ignore_mismatched_sizes=True, trust_remote_code=trust_remote_code,
                                                    use_safetensors=True)
    except SafetensorError as exc:
        raise ValueError(f"the model weights in {where} are corrupt or truncated: {exc}") from exc
    except OSError as exc:
        raise FileNotFoundError(f"could not load a Hugging Face model from {os.fspath(name_or_path)!r} "
                                f"(resolved to {where!r}): {exc}") from exc
    where = repr(os.fspath(name_or_path)) if kind == "hub" else where
    check_loading_info(info, model, where)
    check_position_offset(model, where)
    return tokenizer, model


def check_position_offset(model, where: str) -> None:
    """Refuse BERT weights under a RoBERTa-family ``model_type`` (positions silently shifted by one or two).

    Models whose position ids start after the padding index (RoBERTa, XLM-R, MPNet: ``padding_idx + 1``) keep
    the position-embedding row of ``padding_idx`` at zero: it is an ``nn.Embedding`` padding row, which
    transformers initialises to zero and which never gets a gradient. Weights trained with positions from 0
    (BERT) use that row for a real position, so it is not zero. The key names cannot tell: BertModel and
    RobertaModel save the same ones."""
    emb = getattr(model, "embeddings", None)
    table = getattr(emb, "position_embeddings", None)
    pad = getattr(emb, "padding_idx", None)
    if (not hasattr(emb, "create_position_ids_from_input_ids") or table is None or not isinstance(pad, int)
            or not 0 <= pad < table.weight.shape[0]):
        return
    if bool(table.weight[pad].detach().ne(0).any()):
        model_type = getattr(model.config, "model_type", "?")
        raise ValueError(f"the config.json of {where} says model_type {model_type!r}, whose position ids start "
                         f"after the padding index {pad}, but the weights use position row {pad} (a {model_type} "
                         "model never trains it): they come from a model whose positions start at 0, such as BERT; "
                         "set model_type (and the architecture) in config.json to the model the weights belong to")


def max_input_length(model, shifted_by: int = 0) -> int | None:
    """The most tokens one input may have: the learned position embeddings minus the positions they start at
    (RoBERTa's start after the padding index) and minus ``shifted_by`` (a prompt that moves token positions).
    None when the model has no such table."""
    n = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(n, int):
        return None
    emb = getattr(model, "embeddings", None)
    start = 0
    if emb is not None and hasattr(emb, "create_position_ids_from_input_ids"):
        start = emb.padding_idx + 1
    return n - start - shifted_by
