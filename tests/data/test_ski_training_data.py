"""SKI files as training data: load_train_file reads both layouts, and the collator yields the SKI as a view.

fixtures/ski-wiki-10.csv: the first 10 rows of a `fastprompt generate-ski` output (SmolLM2-135M-Instruct on the
wiki sentences of ../shared/data, default settings), a real file of the generator.
"""
import csv
from pathlib import Path

import pytest

from fastprompt.data import Collator, hf_tokenize, join_ski, load_train_file
from fastprompt.data.ski import write_examples_csv

FIXTURE = Path(__file__).parent / "fixtures" / "ski-wiki-10.csv"


def test_a_generate_ski_output_loads_as_sent0_ski_rows(tmp_path):
    ex = load_train_file(FIXTURE)
    assert ex.columns == ("sent0", "ski") and len(ex) == 10
    assert all(s and k and s != k for s, k in ex.rows)
    # without a .csv suffix the header decides
    other = tmp_path / "ski_output"
    other.write_bytes(FIXTURE.read_bytes())
    assert load_train_file(other).rows == ex.rows
    assert load_train_file(other, fmt="csv").columns == ("sent0", "ski")


@pytest.mark.parametrize("header", ["sent0,sent1,hard_neg", "sent0,sent1"])
def test_nli_rows_joined_with_ski_keep_the_ski_column(tmp_path, header):
    ski = load_train_file(FIXTURE)
    premises = [s for s, _ in ski.rows[:3]] + ["a premise without SKI"]
    nli = tmp_path / "nli.csv"
    width = len(header.split(","))
    with open(nli, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(header.split(","))
        writer.writerows([p] + [f"h{i}{j}" for j in range(width - 1)] for i, p in enumerate(premises))
    joined = tmp_path / "nli-ski.csv"
    write_examples_csv(join_ski(nli, FIXTURE), joined)
    ex = load_train_file(joined)
    assert ex.columns == (*header.split(","), "ski") and len(ex) == 3
    assert [r[-1] for r in ex.rows] == [k for _, k in ski.rows[:3]]
    assert ex.has_hard_negatives == ("hard_neg" in header)


def test_the_collator_yields_the_ski_view(tiny_bert_dir):
    from transformers import AutoTokenizer

    from fastprompt.methods.skicse.objective import SKICSE

    ex = load_train_file(FIXTURE)
    views = SKICSE().views_for(ex.columns)
    tokenize = hf_tokenize(AutoTokenizer.from_pretrained(tiny_bert_dir))
    batch = Collator(tokenize, 24, columns=ex.columns, views=views)(ex.rows[:4])
    assert batch.view_names == ("sent0", "sent0", "ski") and batch.n_views == 3
    want = tokenize([k for _, k in ex.rows[:4]], 24)["input_ids"]
    got = batch.input_ids[8:12, :want.shape[1]]
    assert (got == want).all()
    assert (batch.input_ids[:4] == batch.input_ids[4:8]).all()  # the sentence twice: two dropout views
