"""Query / positives / negatives rows (FlagEmbedding JSONL, sentence-transformers-like CSV): reading, k negatives
per row, ragged counts, padding, errors, and what the trainer's sampler and collator make of them."""
import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fastprompt.data import Collator, load_train_file, sentence_keys
from fastprompt.data.collate import text_id
from fastprompt.data.retrieval import MAX_LINE_BYTES, PAD_TEXT, read_query_jsonl


def _jsonl(tmp_path, rows, name="train.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


ROWS = [{"query": "q1", "pos": ["p1"], "neg": ["n1", "n2"]},
        {"query": "q2", "pos": ["p2a", "p2b"], "neg": ["n3", "n4"], "pos_scores": [1, 1]},
        {"anchor": "q3", "positive": "p3", "negative": ["n5", "n6"]}]


def test_flagembedding_jsonl_is_read_as_query_positive_and_k_negatives(tmp_path):
    ex = load_train_file(_jsonl(tmp_path, ROWS))
    assert ex.columns == ("sent0", "sent1", "hard_neg", "hard_neg_2") and ex.num_negatives == 2
    # a row with two positives trains two rows (one per positive), with the same negatives
    assert ex.rows == [("q1", "p1", "n1", "n2"), ("q2", "p2a", "n3", "n4"), ("q2", "p2b", "n3", "n4"),
                       ("q3", "p3", "n5", "n6")]


def test_one_negative_per_row_is_simcse_triplets_and_none_is_pairs(tmp_path):
    one = load_train_file(_jsonl(tmp_path, [{"query": "a", "pos": ["b"], "neg": ["c"]}] * 2, "one.jsonl"))
    assert one.columns == ("sent0", "sent1", "hard_neg") and one.has_hard_negatives
    zero = load_train_file(_jsonl(tmp_path, [{"query": "a", "pos": "b"}, {"query": "c", "pos": ["d"], "neg": []}],
                                  "zero.jsonl"))
    assert zero.columns == ("sent0", "sent1") and zero.rows == [("a", "b"), ("c", "d")]


def test_csv_with_sentence_transformers_columns(tmp_path):
    path = tmp_path / "st.csv"
    path.write_text("anchor,positive,negative_1,negative_2,score\nq1,p1,n1,n2,1\nq2,p2,n3,n4,0\n", encoding="utf-8")
    ex = load_train_file(path)
    assert ex.columns == ("sent0", "sent1", "hard_neg", "hard_neg_2")
    assert ex.rows == [("q1", "p1", "n1", "n2"), ("q2", "p2", "n3", "n4")]
    tsv = tmp_path / "st.tsv"
    tsv.write_text("query\tpos\tneg\nq\tp\tn\n", encoding="utf-8")
    assert load_train_file(tsv).rows == [("q", "p", "n")]
    txt = tmp_path / "st.txt"  # a header is recognised whatever the extension
    txt.write_text("query,positive\nq,p\nr,s\n", encoding="utf-8")
    assert load_train_file(txt).columns == ("sent0", "sent1")


def test_ragged_negatives_are_an_error_unless_k_is_given(tmp_path):
    rows = [{"query": "q1", "pos": ["p1"], "neg": ["a", "b", "c"]}, {"query": "q2", "pos": ["p2"], "neg": ["d"]}]
    path = _jsonl(tmp_path, rows)
    with pytest.raises(ValueError, match="between 1 and 3 negatives; set negatives_per_row"):
        load_train_file(path)
    with pytest.raises(ValueError, match=r"1 row\(s\) have fewer than negatives_per_row=2 .*row 2, with 1"):
        load_train_file(path, negatives_per_row=2)
    # k = 1: the row with 3 is sampled down (seeded: the same sample on every load)
    one = load_train_file(path, negatives_per_row=1, seed=5)
    assert one.rows[0][2] in "abc" and one.rows[1] == ("q2", "p2", "d")
    assert load_train_file(path, negatives_per_row=1, seed=5).rows == one.rows
    samples = {load_train_file(path, negatives_per_row=1, seed=s).rows[0][2] for s in range(20)}
    assert len(samples) > 1  # the seed decides
    # padding: the short row gets a padding column, which has no sentence key and the text id -1
    padded = load_train_file(path, negatives_per_row=3, pad_negatives=True)
    assert padded.rows[1] == ("q2", "p2", "d", PAD_TEXT, PAD_TEXT)
    assert sentence_keys(padded.rows)[1] == (5, 6, 7)  # q2, p2, d: the pads are no sentence
    assert text_id(PAD_TEXT) == -1 and text_id("d") >= 0


def test_zero_negatives_per_row_drops_them(tmp_path):
    ex = load_train_file(_jsonl(tmp_path, ROWS[:2]), negatives_per_row=0)
    assert ex.columns == ("sent0", "sent1") and ex.rows[0] == ("q1", "p1")


@pytest.mark.parametrize("line, message", [
    ('{"query": "q", "neg": ["n"]}', "no positives"),
    ('{"query": "q", "pos": []}', "no positives"),
    ('{"query": "", "pos": ["p"]}', "an empty query"),
    ('{"pos": ["p"]}', "no query"),
    ('{"query": "q", "pos": ["  "]}', "an empty positive"),
    ('{"query": "q", "pos": ["p"], "neg": ["n", ""]}', "an empty negative"),
    ('{"query": "q", "pos": [1]}', "must be a string or a list of strings"),
    ('{"query": "q", "query_text": "x", "anchor": "a", "pos": "p"}', "name the same thing"),
    ('["q", "p"]', "not an object"),
    ('{"query": "q", "pos": ["p"]', "not a JSON object"),
])
def test_bad_rows_name_their_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"query": "ok", "pos": ["fine"]}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        load_train_file(path)
    assert "bad.jsonl:2" in str(info.value)


