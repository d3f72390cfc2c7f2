"""``fastprompt generate-ski`` (:func:`~fastprompt.methods.skicse.generation.generate_ski`) and ``fastprompt join-ski``
(:func:`~fastprompt.data.ski.join_ski`): SKICSE's training data, commands its registration brings to the command
line (``commands=`` of its :class:`~fastprompt.methods.MethodSpec`). Standard library only at import time."""
from __future__ import annotations

import argparse
import signal
import sys

from fastprompt.arguments import add_trust_remote_code_arg, positive_int
from fastprompt.choices import DTYPES, LLM_BACKENDS, SERVER_APIS

# ---------------------------------------------------------------------------------------- generate-ski
GENERATE_EPILOG = """\
examples:
  fastprompt generate-ski --input sentences.txt --output ski.csv
  fastprompt generate-ski --input ../shared/data/nli/snli-triplets.csv --column sent0 --output snli-ski.csv
  fastprompt generate-ski --llm server --url http://127.0.0.1:8000/v1 --model meta-llama/Llama-2-7b-chat-hf \\
      --concurrency 32 --input wiki1m.txt --output wiki1m-ski.csv

Writes FILE.csv (sent0,ski), FILE.csv.rejected.csv (sent0,answer,reason) and FILE.csv.meta.json.
Rows are appended as they complete: an interrupted run resumes when the same command is run again.
"""


