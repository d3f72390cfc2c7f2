"""Training-file readers: text corpus, pair/triplet CSV, format detection, and their error messages."""
import pytest

from fastprompt.data import load_train_file, read_pair_csv, read_text_corpus


def test_text_corpus_skips_and_counts_empty_lines(tmp_path):
    p = tmp_path / "c.txt"
    p.write_bytes(b"\xef\xbb\xbfFirst sentence.\n\n   \nSecond one.\r\nThird\n")
    ex = read_text_corpus(p)
    assert ex.rows == [("First sentence.",), ("Second one.",), ("Third",)]
    assert ex.columns == ("sent0",) and ex.n_views == 2 and not ex.has_hard_negatives
    assert ex.skipped["empty lines"] == 2


def test_text_corpus_reports_undecodable_line_numbers(tmp_path):
    p = tmp_path / "c.txt"
    p.write_bytes(b"ok one\nbad \xff\xfe here\nok two\nalso \xc3 bad\n")
    with pytest.raises(ValueError, match=r"2 line\(s\) are not valid UTF-8: line 2 \(byte 4\), line 4 \(byte 5\)"):
        read_text_corpus(p)
    ex = read_text_corpus(p, on_decode_error="skip")
    assert ex.rows == [("ok one",), ("ok two",)]
    assert ex.skipped["undecodable lines"] == 2


@pytest.mark.parametrize("content", [b"", b"\n \n\n"])
def test_empty_corpus_is_a_clear_error(tmp_path, content):
    p = tmp_path / "c.txt"
    p.write_bytes(content)
    with pytest.raises(ValueError, match="contains no sentences"):
        read_text_corpus(p)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="training file not found"):
        load_train_file(tmp_path / "nope.txt")


def test_csv_pairs_and_triplets(tmp_path):
    p = tmp_path / "pairs.csv"
    p.write_text('sent0,sent1\n"A, quoted",b\n\nc,\nd,e\n', encoding="utf-8")
    ex = read_pair_csv(p)
    assert ex.columns == ("sent0", "sent1") and ex.n_views == 2
    assert ex.rows == [("A, quoted", "b"), ("d", "e")]
    assert ex.skipped["rows with an empty or missing cell"] == 1
    t = tmp_path / "trip.csv"
    t.write_text("id,hard_neg,sent1,sent0\n1,n1,p1,a1\n2,n2,p2,a2\n", encoding="utf-8")
    ex = read_pair_csv(t)  # columns found by name, extra columns ignored
    assert ex.columns == ("sent0", "sent1", "hard_neg") and ex.has_hard_negatives and ex.n_views == 3
    assert ex.rows == [("a1", "p1", "n1"), ("a2", "p2", "n2")]


def test_csv_without_expected_columns(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("premise,hypothesis\na,b\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"missing \['sent0', 'sent1'\]"):
        read_pair_csv(p)
    q = tmp_path / "hdr.csv"
    q.write_text("sent0,sent1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="contains no complete rows"):
        read_pair_csv(q)


def test_format_detection(tmp_path):
    c = tmp_path / "data.tsvish"
    c.write_text("sent0,sent1,hard_neg\na,b,c\nd,e,f\n", encoding="utf-8")
    assert load_train_file(c).columns == ("sent0", "sent1", "hard_neg")
    t = tmp_path / "data.dat"
    t.write_text("a sentence, with a comma\nanother\n", encoding="utf-8")
    assert load_train_file(t).columns == ("sent0",)
    # an explicit format wins over the extension
    assert load_train_file(c, fmt="text").rows[0] == ("sent0,sent1,hard_neg",)
    with pytest.raises(ValueError, match="train_format"):
        load_train_file(t, fmt="json")


def test_real_snli_triplets(shared_data):
    ex = load_train_file(shared_data / "nli" / "snli-triplets.csv")
    assert ex.has_hard_negatives and len(ex) == 5864


# ------------------------------------------------------------------ binary files and broken CSV


@pytest.mark.parametrize("name", ["train.csv", "train.bin", "train.txt"])
def test_binary_file_is_a_clear_error(tmp_path, name):
    """Binary content (here ASCII-decodable, so UTF-8 decoding alone would accept it) is named as such, with the
    line of its first NUL byte, instead of _csv.Error from the CSV reader or NUL-filled "sentences"."""
    p = tmp_path / name
    p.write_bytes(b"sent0,sent1\nPK\x03\x04\x14\x00\x00\x00\x08\x00\n" * 3)
    with pytest.raises(ValueError, match=rf"{name}: a binary file, not UTF-8 text \(a NUL byte on line 2\)"):
        load_train_file(p)


def test_csv_the_reader_rejects_is_a_clear_error(tmp_path):
    """An unclosed quote swallows the rest of the file into one field, past the csv module's field limit."""
    p = tmp_path / "pairs.csv"
    p.write_text('sent0,sent1\n"a,b\n' + "x" * 200_000 + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"pairs.csv: not a valid CSV file \(line [0-9]+: field larger than"):
        read_pair_csv(p)


def test_tsv_pairs_are_read_as_pairs(tmp_path):
    """A .tsv of pairs was read as a one-column corpus (each pair one "sentence" with a tab inside)."""
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("sent0\tsent1\nA man, smiling.\ta person\nthe dog\ta cat\n", encoding="utf-8")
    ex = load_train_file(tsv)
    assert ex.columns == ("sent0", "sent1") and ex.rows == [("A man, smiling.", "a person"), ("the dog", "a cat")]
    txt = tmp_path / "pairs.txt"  # the same header in a .txt, or any other name: found by its header
    txt.write_bytes(tsv.read_bytes())
    assert load_train_file(txt).rows == ex.rows
    assert load_train_file(tsv, fmt="tsv").rows == ex.rows


def test_a_headerless_tab_table_is_refused_unless_text_is_asked_for(tmp_path):
    path = tmp_path / "pairs.tsv.txt"
    path.write_text("the dog\ta cat\ntwo men\tpeople\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"every line holds a tab, so it looks like tab-separated pairs, which a text "
                                         r"corpus would read as one sentence per line; give it a header line "
                                         r"sent0<TAB>sent1"):
        load_train_file(path)
    assert load_train_file(path, fmt="text").rows == [("the dog\ta cat",), ("two men\tpeople",)]
    bare = tmp_path / "pairs.tsv"
    bare.write_text("the dog\ta cat\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tab-separated file .* must have a header with columns sent0,sent1"):
        load_train_file(bare)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_train_file_that_is_no_file_says_what_it_is(tmp_path, kind):
    import os

    path = tmp_path / "corpus.txt"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    expected = "is a directory, not a file" if kind == "directory" else "is a pipe, not a regular file"
    with pytest.raises((OSError, ValueError), match=f"training file {path} {expected}"):
        load_train_file(path)


def test_the_pair_reader_refers_a_ski_file_to_its_reader_and_load_train_file_reads_it(tmp_path):
    """corpus.py knows no other layout (the dispatch is train_files.py's): a sent0,ski file given to read_pair_csv
    is a clear error naming the readers that take it, and load_train_file reads it as SKI rows in both modes."""
    p = tmp_path / "ski.csv"
    p.write_text("sent0,ski\nA cat sleeps.,Cats sleep a lot.\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"ski.csv is a sent0,ski file .*read_ski_csv or .*load_train_file"):
        read_pair_csv(p)
    for fmt in ("auto", "csv"):
        assert load_train_file(p, fmt=fmt).rows == [("A cat sleeps.", "Cats sleep a lot.")]