@pytest.mark.parametrize("line, message", [
    (b'{"query": 12345, "pos": "p"}', "the query must be a string, got 12345"),
    (b'{"query": ["q"], "pos": "p"}', r"the query must be a string, got \['q'\]"),
    (b'{"query": "caf\xe9", "pos": "p"}', r"not valid UTF-8 \(byte 14 of the line: invalid continuation byte\)"),
    (b'{"query": "\\ud800", "pos": "p"}', r"not valid Unicode \(the query holds a lone surrogate '\\ud800' at "
                                         "character 0"),
    (b'{"query": "q", "pos": ["p", "x\\udfff"]}', "not valid Unicode \\(the positive holds a lone surrogate"),
    (b'{"query": "q", "pos": "p", "neg": "\\ud83d"}', "not valid Unicode \\(the negative holds a lone surrogate"),
    (b'{"query": "a\\u0000b", "pos": "p"}', r"the query holds a NUL character at character 1 \(a JSON "),
    (b'{"query": "q", "pos": ["p", "\\u0000"]}', "the positive holds a NUL character at character 0"),
    (b'{"query": "q", "pos": "p", "neg": "x\\u0000"}', "the negative holds a NUL character at character 1"),
], ids=["int-query", "list-query", "latin-1", "surrogate-query", "surrogate-positive", "surrogate-negative",
        "nul-query", "nul-positive", "nul-negative"])
