"""``fastprompt export`` and ``fastprompt import``: prompts to and from other libraries' formats.

Only the standard library is imported here; each ``run_*`` imports its integration.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from fastprompt.choices import PAPER_POOLER_TYPES, POOLERS
from fastprompt.cli.options import add_trust_remote_code_arg

EXPORT_FORMATS = ("sentence-transformers", "peft", "onnx")
IMPORT_FORMATS = ("promcse", "dcpcse", "peft")

EXPORT_EPILOG = """\
examples:
  fastprompt export --prompt runs/quickstart/best --to sentence-transformers --output st-model
  fastprompt export --prompt runs/quickstart/best --to peft --output peft-adapter
  fastprompt export --prompt runs/quickstart/best --to onnx --output onnx-model
  fastprompt export --prompt runs/quickstart/best --to sentence-transformers --onnx --output st-model

A sentence-transformers folder loads with SentenceTransformer("st-model", trust_remote_code=True) where fastprompt
is installed (with --onnx also with backend="onnx": its onnx/ graph in onnxruntime);
a PEFT folder with PeftModel.from_pretrained(AutoModel.from_pretrained(base), "peft-adapter"); an ONNX
folder (model.onnx, tokenizer, fastprompt_onnx.json) with onnxruntime alone, no PyTorch (docs/deploy.md).
"""

IMPORT_EPILOG = """\
examples:
  fastprompt import --from promcse --checkpoint unsup-promcse-bert-base-uncased --pooler-type cls_before_pooler \\
      --output prompts/unsup-promcse
  fastprompt import --from peft --checkpoint peft-adapter --output prompts/from-peft
