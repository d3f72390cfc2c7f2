"""``fastprompt eval``: the table, the JSON, prompt checkpoints, and clear errors."""
import json

import pytest
import torch

from fastprompt import cli
from fastprompt.eval.sts import STS_TASKS, evaluate_sts

from .eval.test_sts_loaders import write_all, write_year


@pytest.fixture(scope="module")
def sts_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sts")
    write_all(root)
    # more pairs with varied scores for two tasks, so their scores are not degenerate
    write_year(root, "sts12", {"MSRpar": [(f"a man plays {w}", f"someone plays {w} now", f"{i % 5}.5")
                                          for i, w in enumerate("guitar piano drums flute violin cello".split())]})
    write_year(root, "sts13", {"OnWN": [(f"the {w} is loud", f"a {w} sounds", f"{(3 * i) % 5}.0")
                                        for i, w in enumerate("horn bell drum siren alarm engine radio".split())]})
    return root


def _run(capsys, *argv):
    rc = cli.main(["eval", "--no-progress", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_eval_prints_seven_scores_and_average_and_writes_json(tmp_path, capsys, sts_dir, tiny_bert_dir):
    out_json = tmp_path / "res" / "results.json"
    rc, out, err = _run(capsys, "--model", tiny_bert_dir, "--pooler", "mean", "--sts-dir", sts_dir,
                        "--preprocess", "none", "--output", out_json)
    assert rc == 0, err
    lines = out.strip().splitlines()
    header = [c.strip() for c in lines[1].strip("|").split("|")]
    assert header == ["STS12", "STS13", "STS14", "STS15", "STS16", "STS-B", "SICK-R", "Avg."]
    printed = [float(c) for c in lines[3].strip("|").split("|")]
    saved = json.loads(out_json.read_text())
    assert list(saved) == [*STS_TASKS, "avg"]
    assert list(saved.values()) == printed
    # the same numbers as the Python API on the same model
    from fastprompt.model import PromptEncoder

    expected = evaluate_sts(PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mean"), sts_dir, preprocess="none")
    assert saved == {k: round(v, 2) for k, v in expected.items()}


def test_eval_with_a_prompt_checkpoint(tmp_path, capsys, sts_dir, tiny_bert_dir):
    from fastprompt.model import PromptConfig, PromptEncoder

    torch.manual_seed(3)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=3, init_std=1.0),
                                        pooler="mean")
    ckpt = enc.save(tmp_path / "ckpt")
    expected = evaluate_sts(enc.eval(), sts_dir, "sts12,stsb", preprocess="none")
    for model_args in (["--prompt", ckpt], ["--model", tiny_bert_dir, "--prompt", ckpt]):
        out_json = tmp_path / "r.json"
        rc, out, err = _run(capsys, *model_args, "--sts-dir", sts_dir, "--tasks", "sts12,stsb", "--preprocess", "none",
                            "--output", out_json)
        assert rc == 0, err
        assert json.loads(out_json.read_text()) == {k: round(v, 2) for k, v in expected.items()}


def test_eval_dev_split_is_labelled(capsys, sts_dir, tiny_bert_dir):
    rc, out, err = _run(capsys, "--model", tiny_bert_dir, "--sts-dir", sts_dir, "--tasks", "stsb,sickr",
                        "--split", "dev", "--sick-split", "all", "--preprocess", "none")
    assert rc == 0, err
    assert "STS-B (dev)" in out and "SICK-R (all)" in out


def test_eval_extras_geometry_bootstrap_plot(tmp_path, capsys, sts_dir, tiny_bert_dir):
    from fastprompt.eval.geometry import bootstrap_spearman, geometry_report
    from fastprompt.eval.sts import cosine_similarity_pairs, load_sts_tasks, load_stsb
    from fastprompt.model import PromptEncoder

    out_json, plot = tmp_path / "r.json", tmp_path / "density.png"
    # STS-B is not among --tasks: --geometry and --plot load it on their own
    rc, out, err = _run(capsys, "--model", tiny_bert_dir, "--pooler", "mean", "--sts-dir", sts_dir,
                        "--tasks", "sts12,sts13", "--preprocess", "none", "--geometry", "--bootstrap", 50,
                        "--seed", 3, "--plot", plot, "--output", out_json)
    assert rc == 0, err
    res = json.loads(out_json.read_text())
    assert list(res) == ["sts12", "sts13", "avg", "ci95", "geometry"]
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mean").eval()
    data = load_sts_tasks(sts_dir, "sts12", preprocess="none")["sts12"]
    cos = cosine_similarity_pairs(enc.encode(data.sentences1), enc.encode(data.sentences2))
    lo, hi = bootstrap_spearman(cos, data.scores, n_resamples=50, seed=3)
    assert res["ci95"]["sts12"] == pytest.approx([round(lo, 2), round(hi, 2)], abs=0.011)
    stsb = load_stsb(sts_dir, "test", preprocess="none")
    rep = geometry_report(enc.encode(stsb.sentences1), enc.encode(stsb.sentences2), stsb, threshold=4.0)
    assert res["geometry"]["split"] == "stsb-test"
    for k, v in rep.items():
        assert res["geometry"][k] == pytest.approx(v, abs=2e-4), k
    assert "95% bootstrap confidence intervals (50 resamples)" in out and "STS-B (test) geometry: alignment" in out
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_eval_bad_plot_name_fails_before_loading(tmp_path, capsys, sts_dir):
    rc, _, err = _run(capsys, "--model", tmp_path / "no-model", "--sts-dir", sts_dir, "--plot", tmp_path / "p.bmp")
    assert rc == 2 and "--plot must end in .png, .pdf or .svg" in err


@pytest.mark.parametrize("case", ["missing-file", "missing-dir", "missing-model", "no-model", "bad-task",
                                  "missing-prompt", "output-is-a-dir", "cuda-without-gpu", "too-long"])
def test_eval_errors_are_clear(tmp_path, capsys, tiny_bert_dir, case):
    write_all(tmp_path / "sts")
    args = ["--model", tiny_bert_dir, "--sts-dir", tmp_path / "sts"]
    if case == "missing-file":
        (tmp_path / "sts" / "STS13-en-test" / "STS.input.headlines.txt").unlink()
        expect = "STS file not found: " + str(tmp_path / "sts" / "STS13-en-test" / "STS.input.headlines.txt")
    elif case == "missing-dir":
        args[3] = tmp_path / "nope"
        expect = "STS directory not found"
    elif case == "missing-model":
        args[1] = tmp_path / "no-such-model"
        expect = "model folder not found"
    elif case == "no-model":
        args = args[2:]
        expect = "give --model NAME_OR_PATH, --prompt CHECKPOINT_DIR, or both"
    elif case == "bad-task":
        args += ["--tasks", "sts12,sts17"]
        expect = "unknown STS task 'sts17'"
    elif case == "missing-prompt":
        args += ["--prompt", tmp_path / "no-ckpt"]
        expect = "prompt checkpoint folder not found"
    elif case == "output-is-a-dir":
        args += ["--output", tmp_path]
        expect = f"--output {tmp_path} is a directory"
    elif case == "cuda-without-gpu":
        if torch.cuda.is_available():
            pytest.skip("checks the message on a machine without CUDA")
        args += ["--device", "cuda"]
        expect = "device 'cuda' requested but"
    else:
        args += ["--max-length", "1000"]
        expect = "max_length 1000 is more tokens than"
    rc, out, err = _run(capsys, *args)
    assert rc == 2
    last = err.splitlines()[-1]  # (after the model loader's progress bar, when the model was loaded)
    assert last.startswith("fastprompt eval: error: ") and expect in last, err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("pooler", ["mean", "cls"])
def test_eval_frozen_minilm_all_seven(tmp_path, capsys, shared_data, minilm_dir, pooler):
    """What a user gets for free: frozen all-MiniLM-L6-v2, no prompt, all seven scores and the average."""
    out_json = tmp_path / "results.json"
    rc, out, err = _run(capsys, "--model", minilm_dir, "--pooler", pooler, "--max-length", 256,
                        "--sts-dir", shared_data / "sts", "--output", out_json)
    assert rc == 0, err
    res = json.loads(out_json.read_text())
    assert list(res) == [*STS_TASKS, "avg"]
    if pooler == "mean":  # all-MiniLM-L6-v2's published MTEB numbers (see tests/eval/test_sts_real.py)
        for task, published in {"sts12": 72.37, "sts13": 80.60, "sts14": 75.59, "sts15": 85.39,
                                "sts16": 78.99, "stsb": 82.03}.items():
            assert abs(res[task] - published) <= 0.01, task
    else:  # [CLS] is not what the model was trained for: worse on average (measured 73.69), still a sentence model
        assert abs(res["avg"] - 73.69) <= 0.01


def test_eval_geometry_retrieval_options(tmp_path, capsys, sts_dir, tiny_bert_dir):
    from fastprompt.eval.geometry import geometry_report
    from fastprompt.eval.sts import load_stsb
    from fastprompt.model import PromptEncoder

    out_json = tmp_path / "r.json"
    rc, out, err = _run(capsys, "--model", tiny_bert_dir, "--pooler", "mean", "--sts-dir", sts_dir, "--tasks",
                        "stsb", "--preprocess", "none", "--geometry", "--retrieval-k", "1,3",
                        "--retrieval-threshold", "2.5", "--retrieval-exact", "--output", out_json)
    assert rc == 0, err
    geo = json.loads(out_json.read_text())["geometry"]
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mean").eval()
    stsb = load_stsb(sts_dir, "test", preprocess="none")
    rep = geometry_report(enc.encode(stsb.sentences1), enc.encode(stsb.sentences2), stsb, ks=(1, 3),
                          retrieval_threshold=2.5, retrieval_exact=True)
    assert {k for k in geo if k.startswith("recall@")} == {"recall@1", "recall@3"}
    for k, v in rep.items():
        assert geo[k] == pytest.approx(v, abs=2e-4), k
    with pytest.raises(SystemExit):
        cli.main(["eval", "--model", str(tiny_bert_dir), "--sts-dir", str(sts_dir), "--retrieval-k", "0,3"])


def test_eval_dims_scores_each_matryoshka_prefix(tmp_path, capsys, sts_dir, tiny_bert_dir):
    """--dims 32,8: the full table, then one per dimension from the same encoding, equal to encoding with
    ``dim=`` (truncate, re-normalise) through the Python API."""
    from fastprompt.eval.sts import score_sts
    from fastprompt.model import PromptEncoder

    out_json = tmp_path / "results.json"
    rc, out, err = _run(capsys, "--model", tiny_bert_dir, "--pooler", "mean", "--sts-dir", sts_dir,
                        "--preprocess", "none", "--tasks", "sts12,sts13", "--dims", "32,8", "--output", out_json)
    assert rc == 0, err
    assert "first 8 dimensions:" in out
    saved = json.loads(out_json.read_text())
    assert saved["dims"]["32"] == {k: v for k, v in saved.items() if k != "dims"}
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mean")

    class Truncated:
        def encode(self, sentences, **kw):
            return enc.encode(sentences, dim=8, **kw)

    from fastprompt.eval.sts import load_sts_tasks

    expected = score_sts(Truncated(), load_sts_tasks(sts_dir, "sts12,sts13", preprocess="none"))
    assert saved["dims"]["8"] == pytest.approx({k: round(v, 2) for k, v in expected.items()}, abs=0.011)


def test_eval_dims_beyond_the_hidden_size_fail_before_encoding(capsys, sts_dir, tiny_bert_dir, monkeypatch):
    """Issue 40, item 15: ``--dims 1000`` failed only after the whole STS encoding; it is checked against the
    model's hidden size first."""
    import fastprompt.eval.sts

    def never(*args, **kwargs):
        raise AssertionError("the sentences were encoded before --dims was checked")

    monkeypatch.setattr(fastprompt.eval.sts, "encode_pairs", never)
    rc, _, err = _run(capsys, "--model", tiny_bert_dir, "--sts-dir", sts_dir, "--preprocess", "none", "--dims",
                      "8,64,1000")
    assert rc == 2 and (f"fastprompt eval: error: --dims 64,1000: the embeddings of {tiny_bert_dir} have 32 "
                        "dimensions; give dimensions <= 32") in err.splitlines()[-1], err