def test_a_query_of_the_wrong_type_bytes_that_are_not_utf8_and_lone_surrogates_are_named(tmp_path, line, message):
    """Issue 40 items 14 and 10: a number as the query was "no query found", a latin-1 byte "not a JSON object", and a
    lone surrogate escape reached the tokenizer (a TypeError traceback); each now names its line and what is wrong.
    A JSON "\\u0000" (which the raw-byte NUL check cannot see) is refused by the reader too: the trainer refused it
    later, naming a row rather than the line, and ``mine-negatives`` embedded it as text."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"query": "ok", "pos": ["fine"]}\n' + line + b"\n")
    with pytest.raises(ValueError, match=message) as info:
        load_train_file(path)
    assert f"{path}:2: " in str(info.value)


def test_rows_sharing_one_query_say_so_when_no_batch_forms(tmp_path):
    """Issue 40 item 14: 40 rows with one query (and 40 positives) said "make no batch of batch_size=8"; rows sharing
    a query never go into one batch, so there is only one row per batch."""
    from fastprompt.train import TrainConfig
    from fastprompt.train.build import build_sampler
    from fastprompt.train.distributed import DistributedContext

    ex = load_train_file(_jsonl(tmp_path, [{"query": "the one query", "pos": [f"positive {i}"]} for i in range(40)]))
    with pytest.raises(ValueError, match=r"has 40 rows but only 1 distinct query: a batch never holds a sentence "
                                         r"twice .* no batch of batch_size=8 can be formed"):
        build_sampler(TrainConfig(batch_size=8), ex, DistributedContext())


def test_csv_rows_without_a_positive_or_query_are_errors(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("query,positive,negative\nq,,n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="record 2: no positive"):
        load_train_file(path)
    path.write_text("query,positive,negative\n,p,n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="record 2: an empty query"):
        load_train_file(path)


def test_bounds_and_empty_files(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_bytes(b'{"query": "' + b"x" * (MAX_LINE_BYTES + 10) + b'", "pos": ["p"]}\n')
    with pytest.raises(ValueError, match="longer than"):
        read_query_jsonl(path)
    path = _jsonl(tmp_path, [{"query": "q", "pos": ["p"], "neg": [f"n{i}" for i in range(1025)]}], "many.jsonl")
    with pytest.raises(ValueError, match="at most 1024"):
        load_train_file(path)
    (tmp_path / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="contains no rows"):
        load_train_file(tmp_path / "empty.jsonl")


def test_jsonl_read_as_text_is_refused(tmp_path):
    """The bug of the issue: a JSONL file with another extension was read as a one-column corpus, silently."""
    path = _jsonl(tmp_path, ROWS, name="train.txt")
    with pytest.raises(ValueError, match="every line is a JSON object.*train_format=jsonl"):
        load_train_file(path)
    assert load_train_file(path, fmt="jsonl").num_negatives == 2
    assert load_train_file(path, fmt="text").columns == ("sent0",)  # asked for explicitly


def test_collator_gives_k_negative_views_and_text_ids(tmp_path):
    ex = load_train_file(_jsonl(tmp_path, ROWS[:1] + [{"query": "q9", "pos": ["p9"], "neg": ["n9"]}]),
                         negatives_per_row=2, pad_negatives=True)

    def tok(texts, max_length):
        ids = torch.tensor([[101, len(t) + 1, 102] for t in texts])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    batch = Collator(tok, 8, columns=ex.columns, text_ids=True)(ex.rows)
    assert batch.view_names == ("sent0", "sent1", "hard_neg", "hard_neg_2") and batch.n_views == 4
    ids = batch.text_ids.view(4, 2)
    assert ids[3, 1] == -1 and (ids[:3] >= 0).all()  # row 2's second negative is padding
    assert ids[0, 0] == text_id("q1") and ids[2, 1] == text_id("n9")
    assert batch.input_ids[7, 1] == 1  # the padding is tokenised as an empty text
    assert batch.to("cpu").text_ids is not None


@settings(max_examples=80, deadline=None)
@given(st.lists(st.fixed_dictionaries({"query": st.one_of(st.text(max_size=5), st.integers()),
                                       "pos": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4),
                                                                                        max_size=3)),
                                       "neg": st.lists(st.text(max_size=4), max_size=3)}), max_size=4),
       st.one_of(st.none(), st.integers(0, 3)), st.booleans())
@example([{"query": "q", "pos": "p", "neg": ["\u2028"]}], None, False)
def test_any_jsonl_rows_are_fixed_width_rows_or_one_clear_error(tmp_path_factory, rows, k, pad):
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    try:
        ex = load_train_file(path, negatives_per_row=k, pad_negatives=pad and k is not None)
    except ValueError as exc:
        assert "\n" not in str(exc) and "rows.jsonl" in str(exc)
        return
    assert ex.rows and all(len(r) == len(ex.columns) and all(t.strip() for t in r) for r in ex.rows)
    assert k is None or ex.num_negatives == k
