"""The server backend against a local OpenAI-compatible test server (tests/methods/skicse/generation/conftest.py)."""
import csv
import json
import socket

import pytest

from fastprompt.cli import main
from fastprompt.methods.skicse.generation import LLMServerError, Sampling, ServerBackend, generate_ski
from fastprompt.methods.skicse.generation.prompt import SKI_PROMPT_TEMPLATE, format_prompt, sample_seed


def _rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _backend(server, **kw):
    return ServerBackend(server.url, kw.pop("model", "test-model"), **kw)


def test_generates_one_row_per_distinct_sentence(openai_server, tmp_path):
    sentences = ["A cat sat on the mat.", "Two dogs ran.", "A cat sat on the mat.", "Rain fell all day."]
    out = tmp_path / "ski.csv"
    report = generate_ski(sentences, _backend(openai_server), out, sampling=Sampling(seed=7),
                          show_progress_bar=False)
    rows = _rows(out)
    # one row per distinct sentence, the answer's newline collapsed to a space
    assert sorted((r["sent0"], r["ski"]) for r in rows) == sorted(
        (s, openai_server.expected(s)) for s in set(sentences))
    assert report.rows == 3 and report.duplicates == 1 and report.complete
    assert len(openai_server.requests) == 3
    body = openai_server.requests[0]["body"]
    sent = next(s for s in set(sentences) if s in body["messages"][0]["content"])
    assert body["messages"] == [{"role": "user", "content": format_prompt(SKI_PROMPT_TEMPLATE, sent)}]
    assert body["seed"] == sample_seed(7, 0, sent)  # per-sentence seed, independent of order and batching
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (160, 0.6, 0.9)
    meta = json.loads((tmp_path / "ski.csv.meta.json").read_text())
    assert meta["settings"]["backend"] == "server" and meta["settings"]["model"] == "test-model"
    assert meta["settings"]["api"] == "chat" and meta["settings"]["sampling"]["seed"] == 7
    assert meta["settings"]["prompt_template"] == SKI_PROMPT_TEMPLATE
    assert meta["info"]["url"] == openai_server.url and meta["info"]["fastprompt_version"]
    assert meta["counts"] == {"rows": 3, "rejected": {}} and meta["complete"] is True
    assert meta["runs"][0]["tokens"] == report.tokens > 0


def test_retries_after_503_and_a_dropped_connection(openai_server, tmp_path):
    backend = _backend(openai_server)
    openai_server.fail_next, openai_server.reset_next = 2, 1
    report = generate_ski(["One sentence here."], backend, tmp_path / "o.csv", show_progress_bar=False)
    assert report.rows == 1
    assert len(openai_server.requests) == 4  # reset, 503, 503, answer


def test_retry_after_is_honoured_and_backoff_waits_without_it(openai_server):
    """The openai client waits what Retry-After says (here 0.3 s) between attempts, and without the header backs
    off exponentially (0.5 s x 2**k, less up to 25% of jitter)."""
    backend = _backend(openai_server, max_retries=1)
    for retry_after, low, high in (("0.3", 0.3, 0.9), (None, 0.375, 1.0)):
        openai_server.requests.clear()
        openai_server.retry_after, openai_server.fail_next = retry_after, 1
        gen = backend.complete("One sentence here.", Sampling(), 0)
        assert " ".join(gen.text.split()) == openai_server.expected("One sentence here.")
        first, second = (r["time"] for r in openai_server.requests)
        assert low <= second - first <= high, (retry_after, second - first)


def test_gives_up_after_max_retries(openai_server, tmp_path):
    backend = _backend(openai_server, max_retries=2)
    openai_server.fail_next = 100
    with pytest.raises(LLMServerError, match=r"HTTP 503.*gave up after 3 attempts"):
        generate_ski(["One sentence here."], backend, tmp_path / "o.csv", show_progress_bar=False)
    assert len(openai_server.requests) == 3


