"""``fastprompt make-replacements``: D2CSE's generator run ahead of training, into a replacement file; a command
the method's registration brings to the command line (``commands=`` of its :class:`~fastprompt.methods.MethodSpec`).
It runs over a training config: the command line hands it the config, its examples and its encoder
(:class:`fastprompt.cli.options.TrainingInputs`), so nothing here imports the layers above the methods."""
from __future__ import annotations

import argparse

from fastprompt.arguments import add_config_args

EPILOG = """\
examples:
  fastprompt make-replacements --config configs/d2cse-unsup-minilm.yaml --output runs/wiki-rtd.jsonl
  fastprompt train --config configs/d2cse-unsup-minilm.yaml --set rtd_replacements_file=runs/wiki-rtd.jsonl

Tokenises every sentence of the config's train_file as training does (model, template, max_length), and
writes one JSON line per distinct tokenised sentence with the generator's replacements (rtd_generator,
rtd_masking_ratio, rtd_sampling), seeded by --seed and the sentence. Run it again to resume a killed run.
A masked-LM generator runs --batch-size sentences at a time on --device (cpu by default).
"""


def add_make_replacements_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "make-replacements", help="D2CSE's replaced tokens for a training file, ahead of training",
        description="Run the replaced-token-detection generator of a training config over its training data "
                    "and write the corrupted sentences to a file that training reads (rtd_replacements_file).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, required=True)
    p.add_argument("--output", required=True, metavar="FILE.jsonl", help="replacement file (appended to on resume)")
    p.add_argument("--seed", type=int, default=0, help="seed of the replacements (0)")
    p.add_argument("--batch-size", type=int, default=256, metavar="N",
                   help="sentences tokenised and run through the generator at a time (256)")
    p.add_argument("--device", default="cpu",
                   help="where a masked-LM generator runs: cpu (default), cuda, cuda:1, or auto (cuda when "
                        "available); the file does not depend on it but for float rounding (docs/crtd.md)")
    p.set_defaults(func=run_make_replacements, training_inputs=True)
    return p


def run_make_replacements(args: argparse.Namespace, inputs) -> int:
    """``inputs``: the config's :class:`~fastprompt.cli.options.TrainingInputs`."""
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    cfg = inputs.config
    from fastprompt.data.replacements import build_generator, replacement_settings, write_replacement_file
    from fastprompt.model import resolve_device

    device = resolve_device(args.device)  # a device this machine lacks fails at once

    examples = inputs.examples()
    encoder = inputs.encoder()
    texts = list(dict.fromkeys(s for row in examples.rows for s in row))
    sentences = []
    for start in range(0, len(texts), args.batch_size):
        tok = encoder.tokenize(texts[start:start + args.batch_size], cfg.data.max_length)
        for ids, mask in zip(tok["input_ids"], tok["attention_mask"]):
            sentences.append(ids[:int(mask.sum())].tolist())
    rtd = cfg.rtd
    gen = build_generator(rtd.generator, encoder.tokenizer, rtd.masking_ratio, rtd.sampling, device,
                          trust_remote_code=cfg.encoder.trust_remote_code)
    settings = replacement_settings(rtd, encoder.base_model, cfg.data.max_length)
    added = write_replacement_file(args.output, sentences, gen, seed=args.seed, settings=settings,
                                   chunk_size=args.batch_size)
    print(f"{args.output}: {added} sentences added ({len(set(map(tuple, sentences)))} distinct in the data)")
    return 0
