"""sentence-transformers export: a folder that ``SentenceTransformer(folder, trust_remote_code=True)`` loads and whose
``encode`` gives :meth:`PromptEncoder.encode`'s vectors.

The folder (written by :func:`export_sentence_transformers`):

    modules.json, config_sentence_transformers.json   sentence-transformers' description of the model
    README.md                                          the model card (base model, method, training config, STS table)
    fastprompt_module.json                             the first module's config
    config.json, model.safetensors, tokenizer files    the frozen backbone in the Hugging Face layout (left out with
                                                       include_backbone=False: the module then names the base model)
    prompt/                                            the fastprompt prompt checkpoint; for a fine-tuned backbone
                                                       (train_backbone) it holds that backbone too, and the root
                                                       does not, so the backbone is stored once; LoRA adapters
                                                       (lora) are merged into the backbone's weights and stored so,
                                                       or, with include_backbone=False, kept in PEFT's layout there
    1_Normalize/                                       L2 normalisation, as PromptEncoder.encode does by default

The first module, :class:`PromptEncoderModule`, wraps a :class:`~fastprompt.model.PromptEncoder` (sentence-transformers'
documented custom-module mechanism: a ``Module``/``InputModule`` subclass named in ``modules.json``). Tokenisation,
template, prefix and pooler are PromptEncoder's own, so whatever PromptEncoder does carries over unchanged.
sentence-transformers 6 imports a module class from outside its own package only with ``trust_remote_code=True``,
for local folders too; no code is downloaded or stored in the folder: the class is the installed fastprompt's.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import InputModule, Normalize

from fastprompt.integrations._common import TOKENIZER_PROBE, check_tokenizer_reloads  # noqa: F401 (re-exported)
from fastprompt.io import read_json
from fastprompt.model import PromptEncoder
from fastprompt.schema import check_json

logger = logging.getLogger(__name__)

PROMPT_SUBFOLDER = "prompt"
MODULE_TYPE = "fastprompt.integrations.sentence_transformers.PromptEncoderModule"

@dataclass
class ModuleConfig:
    """The schema of ``fastprompt_module.json`` (:mod:`fastprompt.schema`): :class:`PromptEncoderModule`'s keys."""

    base_model: str | None = None
    prompt_path: str = PROMPT_SUBFOLDER


@dataclass
class TrainInfo:
    """The keys of a checkpoint's ``train_info.json`` the model card shows."""

    step: int | None = None
    stsb_dev: float | None = None
    config: dict[str, Any] | None = None


@dataclass
class RunSummary:
    """The keys of a run's ``summary.json`` the model card shows."""

    best_checkpoint: str | None = None
    best_stsb_dev: float | None = None
    best_step: int | None = None
    test: dict[str, float] | None = None
    config: dict[str, Any] | None = None


def _objective_card(objective) -> tuple[str, str]:
    """The model card's "method" row and BibTeX of a run's objective: the text its class carries
    (``SentenceObjective.description`` and ``.citation``, its own: a subclass does not inherit its parent's
    paper); an objective not registered here, or without a description, is shown by name."""
    from fastprompt.objectives.registry import objective_class

    try:
        cls = objective_class(objective)
    except (ValueError, TypeError, ImportError):
        return f"`{objective}`", ""
    own = vars(cls)
    return own.get("description") or f"`{objective}`", own.get("citation", "")


def check_prompt_path(prompt_path, folder: str | os.PathLike | None = None) -> str:
    """``prompt_path`` if it names a folder inside the model folder: a relative path without ``..`` (and, given the
    ``folder``, one that stays inside it once symlinks are resolved), else ValueError. A module config pointing
    elsewhere would make loading read, and ``SentenceTransformer.save`` overwrite, a checkpoint outside the folder."""
    path = Path(prompt_path) if isinstance(prompt_path, str) and prompt_path.strip() else None
    inside = (path is not None and not path.is_absolute() and not path.drive and ".." not in path.parts
              and "\\" not in prompt_path)
    if inside and folder is not None:
        inside = Path(folder).resolve() in (Path(folder) / path).resolve().parents
    if not inside:
        where = f"{Path(folder) / PromptEncoderModule.config_file_name}: " if folder is not None else ""
        raise ValueError(f"{where}prompt_path must be a folder inside the model folder (a relative path without "
                         f"'..'), got {prompt_path!r}")
    return prompt_path


