"""Helpers the exporters and importers share: reading a prompt checkpoint without its backbone, reading a foreign
weights file safely, turning a checkpoint's prompt into one prefix per backbone layer, and refusing an export target
that holds something else."""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def checkpoint_dir(prompt):
    """A prompt checkpoint folder for ``prompt``: the folder itself, or a :class:`PromptEncoder` saved to a
    temporary folder (removed afterwards), so that every exporter reads one format."""
    from fastprompt.model import PromptEncoder

    if isinstance(prompt, PromptEncoder):
        with tempfile.TemporaryDirectory(prefix="fastprompt-export-") as tmp:
            yield prompt.save(Path(tmp) / "prompt")
    else:
        if not isinstance(prompt, (str, os.PathLike)):
            raise TypeError(f"expected a prompt checkpoint folder or a PromptEncoder, got {type(prompt).__name__}")
        yield Path(prompt)


def check_export_target(output: str | os.PathLike, what: str, is_previous_export: Callable[[Path], bool], *,
                        overwrite: bool = False, source: str | os.PathLike | None = None) -> None:
    """Exporting replaces the whole ``output`` folder (atomically), so, as :meth:`PromptEncoder.save` does for
    checkpoints, refuse anything but a new or empty folder or an earlier export of the same kind
    (``is_previous_export(folder)``) unless ``overwrite``: FileExistsError naming what is there. The input folder
    ``source``, a folder holding it and one inside it are refused even with ``overwrite`` (ValueError): replacing
    them would destroy the prompt."""
    from fastprompt.io import check_apart

    out = Path(output)
    check_apart(out, (source,), "export target")
    if overwrite or not os.path.lexists(out):
        return
    if not out.is_dir():
        raise FileExistsError(f"cannot export to {out}: it is a file; choose a folder name, or pass overwrite=True "
                              "(CLI: --overwrite) to replace the file")
    names = sorted(p.name for p in out.iterdir())
    if names and not is_previous_export(out):
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise FileExistsError(f"cannot export to {out}: the folder is not empty and is not an earlier {what} export "
                              f"of fastprompt (it holds {shown}), and exporting replaces it; choose a new or empty "
                              "folder, or pass overwrite=True (CLI: --overwrite)")


def read_prompt_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """The config and tensors of a prompt checkpoint (no base model needed)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from fastprompt.model.checkpoint import WEIGHTS_NAME, read_checkpoint_config

    config = read_checkpoint_config(path)
    weights = Path(path) / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"prompt weights not found: {weights}")
    try:
        return config, load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"prompt weights {weights} are corrupt or not a safetensors file: {exc}") from exc


def layer_prefix_tensor(config: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The prompt of a checkpoint as one prefix per backbone layer, shape (layers, 2, heads, P, head_dim), fp32.

    A reparameterised prompt (prefix_projection) is evaluated through its MLP; a layer-shared prompt is repeated
    on every layer. An input-layer-only prompt has no per-layer equivalent and is refused.
    """
    from fastprompt.model import PrefixPrompt, PromptConfig

    if config["prompt_config"] is None:
        raise ValueError("the checkpoint has no prompt (it was saved from a model without prefixes)")
    prompt_config = PromptConfig.from_dict(config["prompt_config"])
    if prompt_config.input_layer_only:
        raise ValueError("an input-layer-only prompt has no prefix on the other layers, which a per-layer "
                         "prefix format cannot express")
    shape = config["backbone"]
    prompt = PrefixPrompt(prompt_config, shape["num_layers"], shape["num_heads"], shape["head_dim"])
    own = {k.removeprefix("prompt."): v for k, v in tensors.items() if k.startswith("prompt.")}
    prompt.load_state_dict(own)
    prompt.eval()  # no prompt dropout
    with torch.no_grad():
        layers = prompt.layer_prefixes()
    return torch.stack([torch.stack(kv) for kv in layers]).float().contiguous()


