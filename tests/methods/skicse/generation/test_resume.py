"""Long generation jobs survive interruption: kill -9 and resume, torn lines, settings checks, locking."""
import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fastprompt.cli import main
from fastprompt.methods.skicse.generation import Sampling, ServerBackend, generate_ski
from fastprompt.methods.skicse.generation.store import SkiStore


def _rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return [(r["sent0"], r["ski"]) for r in csv.DictReader(f)]


def _cli(server, inp, out, *extra):
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["NO_PROXY"] = "127.0.0.1"
    cmd = [sys.executable, "-m", "fastprompt.cli", "generate-ski", "--llm", "server", "--url", server.url,
           "--model", "test-model", "--input", str(inp), "--output", str(out), "--concurrency", "2", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _line_count(path):
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def test_kill_9_and_resume_loses_and_duplicates_nothing(openai_server, tmp_path):
    sentences = [f"Sentence {i} talks about topic {i % 7}." for i in range(80)]
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(sentences + sentences[:15]) + "\n")  # 15 repeats: asked once each
    openai_server.delay = 0.05

    full = tmp_path / "full.csv"  # the reference: one uninterrupted run
    proc = _cli(openai_server, inp, full)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert len(openai_server.requests) == 80
    openai_server.requests.clear()

    out = tmp_path / "killed.csv"
    proc = _cli(openai_server, inp, out)
    deadline = time.monotonic() + 60
    while _line_count(out) < 1 + 20 and time.monotonic() < deadline:  # header + 20 rows
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    before = _rows(out)
    assert 20 <= len(before) < 80, "the run was not killed mid-way"
    asked_before = len(openai_server.requests)
    openai_server.requests.clear()

    proc = _cli(openai_server, inp, out)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    after = _rows(out)
    assert after[: len(before)] == before  # rows written before the kill are untouched
    assert len(after) == 80 and len({s for s, _ in after}) == 80  # nothing lost, nothing twice
    assert sorted(after) == sorted(_rows(full))
    # the second run asked only for what the first had not written (answers in flight at the kill are redone)
    asked_again = {next(s for s in sentences if f'"{s}"' in r["body"]["messages"][0]["content"])
                   for r in openai_server.requests}
    assert asked_again == set(sentences) - {s for s, _ in before}
    assert asked_before >= len(before)
    meta = json.loads((tmp_path / "killed.csv.meta.json").read_text())
    assert meta["complete"] and meta["counts"]["rows"] == 80
    assert [r["complete"] for r in meta["runs"]] == [True]  # the killed run could not record itself


def test_a_torn_last_line_is_cut_and_redone(openai_server, tmp_path):
    sentences = ["First sentence is here.", "Second sentence is here.", "Third sentence is here."]
    backend = ServerBackend(openai_server.url, "test-model")
    out = tmp_path / "o.csv"
    generate_ski(sentences[:2], backend, out, show_progress_bar=False)
    with open(out, "ab") as f:  # what a process killed inside write() could leave
        f.write(b'"Third sentence is here.","Known fa')
    report = generate_ski(sentences, backend, out, show_progress_bar=False)
    assert report.already_done == 2 and report.accepted_now == 1
    rows = _rows(out)  # the first run's two rows in the order the concurrent requests completed, then the redone one
    assert sorted(rows[:2]) == sorted((s, openai_server.expected(s)) for s in sentences[:2])
    assert rows[2:] == [(sentences[2], openai_server.expected(sentences[2]))]
    assert out.read_bytes().endswith(b"\n")


def test_complete_output_is_not_regenerated_and_limit_extends_it(openai_server, tmp_path):
    sentences = [f"Sentence {i} is here." for i in range(6)]
    backend = ServerBackend(openai_server.url, "test-model")
    out = tmp_path / "o.csv"
    assert generate_ski(sentences, backend, out, limit=2, show_progress_bar=False).rows == 2
    assert generate_ski(sentences, backend, out, limit=2, show_progress_bar=False).answers == 0
    report = generate_ski(sentences, backend, out, limit=5, show_progress_bar=False)
    assert (report.rows, report.accepted_now, report.already_done) == (5, 3, 2)
    assert len(openai_server.requests) == 5
    assert len(json.loads((tmp_path / "o.csv.meta.json").read_text())["runs"]) == 3


