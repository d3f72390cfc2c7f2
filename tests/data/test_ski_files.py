"""SKI files as training data: read_ski_csv, join_ski onto NLI triplets, and the generation input reader."""
import csv

import pytest

from fastprompt.data import SKI_TRIPLET_COLUMNS, join_ski, read_pair_csv, read_ski_csv
from fastprompt.data.ski import read_input_sentences, write_examples_csv


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_read_ski_csv(tmp_path):
    path = _write(tmp_path / "ski.csv", 'sent0,ski,extra\nA cat.,"Cats are pets, mostly.",x\n'
                                        'Empty.,,x\nA cat.,Again.,x\n\n"Line, two.",Knowledge two.,x\n')
    ex = read_ski_csv(path)
    assert ex.columns == ("sent0", "ski")
    assert ex.rows == [("A cat.", "Cats are pets, mostly."), ("Line, two.", "Knowledge two.")]
    assert ex.skipped == {"rows with an empty or missing cell": 1, "repeated sentences": 1, "incomplete last line": 0}


def test_read_ski_csv_errors(tmp_path):
    with pytest.raises(ValueError, match=r"header sent0,ski.*missing \['ski'\]"):
        read_ski_csv(_write(tmp_path / "a.csv", "sent0,sent1\na,b\n"))
    with pytest.raises(ValueError, match="no complete rows"):
        read_ski_csv(_write(tmp_path / "b.csv", "sent0,ski\na,\n"))
    with pytest.raises(FileNotFoundError, match="SKI file not found"):
        read_ski_csv(tmp_path / "missing.csv")
    (tmp_path / "c.csv").write_bytes(b"sent0,ski\na,\xff\n")
    with pytest.raises(ValueError, match=r"not valid UTF-8 \(line 2"):
        read_ski_csv(tmp_path / "c.csv")


def test_a_torn_last_line_of_a_generation_output_is_left_out(tmp_path):
    text = 'sent0,ski\nA.,Knowledge A.\nB.,"Knowledge B, cut'
    path = _write(tmp_path / "ski.csv", text)
    assert read_ski_csv(path).rows == [("A.", "Knowledge A."), ("B.", "Knowledge B, cut")]  # a hand-made file
    _write(tmp_path / "ski.csv.meta.json", "{}")  # written by generate-ski: rows always end with a newline
    ex = read_ski_csv(path)
    assert ex.rows == [("A.", "Knowledge A.")] and ex.skipped["incomplete last line"] == 1


def test_join_ski_onto_triplets(tmp_path):
    nli = _write(tmp_path / "nli.csv", "sent0,sent1,hard_neg\nP1.,E1.,C1.\nP2.,E2.,C2.\nP1.,E3.,C3.\n")
    ski = _write(tmp_path / "ski.csv", "sent0,ski\nP1.,Knows P1.\nOther.,Unused.\n")
    joined = join_ski(nli, ski)
    assert joined.columns == SKI_TRIPLET_COLUMNS == ("sent0", "sent1", "hard_neg", "ski")
    assert joined.rows == [("P1.", "E1.", "C1.", "Knows P1."), ("P1.", "E3.", "C3.", "Knows P1.")]
    assert joined.skipped["rows without SKI"] == 1
    # the same from already-read rows and a mapping; pairs get sent0,sent1,ski
    assert join_ski(read_pair_csv(nli), {"P1.": "Knows P1."}).rows == joined.rows
    pairs = _write(tmp_path / "pairs.csv", "sent0,sent1\nP1.,E1.\n")
    assert join_ski(pairs, ski).columns == ("sent0", "sent1", "ski")
    with pytest.raises(ValueError, match="has a SKI"):
        join_ski(nli, {"nothing": "x"})
    out = tmp_path / "joined.csv"
    write_examples_csv(joined, out)
    with open(out, newline="") as f:
        assert [tuple(r) for r in csv.reader(f)] == [SKI_TRIPLET_COLUMNS, *joined.rows]


def test_join_onto_the_shared_snli_triplets(shared_data):
    nli = read_pair_csv(shared_data / "nli" / "snli-triplets.csv")
    premises = list(dict.fromkeys(r[0] for r in nli.rows))[:3]
    joined = join_ski(nli, {p: f"SKI of {p}" for p in premises})
    assert {r[0] for r in joined.rows} == set(premises)
    assert all(r[3] == f"SKI of {r[0]}" and r[:3] in nli.rows for r in joined.rows)
    assert len(joined.rows) + joined.skipped["rows without SKI"] == len(nli.rows)


def test_read_input_sentences(tmp_path):
    text = _write(tmp_path / "in.txt", "\ufeffFirst one.\n\n  Second one.  \r\nFirst one.\n")
    assert read_input_sentences(text) == (["First one.", "Second one.", "First one."], 1)
    nli = _write(tmp_path / "nli.csv", "sent0,sent1,hard_neg\nP1.,E1.,C1.\n,E2.,C2.\n")
    assert read_input_sentences(nli) == (["P1."], 1)
    assert read_input_sentences(nli, "hard_neg") == (["C1.", "C2."], 0)
    with pytest.raises(ValueError, match="no column 'ski'"):
        read_input_sentences(nli, "ski")
    with pytest.raises(ValueError, match="--column applies to CSV"):
        read_input_sentences(text, "sent0")
    with pytest.raises(FileNotFoundError, match="input file not found"):
        read_input_sentences(tmp_path / "missing.txt")