def load_foreign_weights(folder: str | os.PathLike, names: tuple[str, str], what: str) -> dict[str, torch.Tensor]:
    """A state dict from ``folder``: ``names[0]`` (safetensors) when present, else ``names[1]`` (a PyTorch pickle,
    read with ``torch.load(weights_only=True)``, which refuses anything but tensors and plain containers)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    safe, pickled = folder / names[0], folder / names[1]
    if safe.is_file():
        try:
            return load_file(str(safe))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"{what} {safe} is corrupt or not a safetensors file: {exc}") from exc
    if pickled.is_file():
        logger.info("reading %s with torch.load(weights_only=True) (no %s beside it)", pickled, names[0])
        try:
            state = torch.load(pickled, map_location="cpu", weights_only=True)
        except Exception as exc:  # weights_only raises UnpicklingError for any non-tensor payload
            raise ValueError(f"{what} {pickled} could not be read as plain tensors: {exc}") from exc
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{what} {pickled} is not a state dict of tensors")
        return state
    raise FileNotFoundError(f"{what} not found: neither {safe.name} nor {pickled.name} in {folder}")


def prefix_to_rows(prefix: torch.Tensor) -> torch.Tensor:
    """fastprompt's (layers, 2, heads, P, head_dim) prefix -> P-tuning v2's (P, layers * 2 * heads * head_dim) rows."""
    if prefix.dim() != 5 or prefix.shape[1] != 2:
        raise ValueError(f"expected a (layers, 2, heads, P, head_dim) prefix, got {tuple(prefix.shape)}")
    return prefix.permute(3, 0, 1, 2, 4).reshape(prefix.shape[3], -1).contiguous()


def prefix_from_rows(rows: torch.Tensor, num_layers: int, num_heads: int) -> torch.Tensor:
    """P-tuning v2's prefix rows -> fastprompt's (layers, 2, heads, P, head_dim).

    P-tuning v2, PromCSE/DCPCSE and PEFT store a prefix as (P, layers * 2 * hidden) and, in ``get_prompt``, view it
    as (batch, P, layers * 2, heads, head_dim), permute to (layers * 2, batch, heads, P, head_dim) and split it in
    pairs: layer l's key is slot 2l, its value slot 2l + 1. A row is thus ordered (layer, key/value, head, dim).
    """
    if rows.dim() != 2 or rows.shape[1] % (num_layers * 2 * num_heads):
        raise ValueError(f"prefix rows of shape {tuple(rows.shape)} do not split into {num_layers} layers x 2 x "
                         f"{num_heads} heads")
    return rows.reshape(rows.shape[0], num_layers, 2, num_heads, -1).permute(1, 2, 3, 0, 4).contiguous()


#: texts the exported tokenizer must split as the encoder's own does (words, punctuation, digits, case, accents)
TOKENIZER_PROBE = ["A man is playing a guitar.", "Two dogs run in the park, 3 times!", "the cat", "Café au lait"]


def check_tokenizer_reloads(tokenizer, folder: Path) -> None:
    """ValueError unless the tokenizer saved in ``folder`` loads back (as loading the export will:
    ``AutoTokenizer``) into one that tokenises :data:`TOKENIZER_PROBE` as ``tokenizer`` does. transformers picks
    the tokenizer class of some model types itself, whatever the saved files name (its
    ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``: Qwen2, ModernBERT, Phi-3, ...), so a tokenizer of another kind
    attached to such a backbone would come back as another tokenizer and the export would encode other tokens."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    ours, theirs = (tok(TOKENIZER_PROBE)["input_ids"] for tok in (tokenizer, loaded))
    if ours != theirs:
        raise ValueError(f"the encoder's tokenizer ({type(tokenizer).__name__}) does not load back from the exported "
                         f"folder: transformers loads it as {type(loaded).__name__} for this model type, which splits "
                         f"{TOKENIZER_PROBE[0]!r} into {theirs[0]} instead of {ours[0]}; load the encoder from a "
                         "saved model folder (PromptEncoder.from_pretrained) so that its tokenizer is the one "
                         "transformers gives that model")