class PromptEncoderModule(InputModule):
    """A sentence-transformers input module that is a fastprompt :class:`PromptEncoder` (backbone + prompt + pooler).

    ``base_model``: ``None`` when the backbone is saved in the module's folder (at its root, or, fine-tuned, inside
    the prompt checkpoint), else the base model to load it from.
    """

    config_file_name = "fastprompt_module.json"
    config_keys = ["base_model", "prompt_path"]
    save_in_root = True

    def __init__(self, encoder: PromptEncoder, base_model: str | None = None, prompt_path: str = PROMPT_SUBFOLDER):
        super().__init__()
        self.encoder = encoder
        self.base_model = base_model
        self.prompt_path = check_prompt_path(prompt_path)

    @property
    def tokenizer(self):
        return self.encoder.tokenizer

    @tokenizer.setter
    def tokenizer(self, value):
        self.encoder.tokenizer = value

    @property
    def max_seq_length(self) -> int:
        return self.encoder.max_length or min(self.encoder.tokenizer.model_max_length, 512)

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self.encoder.max_length = value

    def get_embedding_dimension(self) -> int:
        return self.encoder.hidden_size

    def preprocess(self, inputs, prompt: str | None = None, **kwargs) -> dict[str, torch.Tensor]:
        texts = list(inputs)
        if prompt:
            texts = self._prepend_prompt(texts, prompt)
        return self.encoder.tokenize(texts)

    def forward(self, features: dict, **kwargs) -> dict:
        features["sentence_embedding"] = self.encoder(features["input_ids"], features["attention_mask"],
                                                      features.get("token_type_ids"))
        return features

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        # a fine-tuned backbone is part of the prompt checkpoint (PromptEncoder.save writes it there): not again here
        self.encoder.save(Path(output_path) / check_prompt_path(self.prompt_path, output_path))
        if self.base_model is None and not self.encoder.backbone_trained:
            self.encoder.backbone.save_pretrained(output_path, safe_serialization=safe_serialization)
            self.encoder.tokenizer.save_pretrained(output_path)
        self.save_config(output_path)

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", token=None, cache_folder: str | None = None,
             revision: str | None = None, local_files_only: bool = False, model_kwargs: dict | None = None,
             **kwargs) -> "PromptEncoderModule":
        hub = {"subfolder": subfolder, "token": token, "cache_folder": cache_folder, "revision": revision,
               "local_files_only": local_files_only}
        config = cls.load_config(model_name_or_path, **hub)
        folder = Path(cls.load_dir_path(model_name_or_path, **hub))
        check_json(config, ModuleConfig, f"{folder / cls.config_file_name}")
        backend = kwargs.get("backend", "torch")
        if backend == "onnx":  # the export's onnx/ graph in onnxruntime (fastprompt.integrations.st_onnx)
            from fastprompt.integrations.st_onnx import OnnxPromptModule

            return OnnxPromptModule.from_export(folder, model_kwargs)
        if backend != "torch":
            raise ValueError(f"fastprompt's sentence-transformers module runs with backend 'torch' or 'onnx' (with "
                             f"the graph of --onnx), not {backend!r}")
        dtype = (model_kwargs or {}).get("dtype", (model_kwargs or {}).get("torch_dtype"))
        if isinstance(dtype, str):
            dtype = None if dtype == "auto" else getattr(torch, dtype)
        prompt_path = check_prompt_path(config.get("prompt_path", PROMPT_SUBFOLDER), folder)
        # sentence-transformers' trust_remote_code (in kwargs) is what lets it import this class: it does not let
        # the backbone run code of its own (fastprompt.remote_code)
        encoder = PromptEncoder.from_pretrained(config.get("base_model") or folder, prompt=folder / prompt_path,
                                                torch_dtype=dtype)
        return cls(encoder, base_model=config.get("base_model"), prompt_path=prompt_path)


