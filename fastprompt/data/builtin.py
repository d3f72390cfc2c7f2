"""The embedded default corpus: English Wikipedia sentences from the gensim wheel's test data.

gensim ships a shortened English Wikipedia dump (``enwiki-latest-pages-articles1.xml-...-shortened.bz2``,
CC BY-SA) among its test files. We read it from the installed package (no download), strip the wiki markup
with gensim's own ``filter_wiki``, split paragraphs into sentences and keep the 8–60-word ones, the
sentence length range of SimCSE's wiki1m. Extraction is deterministic and takes about a second.
"""
from __future__ import annotations

import bz2
import importlib.util
import logging
import re
from pathlib import Path

from fastprompt.data.corpus import BUILTIN_WIKI, TrainExamples
from fastprompt.io import write_text_atomic

logger = logging.getLogger(__name__)

DUMP_NAME = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MIN_WORDS, MAX_WORDS = 8, 60

# A sentence ends at . ! or ? (optionally followed by a closing quote/bracket) before whitespace and an
# upper-case letter, digit or opening quote. Abbreviations such as "e.g. the" are not split (lower case).
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[\"'(]?[A-Z0-9])")
_LEFTOVER_MARKUP = re.compile(r"[\[\]{}|<>=_*#]|https?:|\s\)|\(\s*\)|\(\s*[,;]")


def gensim_wiki_dump() -> Path:
    """Path of the Wikipedia dump inside the installed gensim package (FileNotFoundError if absent)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the built-in corpus ({BUILTIN_WIKI}) is read from the gensim package's test data, but gensim is "
            "not installed: pip install gensim (scripts/setup.sh does), or set train_file to your own corpus"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / DUMP_NAME
    if not path.is_file():
        raise FileNotFoundError(f"gensim is installed but its test data has no {DUMP_NAME} (looked at {path})")
    return path


def _clean_paragraph(text: str) -> str:
    text = text.replace("'''", "").replace("''", "")
    return re.sub(r"\s+", " ", text).strip()


def extract_sentences(dump: Path | None = None) -> list[str]:
    """All distinct 8–60-word sentences of the dump's articles, in article order."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    dump = dump or gensim_wiki_dump()
    seen: set[str] = set()
    out: list[str] = []
    with bz2.open(dump, "rb") as f:
        for title, text, _pageid in extract_pages(f):
            if ":" in title or not text or text.lstrip().lower().startswith("#redirect"):
                continue  # redirects and non-article namespaces (File:, Category:, ...)
            for para in filter_wiki(text).split("\n"):
                para = para.strip()
                # headings, list items, tables and template leftovers are not prose
                if not para or para[0] in "=*#:;|!{}[<" or para.endswith(":"):
                    continue
                for sent in _SENTENCE_END.split(_clean_paragraph(para)):
                    sent = sent.strip()
                    n_words = len(sent.split())
                    if not (MIN_WORDS <= n_words <= MAX_WORDS) or sent[-1] not in ".!?\"'":
                        continue
                    if not sent[0].isupper() or _LEFTOVER_MARKUP.search(sent) or sent in seen:
                        continue
                    seen.add(sent)
                    out.append(sent)
    return out


def builtin_wiki_corpus() -> TrainExamples:
    """The embedded corpus as unsupervised training rows."""
    dump = gensim_wiki_dump()
    sentences = extract_sentences(dump)
    logger.info("built-in corpus: %d Wikipedia sentences extracted from %s", len(sentences), dump)
    return TrainExamples(columns=("sent0",), rows=[(s,) for s in sentences], source=f"{BUILTIN_WIKI} ({dump})")


def write_builtin_corpus(path: str | Path) -> int:
    """Write the embedded corpus to ``path``, one sentence per line; returns the number of sentences."""
    sentences = extract_sentences()
    write_text_atomic(path, "".join(s + "\n" for s in sentences), "corpus")
    return len(sentences)
