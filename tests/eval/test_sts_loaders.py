"""SentEval-layout STS loaders on small synthetic folders: the details that change the scores, and bad input."""
from pathlib import Path

import numpy as np
import pytest

from fastprompt.eval.sts import (
    SICK_SPLITS,
    STS_TASKS,
    STS_YEAR_SUBSETS,
    STSB_SPLITS,
    STSData,
    load_sickr,
    load_sts_task,
    load_sts_tasks,
    load_sts_year,
    load_stsb,
    parse_tasks,
    senteval_tokenize,
)

SICK_HEADER = "pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment"


def write_year(root: Path, task: str, pairs_of: dict, *, extra_columns: bool = False, newline: str = "\n") -> Path:
    """STS.input/STS.gs files for every sub-dataset of ``task``; ``pairs_of[subset]`` = [(s1, s2, gold_or_'')]."""
    folder, subsets = STS_YEAR_SUBSETS[task]
    d = root / folder
    d.mkdir(parents=True, exist_ok=True)
    for k, sub in enumerate(subsets):
        pairs = pairs_of.get(sub, [(f"{sub} one", f"{sub} two", f"{k + 1}.0")])
        extra = "\tsource a\tsource b" if extra_columns else ""
        (d / f"STS.input.{sub}.txt").write_text("".join(f"{a}\t{b}{extra}{newline}" for a, b, _ in pairs),
                                                encoding="utf-8")
        (d / f"STS.gs.{sub}.txt").write_text("".join(f"{g}{newline}" for _, _, g in pairs), encoding="utf-8")
    return d


def write_stsb(root: Path, rows_of: dict | None = None) -> Path:
    d = root / "STSBenchmark"
    d.mkdir(parents=True, exist_ok=True)
    for split, name in STSB_SPLITS.items():
        rows = (rows_of or {}).get(split, [(f"{split} a", f"{split} b", 2.5), (f"{split} c", f"{split} d", 4.0)])
        (d / name).write_text("".join(f"main-captions\tMSRvid\t2012test\t{i:04d}\t{g}\t{a}\t{b}\n"
                                      for i, (a, b, g) in enumerate(rows)), encoding="utf-8")
    return d


def write_sick(root: Path, rows_of: dict | None = None, header: str = SICK_HEADER, newline: str = "\n") -> Path:
    d = root / "SICK"
    d.mkdir(parents=True, exist_ok=True)
    for split, name in SICK_SPLITS.items():
        rows = (rows_of or {}).get(split, [(f"{split} a", f"{split} b", 3.1), (f"{split} c", f"{split} d", 1.2)])
        body = "".join(f"{i}\t{a}\t{b}\t{g}\tNEUTRAL{newline}" for i, (a, b, g) in enumerate(rows, start=1))
        (d / name).write_text(header + newline + body, encoding="utf-8")
    return d


def write_all(root: Path) -> Path:
    for task in STS_YEAR_SUBSETS:
        write_year(root, task, {})
    write_stsb(root)
    write_sick(root)
    return root


# ------------------------------------------------------------------------------------------ STS12-16
def test_year_concatenates_subsets_in_senteval_order_and_skips_unscored_pairs_pairwise(tmp_path):
    # STS15/16 mark unscored pairs with an empty gold line: the pair goes, its neighbours stay aligned.
    write_year(tmp_path, "sts15", {
        "answers-forums": [("af 1a", "af 1b", "3.0"), ("af 2a", "af 2b", ""), ("af 3a", "af 3b", "1.5")],
        "belief": [("b 1a", "b 1b", ""), ("b 2a", "b 2b", "  "), ("b 3a", "b 3b", "4.8")],
        "images": [("i 1a", "i 1b", "0")],
    })
    data = load_sts_year(tmp_path, "sts15", preprocess="none")
    assert isinstance(data, STSData) and data.name == "sts15"
    # SentEval's order: answers-forums, answers-students, belief, headlines, images
    assert data.sentences1 == ["af 1a", "af 3a", "answers-students one", "b 3a", "headlines one", "i 1a"]
    assert data.sentences2 == ["af 1b", "af 3b", "answers-students two", "b 3b", "headlines two", "i 1b"]
    np.testing.assert_array_equal(data.scores, [3.0, 1.5, 2.0, 4.8, 4.0, 0.0])
    assert data.scores.dtype == np.float64 and len(data) == 6


