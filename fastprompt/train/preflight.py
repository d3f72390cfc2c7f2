"""Checks a run makes before its first step, so that bad input fails in seconds with one line, not after
minutes of training (or hours, for a corrupt STS test file that the final evaluation would read last).

The config itself is validated when it is built (:mod:`fastprompt.train.config`); here are the checks that
need the file system or the loaded model: the output folder, every file the run will read, and limits that
come from the model.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

from fastprompt.train.config import TrainConfig


def check_output_dir(path: str | os.PathLike) -> Path:
    """``path`` is (or can be made) a writable folder; a one-line ValueError otherwise. Returns it."""
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"output_dir {root} is a file, not a folder; choose another output_dir")
    ancestor = root
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if ancestor != root and not ancestor.is_dir():
        raise ValueError(f"output_dir {root} is under {ancestor}, which is a file; choose another output_dir")
    probe = root / f".fastprompt-write-test-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
        raise ValueError(f"output_dir {root} is not writable ({reason}); choose another output_dir") from None
    return root


def check_sts_files(cfg: TrainConfig):
    """Read every STS file the run will evaluate on (the dev split is loaded by the trainer itself): a missing
    or corrupt test file fails now, not after training. Returns the seven test tasks (None without a final
    evaluation), for the final evaluation to use."""
    ev = cfg.evaluation
    if ev.sts_dir is None or not ev.final_eval:
        return None
    from fastprompt.eval.sts import load_sts_tasks

    return load_sts_tasks(ev.sts_dir)


def check_max_length(cfg: TrainConfig, encoder) -> None:
    """``max_length`` within the positions the model has, and with room for at least one token of text after the
    special tokens the tokenizer adds (``max_length=2`` made every BERT sentence ``[CLS] [SEP]``: identical inputs).
    With a template ``max_length`` counts the sentence's own tokens (at least 2; the template comes on top, and its
    sentences are cut to fit the positions already)."""
    if cfg.uses_template or getattr(encoder, "_template", None) is not None:
        return
    limit, max_length = encoder.model_max_tokens(), cfg.data.max_length
    if max_length > limit:
        raise ValueError(f"max_length={max_length} is more than {cfg.encoder.model} allows ({limit} tokens, "
                         f"special tokens included, with this prompt's positions); set max_length <= {limit}")
    special = encoder.special_tokens()  # what an empty sentence becomes
    if max_length <= len(special):
        tokens = " ".join(encoder.tokenizer.convert_ids_to_tokens(special))
        raise ValueError(f"max_length={max_length} leaves no room for text: {cfg.encoder.model}'s tokenizer adds "
                         f"{len(special)} special token(s) to every sentence ({tokens}), so every sentence would be "
                         f"those alone and the run would train on identical inputs; set max_length >= "
                         f"{len(special) + 1} (it counts the special tokens; the papers use 32)")
