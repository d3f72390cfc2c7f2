"""The default corpus embedded in the gensim wheel's test data."""
import pytest

from fastprompt.data import BUILTIN_WIKI, load_train_file, read_text_corpus, write_builtin_corpus

pytest.importorskip("gensim")


def test_builtin_corpus_is_clean_deterministic_prose(tmp_path):
    ex = load_train_file(BUILTIN_WIKI)
    assert ex.columns == ("sent0",)
    assert 10_000 < len(ex) < 30_000
    sents = [r[0] for r in ex.rows]
    assert len(set(sents)) == len(sents)
    for s in sents:
        assert 8 <= len(s.split()) <= 60
        assert s[0].isupper() and s[-1] in ".!?\"'"
        assert not any(ch in s for ch in "[]{}|<>=")
    # the round trip through a file gives the same rows (what users do to inspect or edit it)
    n = write_builtin_corpus(tmp_path / "wiki.txt")
    assert n == len(ex) and read_text_corpus(tmp_path / "wiki.txt").rows == ex.rows