def test_year_uses_only_the_first_two_columns(tmp_path):
    # STS16 input lines carry two source columns after the sentences.
    write_year(tmp_path, "sts16", {"headlines": [("Drive-ins fade", "Drive-ins vanish", "4")]}, extra_columns=True)
    data = load_sts_year(tmp_path, "sts16", preprocess="none")
    assert "Drive-ins fade" in data.sentences1 and "Drive-ins vanish" in data.sentences2
    assert not any("source" in s for s in data.sentences1 + data.sentences2)
    assert len(data) == len(STS_YEAR_SUBSETS["sts16"][1])


def test_year_crlf_lines_and_whitespace_normalisation(tmp_path):
    write_year(tmp_path, "sts13", {"FNWN": [("  two   spaces ", "tab\u00a0nbsp", "2.0")]}, newline="\r\n")
    data = load_sts_year(tmp_path, "sts13", preprocess="none")
    assert data.sentences1[0] == "two spaces" and data.sentences2[0] == "tab nbsp"
    assert data.scores[0] == 2.0


def test_sentences_keep_unicode_and_line_separator_characters(tmp_path):
    # str.splitlines() would cut this line at U+2028 and misalign sentences with scores.
    write_year(tmp_path, "sts12", {"MSRpar": [("caf\u00e9 \u2028 na\u00efve", "\u201cquoted\u201d", "5")]})
    data = load_sts_year(tmp_path, "sts12", preprocess="none")
    assert data.sentences1[0] == "caf\u00e9 na\u00efve" and data.sentences2[0] == "\u201cquoted\u201d"
    assert len(data) == 5


def test_senteval_layout_with_sts_subfolder(tmp_path):
    write_year(tmp_path / "STS", "sts14", {})
    write_stsb(tmp_path / "STS")
    write_sick(tmp_path)
    assert len(load_sts_year(tmp_path, "sts14", preprocess="none")) == 6
    assert len(load_stsb(tmp_path, preprocess="none")) == 2
    assert len(load_sickr(tmp_path, preprocess="none")) == 2


# --------------------------------------------------------------------------------------------- STS-B
def test_stsb_columns_quotes_and_extra_columns(tmp_path):
    d = write_stsb(tmp_path)
    # Bare double quotes must survive (csv quoting would swallow them); some lines have 9 columns.
    (d / "sts-test.csv").write_text(
        'main-news\theadlines\t2015\t0001\t3.200\t"I\'m not," he said\tHe said: "no"\n'
        "main-forum\tdeft\t2014\t0002\t0.500\tFirst one.\tSecond one.\tsource-x\tsource-y\n",
        encoding="utf-8")
    data = load_stsb(tmp_path, "test", preprocess="none")
    assert data.sentences1 == ['"I\'m not," he said', "First one."]
    assert data.sentences2 == ['He said: "no"', "Second one."]
    np.testing.assert_array_equal(data.scores, [3.2, 0.5])


def test_stsb_splits_read_their_own_file(tmp_path):
    write_stsb(tmp_path)
    for split in STSB_SPLITS:
        assert load_stsb(tmp_path, split, preprocess="none").sentences1[0] == f"{split} a"
    assert load_sts_task(tmp_path, "stsb", stsb_split="dev", preprocess="none").sentences1[0] == "dev a"


# ---------------------------------------------------------------------------------------------- SICK
def test_sick_header_is_skipped_and_columns_found_by_name(tmp_path):
    write_sick(tmp_path, newline="\r\n")  # SICK_test_annotated.txt really has CRLF line ends
    data = load_sickr(tmp_path, "test", preprocess="none")
    assert data.sentences1 == ["test a", "test c"] and data.sentences2 == ["test b", "test d"]
    np.testing.assert_array_equal(data.scores, [3.1, 1.2])
    # a file with the columns in another order is read by header name
    d = tmp_path / "SICK"
    (d / SICK_SPLITS["trial"]).write_text(
        "relatedness_score\tsentence_B\tpair_ID\tsentence_A\n4.5\tsecond\t1\tfirst\n", encoding="utf-8")
    data = load_sickr(tmp_path, "trial", preprocess="none")
    assert (data.sentences1, data.sentences2, list(data.scores)) == (["first"], ["second"], [4.5])


def test_sick_all_concatenates_train_trial_test(tmp_path):
    write_sick(tmp_path)
    data = load_sickr(tmp_path, "all", preprocess="none")
    assert data.sentences1 == ["train a", "train c", "trial a", "trial c", "test a", "test c"]
    assert len(data.scores) == 6