def test_wrong_url_is_a_clear_error(openai_server, tmp_path, capsys):
    root = openai_server.url[: -len("/v1")]  # the server's root, without /v1: every path is a 404
    backend = ServerBackend(root, "test-model")  # /models is a 404 too: not every server has it
    with pytest.raises(LLMServerError, match=r"HTTP 404.*no such endpoint.*OpenAI base URL"):
        generate_ski(["One sentence here."], backend, tmp_path / "o.csv", show_progress_bar=False)
    inp = tmp_path / "in.txt"
    inp.write_text("One sentence here.\n")
    code = main(["generate-ski", "--llm", "server", "--url", root, "--model", "test-model", "--input", str(inp),
                 "--output", str(tmp_path / "cli.csv")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "HTTP 404" in err


def test_connection_refused_is_a_clear_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(LLMServerError, match="connection refused"):
        ServerBackend(f"http://127.0.0.1:{port}/v1", "m")


def test_unknown_model_is_a_clear_error(openai_server, tmp_path):
    with pytest.raises(LLMServerError, match=r"model 'nope' is not served .* it serves: test-model"):
        ServerBackend(openai_server.url, "nope")
    openai_server.list_models = False  # then the completion request itself reports it
    backend = _backend(openai_server, model="nope")
    with pytest.raises(LLMServerError, match=r"HTTP 404: the server does not know the model 'nope'"):
        generate_ski(["One sentence here."], backend, tmp_path / "o.csv", show_progress_bar=False)


def test_model_defaults_to_the_only_served_one(openai_server):
    assert ServerBackend(openai_server.url).model == "test-model"
    openai_server.models = ["a", "b"]
    with pytest.raises(LLMServerError, match="serves 2 models"):
        ServerBackend(openai_server.url)
    openai_server.list_models = False
    with pytest.raises(LLMServerError, match="give --model"):
        ServerBackend(openai_server.url)


def test_bad_url_and_options_fail_before_any_request():
    with pytest.raises(ValueError, match="http"):
        ServerBackend("127.0.0.1:8000/v1", "m")
    with pytest.raises(ValueError, match="api must be one of"):
        ServerBackend("http://127.0.0.1:1/v1", "m", api="embeddings")


def test_api_key_is_sent_and_never_recorded(openai_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MY_LLM_KEY", "sk-secret-123")
    generate_ski(["One sentence here."], _backend(openai_server, api_key_env="MY_LLM_KEY"), tmp_path / "o.csv",
                 show_progress_bar=False)
    assert openai_server.requests[0]["headers"]["authorization"] == "Bearer sk-secret-123"
    assert all("sk-secret" not in p.read_text() for p in tmp_path.iterdir())
    monkeypatch.delenv("MY_LLM_KEY")  # no key: no Authorization header at all
    generate_ski(["Two sentences here."], _backend(openai_server, api_key_env="MY_LLM_KEY"), tmp_path / "p.csv",
                 show_progress_bar=False)
    assert "authorization" not in openai_server.requests[-1]["headers"]


def test_plain_completions_api_for_base_models(openai_server, tmp_path):
    generate_ski(["One sentence here."], _backend(openai_server, api="completions"), tmp_path / "o.csv",
                 show_progress_bar=False)
    req = openai_server.requests[0]
    assert req["path"] == "/v1/completions"
    assert req["body"]["prompt"] == format_prompt(SKI_PROMPT_TEMPLATE, "One sentence here.")
    assert _rows(tmp_path / "o.csv")[0]["ski"] == openai_server.expected("One sentence here.")


def test_concurrency_is_bounded(openai_server, tmp_path):
    openai_server.delay = 0.05
    sentences = [f"Sentence number {i} is here." for i in range(24)]
    generate_ski(sentences, _backend(openai_server, concurrency=3), tmp_path / "o.csv", show_progress_bar=False)
    assert 1 < openai_server.max_in_flight <= 3
    assert len(_rows(tmp_path / "o.csv")) == 24


def test_without_the_openai_package_the_message_names_the_extra(tmp_path, monkeypatch, capsys):
    """`generate-ski --llm server` where the openai client is not installed: the extra to install, not a bare
    "No module named 'openai'"."""
    import builtins

    real_import = builtins.__import__

    def no_openai(name, *args, **kwargs):
        if name == "openai" or name.startswith("openai."):
            raise ModuleNotFoundError("No module named 'openai'", name="openai")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_openai)
    inp = tmp_path / "in.txt"
    inp.write_text("A sentence.\n")
    assert main(["generate-ski", "--llm", "server", "--url", "http://127.0.0.1:9/v1", "--model", "m", "--input",
                 str(inp), "--output", str(tmp_path / "o.csv"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'fastprompt[ski]'" in err and "openai" in err
    assert not (tmp_path / "o.csv").exists()
