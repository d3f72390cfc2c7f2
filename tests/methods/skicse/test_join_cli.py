"""``fastprompt join-ski``: NLI rows joined with the SKI of their premises from the command line."""
import csv

import pytest

from fastprompt.cli import main
from fastprompt.data import SKI_TRIPLET_COLUMNS, join_ski, load_train_file

NLI = 'sent0,sent1,hard_neg\nP1.,E1.,C1.\nP2.,E2.,C2.\n"P1.","E3, too.",C3.\n,E4.,C4.\n'
SKI = 'sent0,ski\nP1.,"Knows P1, well."\nOther.,Unused.\n'


@pytest.fixture
def files(tmp_path):
    (tmp_path / "nli.csv").write_text(NLI, encoding="utf-8")
    (tmp_path / "ski.csv").write_text(SKI, encoding="utf-8")
    return tmp_path


def _join(d, *extra):
    return main(["join-ski", "--nli", str(d / "nli.csv"), "--ski", str(d / "ski.csv"), "--output",
                 str(d / "out.csv"), *extra])


def test_join_ski_writes_the_joined_rows_and_reports_the_counts(files, capsys):
    assert _join(files) == 0
    out = capsys.readouterr().out
    assert "wrote 2 of 3 NLI rows" in out and "1 NLI row(s) had no SKI" in out
    assert "skipped in the NLI file: 1 rows with an empty or missing cell" in out
    with open(files / "out.csv", newline="", encoding="utf-8") as f:
        rows = [tuple(r) for r in csv.reader(f)]
    # the same rows as the Python API, quoting included
    assert rows == [SKI_TRIPLET_COLUMNS, *join_ski(files / "nli.csv", files / "ski.csv").rows]
    assert rows[2] == ("P1.", "E3, too.", "C3.", "Knows P1, well.")
    # and training reads it as supervised SKICSE rows
    assert load_train_file(files / "out.csv").columns == SKI_TRIPLET_COLUMNS
    assert not [p.name for p in files.iterdir() if ".tmp" in p.name]  # atomic write: no temporary left


def test_join_ski_refuses_to_overwrite(files, capsys):
    (files / "out.csv").write_text("keep me\n")
    assert _join(files) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists; pass --overwrite" in err
    assert (files / "out.csv").read_text() == "keep me\n"
    assert _join(files, "--overwrite") == 0
    assert (files / "out.csv").read_text().startswith("sent0,sent1,hard_neg,ski\n")


def test_join_ski_errors_are_one_line(files, capsys):
    nli, ski, out = (str(files / n) for n in ("nli.csv", "ski.csv", "o.csv"))
    cases = [
        ((nli, ski, nli, "--overwrite"), "is the input file"),
        ((nli, nli, out), "header sent0,ski"),
        ((str(files / "missing.csv"), ski, out), "missing.csv"),
    ]
    for (n, k, o, *extra), message in cases:
        assert main(["join-ski", "--nli", n, "--ski", k, "--output", o, *extra]) == 2, message
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert (files / "nli.csv").read_text(encoding="utf-8") == NLI
    (files / "ski.csv").write_text("sent0,ski\nNone of these.,x\n")
    assert _join(files) == 2
    assert "has a SKI" in capsys.readouterr().err
    assert not (files / "out.csv").exists()