def add_generate_ski_parser(subparsers) -> argparse.ArgumentParser:
    from fastprompt.methods.skicse.generation.prompt import Sampling
    from fastprompt.methods.skicse.generation.server import DEFAULT_API_KEY_ENV
    from fastprompt.model.gguf import DEFAULT_LOCAL_MODEL

    d = Sampling()
    p = subparsers.add_parser(
        "generate-ski", help="ask an LLM what it knows about each sentence (SKICSE's SKI) into a sent0,ski CSV",
        description="Generate SKICSE's sentence knowable information (SKI) for every distinct sentence of a file "
                    "with a local Hugging Face causal LM or an OpenAI-compatible server. Empty, over-long and "
                    "echo answers are re-sampled, then rejected and counted.",
        epilog=GENERATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("files")
    g.add_argument("--input", required=True, metavar="FILE",
                   help="UTF-8 text, one sentence per line, or a CSV with a header (see --column)")
    g.add_argument("--column", metavar="NAME", help="column of a CSV --input (default sent0)")
    g.add_argument("--output", required=True, metavar="FILE.csv", help="sent0,ski rows (appended to on resume)")
    g.add_argument("--limit", type=positive_int, metavar="N", help="only the first N distinct sentences")
    g.add_argument("--overwrite", action="store_true",
                   help="start over, deleting earlier output (needed to change settings of an existing output)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = p.add_argument_group("LLM")
    m.add_argument("--llm", choices=LLM_BACKENDS, default="local",
                   help="local: a Hugging Face causal LM in this process; server: an OpenAI-compatible server")
    m.add_argument("--model", metavar="NAME_OR_PATH",
                   help=f"local: {DEFAULT_LOCAL_MODEL} (SmolLM2-135M-Instruct GGUF, the default), a .gguf file, a "
                        "model folder or a hub id; server: the served model name (default: the only one it lists)")
    m.add_argument("--no-chat-template", action="store_true",
                   help="local: send the prompt raw even if the tokenizer has a chat template")
    add_trust_remote_code_arg(m, "local: ")
    loc = p.add_argument_group("local backend")
    loc.add_argument("--batch-size", type=positive_int, default=8, metavar="B", help="prompts per batch (8)")
    loc.add_argument("--device", help="torch device (default: cuda when available)")
    loc.add_argument("--dtype", choices=DTYPES, default="float32", help="weights dtype (float32)")
    loc.add_argument("--threads", type=positive_int, metavar="N", help="CPU threads for torch (default: torch's)")
    srv = p.add_argument_group("server backend")
    srv.add_argument("--url", metavar="URL", help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    srv.add_argument("--api", choices=SERVER_APIS, default="chat",
                     help="chat: /chat/completions (instruction models); completions: raw prompt (base models)")
    srv.add_argument("--concurrency", type=positive_int, default=8, metavar="C", help="requests in flight (8)")
    srv.add_argument("--timeout", type=float, default=300.0, metavar="S",
                     help="wall-clock seconds each attempt of a request may take, the whole answer included (300)")
    srv.add_argument("--max-retries", type=int, default=6, metavar="N",
                     help="retries of a request on transient errors, with exponential backoff (6; the openai client's)")
    srv.add_argument("--api-key-env", default=DEFAULT_API_KEY_ENV, metavar="VAR",
                     help=f"environment variable holding the API key, if any ({DEFAULT_API_KEY_ENV})")
    s = p.add_argument_group("prompt and sampling")
    s.add_argument("--prompt-template", metavar="TEXT",
                   help="replaces the SKICSE prompt; must contain {sentence} (see docs/ski.md)")
    s.add_argument("--max-new-tokens", type=positive_int, default=d.max_new_tokens, metavar="N",
                   help=f"token budget of an answer; one still going is rejected as too_long ({d.max_new_tokens})")
    s.add_argument("--temperature", type=float, default=d.temperature, metavar="T",
                   help=f"sampling temperature; 0 = greedy ({d.temperature})")
    s.add_argument("--top-p", type=float, default=d.top_p, metavar="P", help=f"nucleus sampling ({d.top_p})")
    s.add_argument("--seed", type=int, default=d.seed, help=f"sampling seed ({d.seed})")
    s.add_argument("--attempts", type=positive_int, default=5, metavar="K",
                   help="answers sampled per sentence until one passes the filters (5; 1 when greedy)")
    s.add_argument("--echo-threshold", type=float, default=0.8, metavar="R",
                   help="reject an answer when this fraction of its words occur in the sentence (0.8)")
    p.set_defaults(func=run_generate_ski)
    return p


def make_backend(args: argparse.Namespace):
    from fastprompt.methods.skicse.generation import LocalBackend, ServerBackend

    if args.llm == "server":
        if args.trust_remote_code:
            raise ValueError("--trust-remote-code is for --llm local (a server runs its model itself)")
        if not args.url:
            raise ValueError("--llm server needs --url (the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1)")
        return ServerBackend(args.url, args.model, api=args.api, concurrency=args.concurrency, timeout=args.timeout,
                             max_retries=args.max_retries, api_key_env=args.api_key_env)
    if args.url:
        raise ValueError("--url is for --llm server")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return LocalBackend(args.model, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                        chat_template=not args.no_chat_template, trust_remote_code=args.trust_remote_code)


def run_generate_ski(args: argparse.Namespace) -> int:
    from fastprompt.data.ski.files import read_input_sentences
    from fastprompt.io import check_apart, check_output_file
    from fastprompt.methods.skicse.generation import (
        SKI_PROMPT_TEMPLATE,
        AnswerFilter,
        LLMServerError,
        Sampling,
        generate_ski,
    )
    from fastprompt.methods.skicse.generation.prompt import check_template
    from fastprompt.methods.skicse.generation.store import SkiStore

    # Everything that can be checked cheaply fails before the model loads, and before anything is written: none
    # of the files generate-ski writes (--overwrite deletes them first) may be the input.
    store = SkiStore(check_output_file(args.output, "--output"))
    for path in (store.path, store.rejected_path, store.meta_path, store.lock_path):
        check_apart(path, (args.input,))
    template = check_template(args.prompt_template or SKI_PROMPT_TEMPLATE)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    answer_filter = AnswerFilter(args.echo_threshold)
    sentences, n_blank = read_input_sentences(args.input, args.column)
    if not sentences:
        raise ValueError(f"{args.input} has no sentences")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # kill -TERM: stop like Ctrl-C, rows kept
    try:
        backend = make_backend(args)
        report = generate_ski(sentences, backend, args.output, template=template, sampling=sampling,
                              answer_filter=answer_filter, attempts=args.attempts, limit=args.limit,
                              overwrite=args.overwrite, show_progress_bar=False if args.no_progress else None,
                              input_name=str(args.input))
    except LLMServerError as exc:
        print(f"fastprompt generate-ski: error: {exc} (rows already written are kept; rerun to resume)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fastprompt generate-ski: interrupted; rows already written to {args.output} are kept, "
              "run the same command again to resume", file=sys.stderr)
        return 130
    if n_blank:
        print(f"skipped {n_blank} blank input line(s)")
    print(report.summary())
    return 0


# ------------------------------------------------------------------------------------------- join-ski
JOIN_EPILOG = """\
examples:
  fastprompt generate-ski --input data/nli_for_simcse.csv --column sent0 --output data/nli-ski.csv
  fastprompt join-ski --nli data/nli_for_simcse.csv --ski data/nli-ski.csv --output data/nli-ski-triplets.csv
  fastprompt train --config configs/skicse-sup-bert-base.yaml --set train_file=data/nli-ski-triplets.csv

Every NLI row whose sent0 has a SKI is written with a ski column appended (sent0,sent1,hard_neg -> sent0,sent1,
hard_neg,ski; sent0,sent1 -> sent0,sent1,ski); rows without a SKI are left out and counted.
"""


def add_join_ski_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "join-ski", help="append the SKI of each NLI premise to the NLI rows: supervised SKICSE's training file",
        description="Join a generate-ski output (sent0,ski) onto an NLI file (sent0,sent1[,hard_neg]) by the "
                    "premise sent0, and write the rows that have a SKI as a CSV for objective=skicse.",
        epilog=JOIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nli", required=True, metavar="FILE",
                   help="NLI rows: a CSV with the header sent0,sent1[,hard_neg]")
    p.add_argument("--ski", required=True, metavar="FILE",
                   help="the SKI of the premises: a sent0,ski CSV written by fastprompt generate-ski")
    p.add_argument("--output", required=True, metavar="FILE.csv", help="the joined rows (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.set_defaults(func=run_join_ski)
    return p


def run_join_ski(args: argparse.Namespace) -> int:
    from fastprompt.data.ski.files import join_ski, write_examples_csv
    from fastprompt.io import check_apart, check_output_file

    out = check_output_file(args.output, "--output")
    check_apart(out, (args.nli, args.ski))
    if out.exists() and not args.overwrite:
        raise ValueError(f"--output {args.output} exists; pass --overwrite to replace it")
    joined = join_ski(args.nli, args.ski)
    write_examples_csv(joined, out)
    total = len(joined) + joined.skipped["rows without SKI"]
    print(f"wrote {len(joined)} of {total} NLI rows with their SKI to {out} ({','.join(joined.columns)}); "
          f"{joined.skipped['rows without SKI']} NLI row(s) had no SKI and were left out")
    other = {k: v for k, v in joined.skipped.items() if v and k != "rows without SKI"}
    if other:
        print("skipped in the NLI file: " + ", ".join(f"{v} {k}" for k, v in other.items()))
    return 0