def is_sentence_transformers_export(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a sentence-transformers model that fastprompt exported (its first module is
    :class:`PromptEncoderModule`)."""
    try:
        modules = json.loads((Path(folder) / "modules.json").read_text(encoding="utf-8"))
        return modules[0]["type"] == MODULE_TYPE
    except (OSError, ValueError, LookupError, TypeError):
        return False


def export_sentence_transformers(prompt, output: str | os.PathLike, *, base_model: str | os.PathLike | None = None,
                                 include_backbone: bool = True, normalize: bool = True,
                                 overwrite: bool = False, trust_remote_code: bool = False,
                                 onnx: bool = False, onnx_dtype: str = "float32") -> Path:
    """Write ``prompt`` (a checkpoint folder or a :class:`PromptEncoder`) as a sentence-transformers model folder.

    ``base_model`` overrides the base the checkpoint names. ``include_backbone=False`` leaves the backbone out and
    names the base model instead (it must then be loadable where the folder is used). ``normalize`` appends
    L2 normalisation (PromptEncoder.encode's default). A checkpoint from a training run gets the run's training
    config and STS results in its model card. A fine-tuned backbone (train_backbone) is stored once, inside the
    prompt checkpoint; it cannot be left out. ``onnx`` adds the subfolder ``onnx/``: the ONNX export of the same
    encoder (``onnx_dtype``: its weights, float32 or float16), which ``SentenceTransformer(folder, backend="onnx",
    trust_remote_code=True)`` runs in onnxruntime (:mod:`fastprompt.integrations.st_onnx`); what the ONNX export
    cannot take is refused before anything is written. ``output`` must be new, empty or an earlier export of this
    kind (it is replaced) unless ``overwrite``. Returns ``output``.
    """
    from fastprompt.integrations._common import check_export_target
    from fastprompt.io import atomic_directory

    source = None if isinstance(prompt, PromptEncoder) else Path(prompt)
    check_export_target(output, "sentence-transformers", is_sentence_transformers_export, overwrite=overwrite,
                        source=source)
    if onnx:
        from fastprompt.integrations.st_onnx import check_onnx_possible

        check_onnx_possible(source, onnx_dtype)
    encoder = (prompt if source is None
               else PromptEncoder.load(source, base_model=base_model, trust_remote_code=trust_remote_code))
    lora_merged = encoder.lora is not None and include_backbone
    if lora_merged:
        # sentence-transformers gets plain weights: the adapters folded into the backbone (the same outputs, up to
        # fp32 rounding), stored like a fine-tuned backbone, inside prompt/; without the backbone they stay adapters
        encoder = copy.deepcopy(encoder) if source is None else encoder
        encoder.merge_lora()
    if encoder.backbone_trained and not include_backbone:
        raise ValueError("this prompt's backbone is fine-tuned (train_backbone): the base model cannot stand in for "
                         "it, so it cannot be left out (drop include_backbone=False / --no-backbone)")
    onnx_encoder = None
    if onnx:  # the graph takes plain weights: LoRA adapters kept as such (--no-backbone) are merged in a copy
        onnx_encoder = copy.deepcopy(encoder).merge_lora() if encoder.lora is not None else encoder
        check_onnx_possible(onnx_encoder, onnx_dtype)
    base_name = str(base_model or encoder.base_model)
    module = PromptEncoderModule(encoder, base_model=None if include_backbone else base_name)
    model = SentenceTransformer(modules=[module, Normalize()] if normalize else [module], similarity_fn_name="cosine",
                                device=str(encoder.device))
    with atomic_directory(output) as tmp:
        model.save(str(tmp), create_model_card=False)
        if module.base_model is None and not encoder.backbone_trained:
            check_tokenizer_reloads(encoder.tokenizer, tmp)
        (tmp / "README.md").write_text(model_card(encoder, source, base_name, normalize=normalize,
                                                  name=Path(output).name, lora_merged=lora_merged), encoding="utf-8")
        if onnx:
            from fastprompt.integrations.st_onnx import write_onnx_subfolder

            write_onnx_subfolder(onnx_encoder, tmp, normalize=normalize, dtype=onnx_dtype)
    logger.info("wrote sentence-transformers model to %s", output)
    return Path(output)


def _run_info(checkpoint: Path | None) -> tuple[dict | None, dict | None]:
    """(train_info.json inside the checkpoint, summary.json of the run when its best checkpoint is this one).

    A run folder holds ``summary.json`` next to its ``best/`` checkpoint; the summary names it by the path the run
    was given (often relative to where training ran), so it is matched by name within the summary's own folder,
    which holds wherever the run was moved and whatever the current directory."""
    if checkpoint is None:
        return None, None

    def read(path: Path, schema: type) -> dict | None:
        try:
            return read_json(path, path.name, schema=schema) if path.is_file() else None
        except (OSError, ValueError) as exc:
            logger.warning("model card: ignoring unreadable %s (%s)", path, exc)
            return None

    checkpoint = checkpoint.resolve()
    info = read(checkpoint / "train_info.json", TrainInfo)
    summary = read(checkpoint.parent / "summary.json", RunSummary)
    best = (summary or {}).get("best_checkpoint")
    if summary is not None and (not isinstance(best, str) or Path(best).name != checkpoint.name):
        summary = None  # the run's results belong to another of its checkpoints
    return info, summary


def model_card(encoder: PromptEncoder, checkpoint: Path | None, base_model: str, *, normalize: bool,
               name: str, lora_merged: bool = False) -> str:
    """The README.md of an exported model: front matter, usage, the model, its training and STS results.
    ``lora_merged``: the backbone's weights hold LoRA adapters merged into them."""
    import yaml

    from fastprompt.eval.sts import TASK_TITLES

    info, summary = _run_info(checkpoint)
    train_config = (info or {}).get("config") or (summary or {}).get("config")
    cfg = encoder.prompt_config
    front = {"library_name": "sentence-transformers", "pipeline_tag": "sentence-similarity",
             "tags": ["sentence-transformers", "sentence-similarity", "feature-extraction", "fastprompt",
                      "prefix-tuning"]}
    if not Path(base_model).exists():  # a hub id or package name; a local path means nothing to readers
        front["base_model"] = base_model
    n_prompt = sum(p.numel() for p in encoder.trainable_parameters())
    has_prompt = cfg is not None and cfg.prompt_type != "none"  # prompt_type none: LoRA or full fine-tuning alone
    if lora_merged or encoder.lora is not None:
        backbone = "with LoRA adapters" + (" merged into its weights" if lora_merged else "")
    elif encoder.backbone_trained:
        backbone = "fine-tuned with the prompt" if has_prompt else "fully fine-tuned"
    else:
        backbone = "frozen"
    rows = [("base model", f"`{base_model}` ({backbone})")]
    citation = ""
    if train_config:
        method, citation = _objective_card(train_config.get("objective"))
        rows.append(("method", method))
    if has_prompt:
        prompt = f"{cfg.prompt_length} prefix tokens per layer x {encoder.num_layers} layers"
        if cfg.shared_across_layers:
            prompt = f"{cfg.prompt_length} prefix tokens shared by all {encoder.num_layers} layers"
        elif cfg.input_layer_only:
            prompt = f"{cfg.prompt_length} prefix tokens on the first layer"
        if cfg.prefix_projection:
            prompt += f", reparameterised through an MLP (width {cfg.projection_hidden_size})"
        rows += [("prompt", f"{prompt}; {n_prompt:,} trainable parameters"),
                 ("token positions", cfg.position_mode + (" (shifted by the prompt length, as the papers' code)"
                                                          if cfg.position_mode == "shifted" else ""))]
        if cfg.cls_prompt:
            rows.append(("[CLS] prompt", "a trained vector replaces the [CLS] embedding"))
    rows += [("pooler", f"`{encoder.pooler.pooler}`" + {"always": " + trained head", "train": " (head used in "
                                                         "training only)"}.get(encoder.pooler.mlp, ""))]
    if encoder.template:
        rows.append(("template", f"`{encoder.template}`"))
    rows += [("output", f"{encoder.hidden_size}-dimensional, " + ("L2-normalised" if normalize else "not normalised")
              + "; cosine similarity"),
             ("max length", str(encoder.max_length or min(encoder.tokenizer.model_max_length, 512)) + " tokens")]
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "", f"# {name}", "",
             (f"Deep continuous prompts (prefix tuning / P-tuning v2) trained with "
              f"[fastprompt](https://pypi.org/project/fastprompt/) on top of the {backbone} `{base_model}`."
              if has_prompt else f"`{base_model}` {backbone}, trained as a sentence encoder with "
              "[fastprompt](https://pypi.org/project/fastprompt/) (no prompt)."), "",
             "## Usage", "", "```python",
             "from sentence_transformers import SentenceTransformer  # pip install fastprompt sentence-transformers",
             "",
             f'model = SentenceTransformer("{name}", trust_remote_code=True)  # the module class comes from fastprompt',
             'embeddings = model.encode(["A man is playing a guitar.", "Someone plays an instrument."])',
             "```", "",
             "`trust_remote_code=True` lets sentence-transformers import fastprompt's installed module class; no code "
             "is downloaded. The same folder loads in fastprompt: "
             f"`PromptEncoder.from_pretrained(folder, prompt=folder + \"/{PROMPT_SUBFOLDER}\")`.", "",
             "## Model", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if summary and summary.get("test"):
        test = summary["test"]
        lines += ["", "## Evaluation", "", "STS (Spearman x 100 of the cosine similarity; SentEval's protocol, "
                  "as in the papers):", "",
                  "| " + " | ".join(TASK_TITLES.get(k, k) for k in test) + " |",
                  "|" + "---:|" * len(test),
                  "| " + " | ".join(f"{v:.2f}" for v in test.values()) + " |"]
    if info or summary:
        lines += ["", "## Training", ""]
        best_dev = (info or {}).get("stsb_dev", (summary or {}).get("best_stsb_dev"))
        step = (info or {}).get("step", (summary or {}).get("best_step"))
        if best_dev is not None:
            lines += [f"Selected at step {step} by STS-B dev Spearman {best_dev:.2f}.", ""]
        if train_config:
            lines += ["Training configuration (`fastprompt train`):", "", "```yaml",
                      yaml.safe_dump(train_config, sort_keys=False).rstrip(), "```"]
    if citation:
        lines += ["", "## Citation", "", "The training objective's paper:", "", "```bibtex", citation, "```"]
    return "\n".join(lines) + "\n"
