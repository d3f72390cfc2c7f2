"""The server backend against hostile servers (stubs on 127.0.0.1): a per-request wall-clock deadline, a cap on
the bytes read, answers longer than the token budget rejected, no credentials sent to another origin on a
redirect, and a prompt exit on SIGTERM / Ctrl-C with a request hanging."""
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from fastprompt.methods.skicse.generation import LLMServerError, Sampling, ServerBackend, generate_ski
from fastprompt.methods.skicse.generation.server import MAX_CHARS_PER_TOKEN, answer_byte_cap

REPO = Path(__file__).resolve().parents[4]
SENTENCE = "One sentence here."


def _completion(text: str, finish: str = "stop", tokens: int | None = 3) -> bytes:
    return json.dumps({"id": "x", "object": "chat.completion", "model": "test-model", "choices": [
        {"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text}}],
        "usage": {"completion_tokens": tokens}}).encode()


def _drip(where: str):
    """An answer that sends one byte a second, of its headers or of its body, for as long as anyone listens."""
    def answer(handler, body):
        payload = _completion("Known facts.")
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                .encode())
        if where == "body":
            handler.wfile.write(head)
            handler.wfile.flush()
        data = head + payload if where == "headers" else payload
        handler.close_connection = True
        for i in range(len(data)):
            if handler.server_state.stopping.wait(1.0):
                return
            try:
                handler.wfile.write(data[i:i + 1])
                handler.wfile.flush()
            except OSError:  # the client gave up
                return
    return answer


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_drip_server_ends_within_the_deadline(openai_server, where):
    openai_server.answer_with = _drip(where)
    backend = ServerBackend(openai_server.url, "test-model", timeout=2.0, max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(LLMServerError, match=r"no complete answer within the 2 s deadline"):
        backend.complete(SENTENCE, Sampling(), 0)
    assert time.monotonic() - t0 < 2.0 + 0.5  # the deadline, not a per-read timeout (the drip never pauses 2 s)


def _endless(content_length: str | None):
    """Headers, then 64 KiB chunks until the client goes away (with a huge declared length, or none)."""
    def answer(handler, body):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if content_length:
            handler.send_header("Content-Length", content_length)
        handler.end_headers()
        handler.close_connection = True
        chunk = b'{"choices": [{"message": {"content": "' + b"a" * 65536
        while not handler.server_state.stopping.is_set():
            # counted before the write: the chunk the client stops in is still blocked in write() when the client
            # has read past the cap, and ends in OSError once it hangs up (counting after it raced the test)
            handler.server_state.sent += len(chunk)
            try:
                handler.wfile.write(chunk)
            except OSError:
                return
    return answer


@pytest.mark.parametrize("content_length", [None, "1000000000000"])
def test_an_endless_answer_stops_at_the_byte_cap(openai_server, content_length):
    """The answer is cut at answer_byte_cap (125 KiB for 160 tokens); memory stays near it (measured with
    tracemalloc: before the cap, the client read an endless answer whole, 2.4 GB for 3 sentences)."""
    openai_server.answer_with, openai_server.sent = _endless(content_length), 0
    backend = ServerBackend(openai_server.url, "test-model", timeout=30.0, max_retries=3)
    cap = answer_byte_cap(Sampling().max_new_tokens)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(LLMServerError, match=rf"the answer is larger than {cap} bytes"):
            backend.complete(SENTENCE, Sampling(), 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - t0 < 10 and len(openai_server.requests) == 1  # not retried
    assert peak < cap + 2 * 65536 + 1024 * 1024, (peak, cap)
    assert openai_server.sent > cap  # the server offered more than the cap: the client stopped itself


def test_a_50_mb_answer_is_refused_and_a_long_one_is_rejected_as_too_long(openai_server, tmp_path):
    """50 MB of JSON is refused at the byte cap; an answer under the cap but longer than max_new_tokens tokens
    can be (or reporting more tokens) is cut and rejected as too_long, never written as a SKI."""
    sampling = Sampling(max_new_tokens=20)
    limit = 20 * MAX_CHARS_PER_TOKEN

    def answer(handler, body):
        sentence = body["messages"][0]["content"]
        text, tokens = ("x" * 50_000_000, 3) if "HUGE" in sentence else ("word " * limit, 3) if "LONG" in sentence \
            else ("Known facts about it.", 25) if "MANY" in sentence else ("Known facts about it.", 4)
        payload = _completion(text, tokens=tokens)
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        try:
            handler.wfile.write(payload)
        except OSError:
            pass

    openai_server.answer_with = answer
    backend = ServerBackend(openai_server.url, "test-model", max_retries=0)
    with pytest.raises(LLMServerError, match="larger than"):
        backend.complete("HUGE one", sampling, 0)
    report = generate_ski(["LONG one here.", "MANY tokens here.", "Fine one here."], backend, tmp_path / "o.csv",
                          sampling=sampling, attempts=1, show_progress_bar=False)
    assert report.rows == 1 and report.rejected == {"too_long": 2}
    rejected = (tmp_path / "o.csv.rejected.csv").read_text()
    assert len(rejected) < 3 * limit and "x" * 100 not in (tmp_path / "o.csv").read_text()


def test_a_compressed_answer_is_refused(openai_server):
    def answer(handler, body):
        import gzip

        payload = gzip.compress(_completion("a" * 10_000_000))  # 10 MB in 10 kB
        handler.send_response(200)
        handler.send_header("Content-Encoding", "gzip")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    openai_server.answer_with = answer
    backend = ServerBackend(openai_server.url, "test-model", max_retries=0)
    with pytest.raises(LLMServerError, match=r"compressed \(gzip\)"):
        backend.complete(SENTENCE, Sampling(), 0)
    assert openai_server.requests[0]["headers"]["accept-encoding"] == "identity"


@pytest.mark.parametrize("same_origin", [False, True])
def test_the_api_key_never_follows_a_redirect_to_another_origin(openai_server, second_openai_server, monkeypatch,
                                                                 same_origin):
    """A redirect to another origin (here another port of 127.0.0.1) gets the request without the Authorization
    header; one within the origin keeps it (which shows the header would be there otherwise)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-123")
    other = second_openai_server
    target = openai_server if same_origin else other
    path = "/v1/redirected/chat/completions"

    def redirect(handler, body):
        if handler.path == path:  # the same-origin target: answer normally
            text = openai_server.expected(SENTENCE)
            payload = _completion(text)
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            return handler.wfile.write(payload)
        handler.send_response(307)
        handler.send_header("Location", target.url[: -len("/v1")] + path)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    openai_server.answer_with = redirect
    other.answer_with = redirect if not same_origin else None
    if not same_origin:
        def answer_there(handler, body):
            payload = _completion("Known facts from elsewhere.")
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            handler.wfile.write(payload)
        other.answer_with = answer_there
    backend = ServerBackend(openai_server.url, "test-model", max_retries=0)
    backend.complete(SENTENCE, Sampling(), 0)
    first = openai_server.requests[0]["headers"]
    followed = (openai_server.requests if same_origin else other.requests)[-1]
    assert first["authorization"] == "Bearer sk-secret-123"
    assert followed["path"] == path
    if same_origin:
        assert followed["headers"]["authorization"] == "Bearer sk-secret-123"
    else:
        assert "authorization" not in followed["headers"]
        assert all("sk-secret" not in v for v in followed["headers"].values())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_exits_at_once_with_requests_hanging(openai_server, tmp_path, sig):
    """Every request hangs (a server that never answers): the first SIGTERM / SIGINT ends the process within
    seconds, exit status 130, rows kept; before, worker threads were joined at exit and it never ended."""
    def hang(handler, body):
        handler.server_state.stopping.wait(600)

    openai_server.answer_with = hang
    inp = tmp_path / "in.txt"
    inp.write_text("".join(f"Sentence {i} is here.\n" for i in range(20)))
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONFAULTHANDLER="1")  # SIGABRT dumps every thread's stack
    # the child must see SIGINT as a terminal's Ctrl-C does: a test run started in the background (`cmd &` in a
    # shell without job control, as CI scripts run) ignores SIGINT, the child inherits that and Python then never
    # raises KeyboardInterrupt (what made this test fail only in background runs)
    inherited = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "fastprompt.cli", "generate-ski", "--llm", "server", "--url",
                                 openai_server.url, "--model", "test-model", "--input", str(inp), "--output",
                                 str(tmp_path / "o.csv"), "--no-progress", "--concurrency", "4"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        deadline = time.monotonic() + 120
        while len(openai_server.requests) < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert len(openai_server.requests) >= 4, proc.communicate(timeout=5)
        t0 = time.monotonic()
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # show where it hangs: faulthandler's stacks of every thread
            proc.send_signal(signal.SIGABRT)
            pytest.fail(f"still running 30 s after the signal:\n{proc.communicate(timeout=30)[1][-6000:]}")
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert took < 5, took
    assert json.loads((tmp_path / "o.csv.meta.json").read_text())["complete"] is False