"""


def _check_output(output: str, *sources: str | None) -> None:
    """No input (the checkpoint, a local base model) is the target, inside it or inside the target, even with
    --overwrite; what else --output may replace the exporters and importers decide (a new or empty folder, or an
    earlier output of the same kind, unless --overwrite)."""
    from fastprompt.io import check_apart

    check_apart(output, [s for s in sources if s is not None and Path(s).exists()])


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="write a prompt checkpoint as a sentence-transformers model, a PEFT adapter or an ONNX graph",
        description="Convert a prompt checkpoint for use outside fastprompt. sentence-transformers: a model folder "
                    "(backbone, prompt, pooling, normalisation, model card) whose encode() equals fastprompt's; "
                    "peft: a prefix-tuning adapter (adapter_config.json + adapter_model.safetensors); onnx: one "
                    "graph with the prefix baked in, for onnxruntime (model.onnx, tokenizer, fastprompt_onnx.json; "
                    "needs pip install 'fastprompt[onnx]').",
        epilog=EXPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True, metavar="CHECKPOINT_DIR", help="prompt checkpoint folder")
    p.add_argument("--to", required=True, choices=EXPORT_FORMATS, help="target format")
    p.add_argument("--output", required=True, metavar="DIR", help="folder to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output even if it holds something other than an earlier export of this format "
                        "(onnx: replace only the files the export writes, keep the others)")
    st = p.add_argument_group("sentence-transformers and onnx")
    st.add_argument("--model", metavar="NAME_OR_PATH", help="base model (default: the one the checkpoint names)")
    st.add_argument("--no-backbone", action="store_true",
                    help="do not copy the backbone into the folder; name the base model instead (refused for a "
                         "fine-tuned backbone)")
    st.add_argument("--no-normalize", action="store_true",
                    help="no L2 normalisation (sentence-transformers: module; onnx: of sentence_embedding)")
    add_trust_remote_code_arg(st)
    st.add_argument("--onnx", action="store_true",
                    help="sentence-transformers: also write onnx/, the ONNX graph that SentenceTransformer(folder, "
                         "backend='onnx', trust_remote_code=True) runs (needs pip install 'fastprompt[onnx]')")
    onnx = p.add_argument_group("onnx")
    onnx.add_argument("--max-length", type=int, metavar="TOKENS",
                      help="longest input the saved tokenizer keeps (default: the checkpoint's max_length, else what "
                           "the model takes, at most 512)")
    onnx.add_argument("--dtype", choices=("float32", "float16"), default=None,
                      help="the graph's weights (default float32; float16 halves the file, docs/deploy.md has its "
                           "accuracy and speed); also for sentence-transformers --onnx")
    p.set_defaults(func=run_export)
    return p


def run_export(args: argparse.Namespace) -> int:
    _check_output(args.output, args.prompt, args.model)
    if args.max_length is not None and args.to != "onnx":
        raise ValueError("--max-length applies to --to onnx only")
    if args.onnx and args.to != "sentence-transformers":
        raise ValueError("--onnx applies to --to sentence-transformers only (--to onnx writes the graph alone)")
    if args.dtype is not None and not (args.to == "onnx" or args.onnx):
        raise ValueError("--dtype applies to --to onnx and to --to sentence-transformers --onnx only")
    dtype = args.dtype or "float32"
    if args.to == "peft":
        if args.model or args.no_backbone or args.no_normalize or args.trust_remote_code:
            raise ValueError("--model, --no-backbone, --no-normalize and --trust-remote-code apply to --to "
                             "sentence-transformers and onnx only")
        from fastprompt.integrations.peft import export_peft

        out = export_peft(args.prompt, args.output, overwrite=args.overwrite)
    elif args.to == "onnx":
        if args.no_backbone:
            raise ValueError("--no-backbone applies to --to sentence-transformers only (the ONNX graph holds the "
                             "backbone)")
        from fastprompt.integrations.onnx import export_onnx

        out = export_onnx(args.prompt, args.output, base_model=args.model, normalize=not args.no_normalize,
                          max_length=args.max_length, overwrite=args.overwrite,
                          trust_remote_code=args.trust_remote_code, dtype=dtype)
    else:
        from fastprompt.integrations.sentence_transformers import export_sentence_transformers

        out = export_sentence_transformers(args.prompt, args.output, base_model=args.model,
                                           include_backbone=not args.no_backbone, normalize=not args.no_normalize,
                                           overwrite=args.overwrite, trust_remote_code=args.trust_remote_code,
                                           onnx=args.onnx, onnx_dtype=dtype)
    print(f"wrote {args.to} model to {out}")
    return 0


def add_import_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "import", help="convert a PromCSE/DCPCSE checkpoint or a PEFT prefix-tuning adapter into a prompt checkpoint",
        description="Convert another library's prefix prompt into a fastprompt prompt checkpoint (usable with "
                    "--prompt everywhere). promcse/dcpcse: a folder of the papers' code (BertForCL/RobertaForCL, "
                    "model.safetensors or pytorch_model.bin); peft: a prefix-tuning adapter folder.",
        epilog=IMPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", required=True, choices=IMPORT_FORMATS, help="source format")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="folder to convert")
    p.add_argument("--output", required=True, metavar="DIR", help="prompt checkpoint folder to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output even if it holds something other than a prompt checkpoint")
    p.add_argument("--model", metavar="NAME_OR_PATH",
                   help="base model (promcse/dcpcse: default the checkpoint folder, which holds the frozen backbone; "
                        "peft: default the adapter's base_model_name_or_path)")
    add_trust_remote_code_arg(p)
    papers = p.add_argument_group("promcse / dcpcse")
    papers.add_argument("--pooler-type", choices=PAPER_POOLER_TYPES,
                        help="the checkpoint's --pooler_type (unsupervised models: cls_before_pooler, supervised: cls)")
    papers.add_argument("--mlp-only-train", action="store_true",
                        help="the checkpoint was trained with --mlp_only_train (its [CLS] head is for training only)")
    papers.add_argument("--args", dest="args_file", metavar="FILE.json",
                        help="the JSON of arguments given to their train.py (pooler_type, mlp_only_train, ...)")
    peft = p.add_argument_group("peft")
    peft.add_argument("--pooler", choices=POOLERS,
                      help="fastprompt pooler of the imported prompt (default: the one fastprompt exported, else cls)")
    p.set_defaults(func=run_import)
    return p


def run_import(args: argparse.Namespace) -> int:
    _check_output(args.output, args.checkpoint, args.model, args.args_file)
    if args.source == "peft":
        if args.pooler_type or args.mlp_only_train or args.args_file:
            raise ValueError("--pooler-type, --mlp-only-train and --args apply to --from promcse/dcpcse only")
        from fastprompt.integrations.peft import import_peft

        out = import_peft(args.checkpoint, args.output, base_model=args.model, pooler=args.pooler,
                          overwrite=args.overwrite, trust_remote_code=args.trust_remote_code)
    else:
        if args.pooler:
            raise ValueError("--pooler applies to --from peft; give the checkpoint's --pooler-type")
        from fastprompt.integrations.papers import import_promcse

        out = import_promcse(args.checkpoint, args.output, pooler_type=args.pooler_type,
                             mlp_only_train=True if args.mlp_only_train else None, base_model=args.model,
                             args_file=args.args_file, overwrite=args.overwrite,
                             trust_remote_code=args.trust_remote_code)
    print(f"wrote prompt checkpoint to {out}")
    return 0
