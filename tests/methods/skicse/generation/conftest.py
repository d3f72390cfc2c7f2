"""A small OpenAI-compatible server on 127.0.0.1 for the SKI generation tests (http.server in a thread).

It answers ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` deterministically from the
sentence inside the prompt, so runs can be compared row for row. Knobs on the ``openai_server`` fixture:
``fail_next`` (answer that many requests with 503 first), ``retry_after`` (the 503s' Retry-After header, "0.01";
None: no header), ``reset_next`` (drop that many connections without
an answer), ``delay`` (seconds per completion), ``list_models`` (False: /models is a 404), ``models``,
``answer_with`` (a function answering completion requests instead, for hostile servers).
Sentences starting with ECHO / EMPTY / LONG get an echo / empty / cut-off answer; FLAKY ones an echo the
first time they are asked and a good answer after.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

_SENTENCE = re.compile(r'Sentence: "(.*)"\n1\)', re.S)


def expected_answer(sentence: str) -> str:
    """The test server's good answer for ``sentence``."""
    digest = hashlib.sha256(sentence.encode()).hexdigest()[:8]
    return f"Known facts: it holds {len(sentence.split())} words.\nChecksum {digest} identifies it."


class FakeOpenAI:
    def __init__(self):
        self.models = ["test-model"]
        self.list_models = True
        self.fail_next = 0
        self.retry_after: str | None = "0.01"
        self.reset_next = 0
        self.delay = 0.0
        #: ``fn(handler, body)`` answering completion requests instead (writes to ``handler.wfile`` itself)
        self.answer_with = None
        self.answer_get_with = None  # the same for GET /models
        self.stopping = threading.Event()  # set when the server stops
        self.sent = 0  # bytes a hostile answer_with sent
        self.requests: list[dict] = []  # completion requests: {"path", "body", "headers" (lower-case), "time"}
        self.asked: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.url = ""

    @staticmethod
    def expected(sentence: str) -> str:
        """The SKI a good answer becomes (whitespace collapsed)."""
        return " ".join(expected_answer(sentence).split())

    def answer(self, prompt: str) -> tuple[str, str]:
        match = _SENTENCE.search(prompt)
        sentence = match.group(1) if match else prompt
        with self.lock:
            self.asked[sentence] = self.asked.get(sentence, 0) + 1
            times = self.asked[sentence]
        if sentence.startswith("ECHO") or (sentence.startswith("FLAKY") and times == 1):
            return sentence, "stop"
        if sentence.startswith("EMPTY"):
            return "  \n ", "stop"
        if sentence.startswith("LONG"):
            return "It goes on and on and", "length"
        return expected_answer(sentence), "stop"


def _handler(state: FakeOpenAI):
    class Handler(BaseHTTPRequestHandler):
        server_state = state

        def log_message(self, *args):  # quiet
            pass

        def _send(self, code: int, payload, headers=None):
            body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if state.answer_get_with is not None:
                return state.answer_get_with(self, None)
            if self.path == "/v1/models" and state.list_models:
                self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in state.models]})
            else:
                self._send(404, b"Not Found")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                headers = {k.lower(): v for k, v in self.headers.items()}
                state.requests.append({"path": self.path, "body": body, "headers": headers, "time": time.monotonic()})
            if state.answer_with is not None:  # a test's own answer (drip, endless, redirect, random bytes, ...)
                return state.answer_with(self, body)
            with state.lock:
                if state.reset_next:
                    state.reset_next -= 1
                    self.close_connection = True
                    return  # no answer at all: the client sees the connection closed
                if state.fail_next:
                    state.fail_next -= 1
                    headers = {} if state.retry_after is None else {"Retry-After": state.retry_after}
                    return self._send(503, {"error": {"message": "model is loading"}}, headers)
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                return self._send(404, b"Not Found")
            if body.get("model") not in state.models:
                return self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                  "type": "NotFoundError", "code": 404}})
            with state.lock:
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                time.sleep(state.delay)
                chat = self.path.endswith("chat/completions")
                prompt = body["messages"][-1]["content"] if chat else body["prompt"]
                text, finish = state.answer(prompt)
            finally:
                # counted out before the answer is sent: once the client has it, it may send its next request
                # before this thread runs again, and that request must not be counted beside this one
                with state.lock:
                    state.in_flight -= 1
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            self._send(200, {"id": "x", "object": "chat.completion" if chat else "text_completion",
                             "model": body["model"], "choices": [choice],
                             "usage": {"completion_tokens": len(text.split())}})

    return Handler


@contextlib.contextmanager
def serve(state: FakeOpenAI):
    """Run ``state``'s server on a free port of 127.0.0.1 (``state.url`` is its /v1 base) until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield state
    finally:
        state.stopping.set()  # ends the loops of hostile answers (drip, endless)
        server.shutdown()
        server.server_close()


@pytest.fixture
def openai_server(monkeypatch):
    """A running :class:`FakeOpenAI` on 127.0.0.1 (``.url`` is its /v1 base); stopped after the test."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with serve(FakeOpenAI()) as state:
        yield state


@pytest.fixture
def second_openai_server(openai_server):
    """Another :class:`FakeOpenAI`, on another port: another origin (for redirects)."""
    with serve(FakeOpenAI()) as state:
        yield state
