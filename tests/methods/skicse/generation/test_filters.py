"""Answer filters (empty, over-long, echo), re-sampling of rejected answers, and the counts they leave."""
import csv
import json

import pytest

from fastprompt.methods.skicse.generation import (
    AnswerFilter,
    Generation,
    Sampling,
    ServerBackend,
    clean_answer,
    echo_ratio,
    generate_ski,
)
from fastprompt.methods.skicse.generation.prompt import check_template


def test_clean_answer_collapses_whitespace():
    assert clean_answer("  1. First.\n\n2.\tSecond.  ") == "1. First. 2. Second."


@pytest.mark.parametrize("answer, ratio", [
    ("The cat sat on the mat.", 1.0),                      # verbatim copy
    ("the CAT sat", 1.0),                                   # case-insensitive
    ("Cats are small animals.", 0.0),                       # "cats" is not "cat"
    ("The cat is an animal.", 2 / 5),                       # the, cat of the, cat, is, an, animal
    ("The cat sat on the mat. The cat sat on the mat. Cats purr.", 12 / 14),
    ("...", 0.0),                                           # no words at all
])
def test_echo_ratio(answer, ratio):
    assert echo_ratio("The cat sat on the mat.", answer) == pytest.approx(ratio)


def test_reject_reasons_in_order():
    f = AnswerFilter()
    s = "The cat sat on the mat."
    assert f.reject_reason(s, Generation(" \n\t", True)) == "empty"
    assert f.reject_reason(s, Generation("?!", True)) == "empty"
    assert f.reject_reason(s, Generation("", False)) == "empty"
    assert f.reject_reason(s, Generation("Cats are mammals and", False)) == "too_long"
    assert f.reject_reason(s, Generation("The cat sat on the mat.", True)) == "echo"
    assert f.reject_reason(s, Generation("Cats are domesticated mammals that like to rest on soft mats.", True)) is None
    assert AnswerFilter(echo_threshold=0.3).reject_reason(s, Generation("The cat is an animal.", True)) == "echo"
    with pytest.raises(ValueError, match="echo_threshold"):
        AnswerFilter(echo_threshold=0)


def test_template_and_sampling_are_checked():
    with pytest.raises(ValueError, match="exactly once"):
        check_template("Tell me about it.")
    with pytest.raises(ValueError, match="exactly once"):
        check_template("{sentence} and {other}")
    with pytest.raises(ValueError, match="valid format string"):
        check_template("{sentence")
    assert check_template('Sentence: "{sentence}" {{literal}}')
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)


def test_rejected_answers_are_resampled_then_counted(openai_server, tmp_path):
    sentences = ["ECHO this is echoed.", "EMPTY gets nothing.", "LONG never stops.", "FLAKY echoes once.",
                 "A fine sentence about cats."]
    out = tmp_path / "ski.csv"
    backend = ServerBackend(openai_server.url, "test-model")
    report = generate_ski(sentences, backend, out, attempts=3, show_progress_bar=False)
    with open(out, newline="") as f:
        kept = {r["sent0"] for r in csv.DictReader(f)}
    with open(f"{out}.rejected.csv", newline="") as f:
        rejected = {r["sent0"]: (r["answer"], r["reason"]) for r in csv.DictReader(f)}
    assert kept == {"FLAKY echoes once.", "A fine sentence about cats."}  # FLAKY passed on its second attempt
    assert rejected == {"ECHO this is echoed.": ("ECHO this is echoed.", "echo"),
                        "EMPTY gets nothing.": ("", "empty"),
                        "LONG never stops.": ("It goes on and on and", "too_long")}
    # three attempts for each rejected sentence, two for FLAKY, one for the fine one
    assert openai_server.asked == {"ECHO this is echoed.": 3, "EMPTY gets nothing.": 3, "LONG never stops.": 3,
                                   "FLAKY echoes once.": 2, "A fine sentence about cats.": 1}
    assert report.rejected == {"echo": 1, "empty": 1, "too_long": 1}
    assert report.rejected_attempts == {"echo": 4, "empty": 3, "too_long": 3}
    meta = json.loads(open(f"{out}.meta.json").read())
    assert meta["counts"] == {"rows": 2, "rejected": {"echo": 1, "empty": 1, "too_long": 1}}
    assert meta["runs"][0]["rejected_answers"] == {"echo": 4, "empty": 3, "too_long": 3}
    assert "1 echo, 1 empty, 1 too_long" in report.summary()
    # each attempt samples with its own seed
    seeds = [r["body"]["seed"] for r in openai_server.requests if "ECHO" in r["body"]["messages"][0]["content"]]
    assert len(set(seeds)) == 3


def test_greedy_decoding_makes_one_attempt(openai_server, tmp_path):
    backend = ServerBackend(openai_server.url, "test-model")
    report = generate_ski(["ECHO again."], backend, tmp_path / "o.csv", sampling=Sampling(temperature=0),
                          attempts=3, show_progress_bar=False)
    assert openai_server.asked == {"ECHO again.": 1} and report.rejected == {"echo": 1}
