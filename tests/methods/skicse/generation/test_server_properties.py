"""Property-based tests of the server backend: a stub on 127.0.0.1 answers with random and adversarial status
codes, headers and bodies (hypothesis). Every answer ends in a correct result or one LLMServerError, never another
exception (a traceback), never a hang (each example is bounded by the 2 s deadline), and generate_ski changes no
file outside its output folder. Redirects only ever point back to 127.0.0.1 (no traffic leaves the machine)."""
import json
import time
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastprompt.methods.skicse.generation import LLMServerError, Sampling, ServerBackend, generate_ski  # noqa: E402
from fastprompt.methods.skicse.generation.filters import Generation  # noqa: E402
from fastprompt.methods.skicse.generation.server import MAX_CHARS_PER_TOKEN  # noqa: E402

SAMPLING = Sampling(max_new_tokens=16)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                       st.text(max_size=40))
_json = st.recursive(_json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                     max_leaves=12)
_field = st.one_of(_json, st.text(max_size=200))
_completion = st.builds(
    lambda content, finish, tokens, shape: {
        "chat": {"choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant",
                                                                             "content": content}}],
                 "usage": {"completion_tokens": tokens}},
        "no-choices": {"choices": []},
        "choices-not-a-list": {"choices": content},
        "message-missing": {"choices": [{"finish_reason": finish}]},
        "usage-odd": {"choices": [{"message": {"content": content}, "finish_reason": finish}], "usage": tokens},
    }[shape],
    _field, st.one_of(st.sampled_from(["stop", "length", None, ""]), _json),
    st.one_of(st.none(), st.integers(-5, 100), _json), st.sampled_from(
        ["chat", "chat", "chat", "no-choices", "choices-not-a-list", "message-missing", "usage-odd"]))
_body = st.one_of(
    _completion.map(lambda d: json.dumps(d).encode()),
    _json.map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=300),
    st.sampled_from([b"", b"{", b"null", b"[]", b'{"choices": [{"message": {"content": "\\ud800"}}]}',
                     b'{"error": {"message": "boom"}}', b"\xff\xfe not utf-8"]),
)
_status = st.one_of(st.sampled_from([200, 200, 200, 200, 201, 204, 301, 302, 307, 308, 400, 401, 403, 404, 408, 409,
                                     413, 422, 429, 500, 502, 503]), st.integers(200, 599))
_header_value = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
_headers = st.dictionaries(
    st.sampled_from(["Content-Type", "Retry-After", "Retry-After-Ms", "X-Should-Retry", "Content-Encoding", "Location",
                     "X-Request-Id", "Set-Cookie", "Transfer-Encoding-Hint"]), _header_value, max_size=4)
_local_location = st.sampled_from(["/v1/chat/completions", "/v1/elsewhere", "/", "relative/path", "?q=1",
                                   "http://127.0.0.1:9/v1/chat/completions"])


def _answerer(status: int, headers: dict, body: bytes, location: str):
    def answer(handler, request_body):
        handler.send_response(status)
        for name, value in headers.items():
            if name == "Location":
                value = location  # never another host: the redirect stays on this machine
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.close_connection = True
        try:
            handler.wfile.write(body)
        except OSError:
            pass
    return answer


def _check_generation(gen: Generation) -> None:
    assert isinstance(gen, Generation) and isinstance(gen.text, str) and isinstance(gen.finished, bool)
    assert gen.tokens is None or (isinstance(gen.tokens, int) and gen.tokens >= 0)
    assert len(gen.text) <= SAMPLING.max_new_tokens * MAX_CHARS_PER_TOKEN


@given(status=_status, headers=_headers, body=_body, location=_local_location)
@SETTINGS
def test_any_completion_answer_is_a_result_or_one_clear_error(openai_server, status, headers, body, location):
    openai_server.answer_with = _answerer(status, headers, body, location)
    backend = ServerBackend(openai_server.url, "test-model", timeout=2.0, max_retries=0)
    t0 = time.monotonic()
    try:
        _check_generation(backend.complete("One sentence here.", SAMPLING, 0))
    except LLMServerError as exc:
        message = str(exc)
        assert "\n" not in message and 0 < len(message) < 1500, message
    assert time.monotonic() - t0 < 2.0 * 6 + 1  # the deadline, across at most 5 redirects


@given(status=_status, headers=_headers, body=_body)
@SETTINGS
def test_any_models_listing_gives_a_model_or_one_clear_error(openai_server, status, headers, body):
    openai_server.answer_get_with = _answerer(status, headers, body, "/v1/models")
    try:
        backend = ServerBackend(openai_server.url, None, timeout=2.0, max_retries=0)
    except LLMServerError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(backend.model, str)


@given(answers=st.lists(st.tuples(_status, _headers, _body), min_size=1, max_size=4))
@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_generate_ski_changes_nothing_outside_its_output_folder(openai_server, tmp_path_factory, answers):
    """A run against a server answering each request with the next random answer: rows (or a clear error), and
    the input and every other file byte-identical."""
    root = tmp_path_factory.mktemp("prop")
    inp = root / "in.txt"
    inp.write_bytes(b"A cat sat on the mat.\nTwo dogs ran in the park.\nRain fell all day long.\n")
    (root / "keep.csv").write_bytes(b"sent0,ski\nmine,mine\n")
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    queue = list(answers)

    def answer(handler, body):
        status, headers, payload = queue.pop(0) if len(queue) > 1 else queue[0]
        return _answerer(status, headers, payload, "/v1/chat/completions")(handler, body)

    openai_server.answer_with = answer
    backend = ServerBackend(openai_server.url, "test-model", timeout=2.0, max_retries=0)
    out = root / "out" / "ski.csv"
    try:
        generate_ski(inp.read_text().splitlines(), backend, out, sampling=SAMPLING, attempts=2,
                     show_progress_bar=False)
    except LLMServerError:
        pass
    assert {p.name: p.read_bytes() for p in root.iterdir() if p.name != "out"} == before
    assert {p.name for p in (root / "out").iterdir()} <= {"ski.csv", "ski.csv.rejected.csv", "ski.csv.meta.json"}
    assert Path(out).is_file()