# -------------------------------------------------------------------------------------- preprocessing
def test_senteval_preprocessing_tokenises_and_lowercases_like_the_download_script(tmp_path):
    write_year(tmp_path, "sts12", {"MSRpar": [("Hello, World!", "A Dog's toy.", "1")]})
    write_stsb(tmp_path, {"test": [('He said "no".', "U.S. troops (in Iraq)", 1.0)]})
    write_sick(tmp_path, {"test": [("A Dog's toy.", "Hello, World!", 2.0)]})
    sts = load_sts_year(tmp_path, "sts12")  # default preprocess="senteval"
    assert (sts.sentences1[0], sts.sentences2[0]) == ("hello , world !", "a dog 's toy .")
    stsb = load_stsb(tmp_path)
    assert (stsb.sentences1[0], stsb.sentences2[0]) == ('he said " no " .', "u.s. troops ( in iraq )")
    sick = load_sickr(tmp_path)  # SentEval tokenises SICK but does not lower-case it
    assert (sick.sentences1[0], sick.sentences2[0]) == ("A Dog 's toy .", "Hello , World !")
    raw = load_sts_year(tmp_path, "sts12", preprocess="none")
    assert raw.sentences1[0] == "Hello, World!"
    np.testing.assert_array_equal(sts.scores, raw.scores)


def test_senteval_tokenize_direct():
    assert senteval_tokenize(["Hello, World!", "Hello, World!"], lowercase=False) == ["Hello , World !"] * 2
    assert senteval_tokenize(["Isn't it?"], lowercase=True) == ["isn 't it ?"]


# ------------------------------------------------------------------------------------------ task sets
def test_load_sts_tasks_all_seven_in_order(tmp_path):
    write_all(tmp_path)
    data = load_sts_tasks(tmp_path, preprocess="none")
    assert list(data) == list(STS_TASKS)
    assert [len(d) for d in data.values()] == [5, 3, 6, 5, 5, 2, 2]
    subset = load_sts_tasks(tmp_path, "sickr, STS-B,sts13", preprocess="none")
    assert list(subset) == ["sickr", "stsb", "sts13"]


def test_parse_tasks():
    assert parse_tasks(None) == list(STS_TASKS)
    assert parse_tasks("STS12,sts-b,SICK-R") == ["sts12", "stsb", "sickr"]
    assert parse_tasks(["stsbenchmark", "sick"]) == ["stsb", "sickr"]
    with pytest.raises(ValueError, match="unknown STS task 'sts17'.*sts12, sts13"):
        parse_tasks("sts12,sts17")
    with pytest.raises(ValueError, match="duplicate"):
        parse_tasks("stsb,sts-b")
    with pytest.raises(ValueError, match="no STS task"):
        parse_tasks(" , ")


# ----------------------------------------------------------------------------------------- bad input
def test_missing_file_names_the_file(tmp_path):
    write_all(tmp_path)
    victim = tmp_path / "STS14-en-test" / "STS.gs.tweet-news.txt"
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=r"STS file not found: .*STS14-en-test/STS\.gs\.tweet-news\.txt"):
        load_sts_tasks(tmp_path, preprocess="none")
    (tmp_path / "SICK" / SICK_SPLITS["test"]).unlink()
    with pytest.raises(FileNotFoundError, match="SICK_test_annotated.txt"):
        load_sickr(tmp_path)
    (tmp_path / "STSBenchmark" / "sts-dev.csv").unlink()
    with pytest.raises(FileNotFoundError, match="sts-dev.csv"):
        load_stsb(tmp_path, "dev")


def test_missing_folder_and_directory(tmp_path):
    write_stsb(tmp_path)
    with pytest.raises(FileNotFoundError, match="STS folder 'STS12-en-test' not found"):
        load_sts_year(tmp_path, "sts12")
    with pytest.raises(FileNotFoundError, match="STS directory not found"):
        load_stsb(tmp_path / "nowhere")