def test_other_settings_are_refused_unless_overwrite(openai_server, tmp_path):
    backend = ServerBackend(openai_server.url, "test-model")
    out = tmp_path / "o.csv"
    generate_ski(["One sentence here."], backend, out, show_progress_bar=False)
    with pytest.raises(ValueError, match=r"other settings \(sampling: .*'seed': 0.*'seed': 1"):
        generate_ski(["One sentence here."], backend, out, sampling=Sampling(seed=1), show_progress_bar=False)
    with pytest.raises(ValueError, match="prompt_template"):
        generate_ski(["One sentence here."], backend, out, template="About {sentence}:", show_progress_bar=False)
    report = generate_ski(["Another one."], backend, out, sampling=Sampling(seed=1), overwrite=True,
                          show_progress_bar=False)
    assert _rows(out) == [("Another one.", openai_server.expected("Another one."))] and report.rows == 1


def test_foreign_or_unlabelled_output_is_refused(tmp_path, openai_server):
    backend = ServerBackend(openai_server.url, "test-model")
    out = tmp_path / "o.csv"
    out.write_text("sent0,ski\nA,B\n")  # no metadata: who wrote it, with what settings?
    with pytest.raises(ValueError, match="without its metadata"):
        generate_ski(["A"], backend, out, show_progress_bar=False)
    assert out.read_text() == "sent0,ski\nA,B\n"  # untouched


def test_two_runs_cannot_write_one_output(tmp_path):
    first = SkiStore(tmp_path / "o.csv").open({"model": "m"}, {})
    try:
        with pytest.raises(ValueError, match="another generate-ski run is writing"):
            SkiStore(tmp_path / "o.csv").open({"model": "m"}, {})
    finally:
        first.close()
    SkiStore(tmp_path / "o.csv").open({"model": "m"}, {}).close()  # free again


def test_cli_interrupt_keeps_rows_and_says_how_to_resume(openai_server, tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("".join(f"Sentence {i} is here.\n" for i in range(200)))
    openai_server.delay = 0.02
    out = tmp_path / "o.csv"
    proc = _cli(openai_server, inp, out)
    while _line_count(out) < 5 and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "resume" in err
    meta = json.loads((tmp_path / "o.csv.meta.json").read_text())
    rows = _rows(out)
    assert meta["complete"] is False and meta["counts"]["rows"] == len(rows) >= 4


@pytest.mark.parametrize("how", ["same", "relative", "symlink", "hardlink", "meta-file", "with-overwrite"])
def test_an_output_that_is_the_input_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, how):
    """generate-ski --output naming the input (however spelt) fails at once: --overwrite would have deleted it."""
    monkeypatch.chdir(tmp_path)
    inp = tmp_path / "sents.csv"
    inp.write_bytes(b"sent0\nA cat sat on the mat.\nTwo dogs ran.\n")
    before = inp.read_bytes()
    output = {"same": str(inp), "relative": "./sub/../sents.csv", "symlink": "link.csv", "hardlink": "hard.csv",
              "meta-file": "sents", "with-overwrite": str(inp)}[how]
    (tmp_path / "sub").mkdir()
    if how == "symlink":
        (tmp_path / "link.csv").symlink_to(inp)
    if how == "hardlink":
        os.link(inp, tmp_path / "hard.csv")
    if how == "meta-file":  # the metadata generate-ski writes beside --output sents would be sents.meta.json
        inp = inp.rename(tmp_path / "sents.meta.json")
    made = set(os.listdir(tmp_path))
    args = ["generate-ski", "--input", str(inp), "--output", output, "--llm", "server", "--url",
            "http://127.0.0.1:9/v1", "--model", "m"]
    args += ["--overwrite"] if how in ("with-overwrite", "hardlink") else []
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is the input file" in err, err
    assert inp.read_bytes() == before and set(os.listdir(tmp_path)) == made