def test_input_and_gold_line_counts_must_match(tmp_path):
    d = write_year(tmp_path, "sts13", {})
    (d / "STS.gs.OnWN.txt").write_text("1.0\n2.0\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"STS\.input\.OnWN\.txt has 1 lines but .*STS\.gs\.OnWN\.txt has 2"):
        load_sts_year(tmp_path, "sts13")


def test_not_utf8_is_a_clear_error(tmp_path):
    d = write_year(tmp_path, "sts13", {})
    (d / "STS.input.headlines.txt").write_bytes(b"fine\tline\n")
    (d / "STS.input.FNWN.txt").write_bytes(b"ok\tok\nbad \xff byte\tx\n")
    (d / "STS.gs.FNWN.txt").write_text("1\n2\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"STS\.input\.FNWN\.txt: not valid UTF-8 \(line 2"):
        load_sts_year(tmp_path, "sts13")


@pytest.mark.parametrize("gold", ["abc", "3,5"])
def test_bad_gold_score(tmp_path, gold):
    write_year(tmp_path, "sts13", {"OnWN": [("a", "b", "1"), ("c", "d", gold)]})
    with pytest.raises(ValueError, match=rf"STS\.gs\.OnWN\.txt:2: gold score '{gold}' is not a number"):
        load_sts_year(tmp_path, "sts13")


@pytest.mark.parametrize("gold", ["nan", "-inf", "inf", "NaN"])
def test_a_gold_score_that_is_not_finite_is_refused(tmp_path, gold):
    """-inf was scored (ranked first) and nan reported as "constant scores"."""
    write_year(tmp_path, "sts13", {"OnWN": [("a", "b", "1"), ("c", "d", gold)]})
    with pytest.raises(ValueError, match=rf"STS\.gs\.OnWN\.txt:2: gold score '{gold}' is not a finite number"):
        load_sts_year(tmp_path, "sts13")


def test_spearman_names_nan_scores_instead_of_calling_them_constant():
    from fastprompt.eval.sts import spearman_x100

    with pytest.raises(ValueError, match=r"undefined: 1 of the 3 gold scores are NaN or infinite"):
        spearman_x100(np.array([0.1, 0.2, 0.3]), np.array([1.0, np.nan, 2.0]))
    with pytest.raises(ValueError, match=r"undefined: 3 of the 3 predicted scores are NaN or infinite"):
        spearman_x100(np.full(3, np.nan), np.array([1.0, 3.0, 2.0]))
    with pytest.raises(ValueError, match="the predicted or gold scores are constant"):
        spearman_x100(np.array([0.1, 0.2, 0.3]), np.ones(3))


def test_input_line_without_tab(tmp_path):
    d = write_year(tmp_path, "sts13", {})
    (d / "STS.input.OnWN.txt").write_text("no tab here\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"STS\.input\.OnWN\.txt:1: expected 'sentence1<TAB>sentence2'"):
        load_sts_year(tmp_path, "sts13")


def test_stsb_short_line_and_bad_score(tmp_path):
    d = write_stsb(tmp_path)
    (d / "sts-test.csv").write_text("a\tb\tc\t1\t2.0\tonly one sentence\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"sts-test\.csv:1: expected at least 7 tab-separated columns"):
        load_stsb(tmp_path)
    (d / "sts-test.csv").write_text("a\tb\tc\t1\tfive\ts1\ts2\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"sts-test\.csv:1: gold score 'five'"):
        load_stsb(tmp_path)


def test_sick_without_header_or_with_short_row(tmp_path):
    write_sick(tmp_path, header="1\tA dog runs\tA dog walks\t4.0\tNEUTRAL")
    with pytest.raises(ValueError, match="header row must name the columns sentence_A"):
        load_sickr(tmp_path)
    d = write_sick(tmp_path)
    (d / SICK_SPLITS["test"]).write_text(SICK_HEADER + "\n1\tonly a\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"SICK_test_annotated\.txt:2: expected 5 tab-separated columns, found 2"):
        load_sickr(tmp_path)


def test_unknown_split_task_or_preprocess(tmp_path):
    write_all(tmp_path)
    with pytest.raises(ValueError, match="unknown STS-B split 'validation'"):
        load_stsb(tmp_path, "validation")
    with pytest.raises(ValueError, match="unknown SICK split 'dev'"):
        load_sickr(tmp_path, "dev")
    with pytest.raises(ValueError, match="unknown preprocess 'moses'"):
        load_sts_tasks(tmp_path, preprocess="moses")
    with pytest.raises(ValueError, match="not an STS year"):
        load_sts_year(tmp_path, "stsb")


def test_stsdata_checks_lengths():
    with pytest.raises(ValueError, match="must be equal"):
        STSData("x", ["a", "b"], ["c"], np.zeros(2))
