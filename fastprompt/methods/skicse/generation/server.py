"""The server backend: any OpenAI-compatible endpoint (vLLM, llama.cpp's server, TGI, a hosted API), through the
``openai`` package's client.

The client retries transient failures (HTTP 408/409/429/5xx, timeouts, dropped connections) with exponential
backoff and jitter, honouring ``Retry-After`` (up to 2 minutes), and raises typed errors, which become one-line
:class:`LLMServerError` messages: a wrong URL (refused at the first contact, unknown host, HTTP 404), an unknown
model, a refused API key, retries exhausted or a malformed answer stops the run; rows already written stay.
Under it, :mod:`.transport` bounds what the client does not: each attempt's wall-clock
deadline (``timeout``), the bytes an answer may take (what ``max_new_tokens`` allows, plus room for the JSON
around it), compressed answers, and requests in flight when the run stops. Requests run on ``concurrency``
daemon threads, so an interrupted run exits at once instead of joining a thread stuck in an endless request.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import urllib.parse
from collections.abc import Iterator, Sequence

from fastprompt.choices import SERVER_APIS, check_choice
from fastprompt.methods.skicse.generation.filters import Generation
from fastprompt.methods.skicse.generation.prompt import Sampling

logger = logging.getLogger(__name__)

DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"
#: The most characters one token of any common vocabulary decodes to; an answer longer than max_new_tokens times
#: this cannot be what the server was asked for (it ignored max_tokens), and is cut and rejected as too_long.
MAX_CHARS_PER_TOKEN = 32
#: Bytes an answer may take per token of its budget: 32 characters, each up to 12 bytes once JSON-escaped (an
#: astral character is a \\uXXXX\\uXXXX surrogate pair), so no answer within the budget comes near it ...
MAX_BYTES_PER_TOKEN = 32 * 12
#: ... plus the headers and the JSON around the text (ids, usage, a chat message's other fields).
ANSWER_HEADROOM_BYTES = 64 * 1024
#: The most a /models listing may take.
MAX_LISTING_BYTES = 4 * 1024 * 1024


class LLMServerError(RuntimeError):
    """The server cannot answer (wrong URL or model, refused key, retries exhausted, malformed answer)."""


def _shown(value, limit: int = 300) -> str:
    """Server-supplied text for a one-line message: control characters (line breaks too) as spaces, cut at ``limit``."""
    return " ".join(re.sub(r"[\x00-\x1f\x7f-\x9f]", " ", str(value)).split())[:limit]


def answer_byte_cap(max_new_tokens: int) -> int:
    """The most bytes an answer of ``max_new_tokens`` tokens may take on the wire (headers included)."""
    return ANSWER_HEADROOM_BYTES + max_new_tokens * MAX_BYTES_PER_TOKEN


def import_openai():
    """The openai client package, or an ImportError that names the extra to install."""
    try:
        import openai
    except ImportError as exc:
        raise ImportError("generate-ski --llm server needs the openai client package, which is not installed: pip "
                          "install 'fastprompt[ski]' (or pip install 'openai>=3.51,<4')") from exc
    return openai


class ServerBackend:
    """An OpenAI-compatible server at ``url`` (its base, e.g. ``http://127.0.0.1:8000/v1``).

    ``api="chat"`` posts to ``/chat/completions`` (the server applies the model's chat template);
    ``"completions"`` posts the raw prompt to ``/completions`` (base models). ``model=None`` takes the only
    model the server lists at ``/models``. The API key, if any, is read from the environment variable
    ``api_key_env`` and never recorded. ``timeout``: seconds each attempt of a request may take in all (not per
    socket read); ``max_retries``: the client's retries of a transient failure. The server is contacted when the
    backend is created, so a wrong URL or model fails before any output is written.
    """

    name = "server"

    def __init__(self, url: str, model: str | None = None, *, api: str = "chat", concurrency: int = 8,
                 timeout: float = 300.0, max_retries: int = 6, api_key_env: str = DEFAULT_API_KEY_ENV):
        openai = import_openai()
        from fastprompt.methods.skicse.generation.transport import Guard, GuardedClient

        check_choice("api", api, SERVER_APIS)
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {url!r}")
        if concurrency < 1 or max_retries < 0 or not timeout > 0:
            raise ValueError("concurrency must be >= 1, max_retries >= 0 and timeout > 0")
        self.url = url.rstrip("/")
        for suffix in ("/chat/completions", "/completions"):  # a pasted endpoint instead of the base
            if self.url.endswith(suffix):
                self.url = self.url[: -len(suffix)]
        self.api, self.concurrency, self.timeout, self.max_retries = api, concurrency, timeout, max_retries
        self.api_key_env = api_key_env
        key = os.environ.get(api_key_env) if api_key_env else None
        # No key: no Authorization header at all (the client would otherwise insist on one)
        self._headers = {} if key else {"Authorization": openai.Omit()}
        self.guard = Guard(timeout, MAX_LISTING_BYTES)
        self.client = openai.OpenAI(base_url=self.url, api_key=key or "unused", max_retries=max_retries,
                                    timeout=timeout, http_client=GuardedClient(self.url, self.guard))
        self.model = model
        self.model = self._check_model(model)

    # ----------------------------------------------------------------------------------- protocol
    def settings(self) -> dict:
        return {"backend": self.name, "model": self.model, "api": self.api}

    def info(self) -> dict:
        return {"url": self.url, "concurrency": self.concurrency}

    def render(self, prompt: str) -> str:
        if self.api == "chat":
            return json.dumps([{"role": "user", "content": prompt}], ensure_ascii=False)
        return prompt

    def generate(self, prompts: Sequence[str], sampling: Sampling,
                 seeds: Sequence[int]) -> Iterator[tuple[int, Generation]]:
        """Answers as they complete, from ``concurrency`` daemon threads. When the caller stops early (an error,
        Ctrl-C, SIGTERM, closing the generator), the requests in flight are cut and nothing waits for them."""
        results: queue.SimpleQueue = queue.SimpleQueue()
        todo = iter(range(len(prompts)))
        lock, cancel = threading.Lock(), threading.Event()

        def work():
            while not cancel.is_set():
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                try:
                    results.put((i, self.complete(prompts[i], sampling, seeds[i], cancel), None))
                except BaseException as exc:  # handed to the caller's thread, which raises it
                    results.put((i, None, exc))
                    return

        for _ in range(min(self.concurrency, len(prompts))):
            threading.Thread(target=work, name="ski-server", daemon=True).start()
        try:
            for _ in range(len(prompts)):
                i, generation, error = _get_waking(results)
                if error is not None:
                    raise error
                yield i, generation
        finally:
            cancel.set()
            self.guard.cut()

    # ------------------------------------------------------------------------------------ requests
    def complete(self, prompt: str, sampling: Sampling, seed: int,
                 cancel: threading.Event | None = None) -> Generation:
        """One answer to ``prompt`` (retried on transient failures), checked against ``sampling.max_new_tokens``."""
        kwargs = {"model": self.model, "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                  "top_p": sampling.top_p, "seed": seed, "n": 1, "extra_headers": self._headers}
        path = "/chat/completions" if self.api == "chat" else "/completions"
        with self.guard.limits(max_bytes=answer_byte_cap(sampling.max_new_tokens), cancel=cancel):
            if self.api == "chat":
                answer = self._call(path, self.client.chat.completions.create,
                                    messages=[{"role": "user", "content": prompt}], **kwargs)
            else:
                answer = self._call(path, self.client.completions.create, prompt=prompt, **kwargs)
        try:
            choice = answer.choices[0]
            text = choice.message.content if self.api == "chat" else choice.text
            usage = getattr(answer, "usage", None)
            tokens = getattr(usage, "completion_tokens", None) if usage is not None else None
            if text is None:
                text = ""
            if not isinstance(text, str) or not isinstance(choice.finish_reason, (str, type(None))):
                raise TypeError(f"{'message.content' if self.api == 'chat' else 'text'} is "
                                f"{type(text).__name__}, finish_reason {type(choice.finish_reason).__name__}")
            if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
                raise TypeError(f"usage.completion_tokens is {tokens!r}")
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
            raise LLMServerError(f"{self.url}{path}: the answer is not an OpenAI {self.api} completion "
                                 f"({type(exc).__name__}: {_shown(exc, 200)})") from None
        finished = choice.finish_reason != "length"
        limit = sampling.max_new_tokens * MAX_CHARS_PER_TOKEN
        if len(text) > limit or (tokens is not None and tokens > sampling.max_new_tokens):
            # more than max_new_tokens tokens can hold: the server ignored max_tokens; cut, and rejected as too_long
            logger.warning("%s%s: an answer of %d characters (%s tokens) for a budget of %d tokens: rejected as "
                           "too_long", self.url, path, len(text), tokens, sampling.max_new_tokens)
            text, finished = text[:limit], False
        return Generation(text, finished, tokens)

    def _check_model(self, model: str | None) -> str:
        """The model to use, checked against ``/models`` when the server lists them (not every server does). This
        first contact is not retried: a wrong URL fails at once."""
        import openai

        try:
            with self.guard.limits(max_bytes=MAX_LISTING_BYTES):
                listed = self._call("/models", self.client.with_options(max_retries=0).get, "/models",
                                    cast_to=object, options={"headers": self._headers}, first=True)
        except LLMServerError as exc:
            if not isinstance(exc.__cause__, openai.NotFoundError):
                raise
            if model is None:
                raise LLMServerError(f"{self.url}/models is not available, so the model cannot be chosen "
                                     "automatically: give --model") from None
            return model
        data = listed.get("data") if isinstance(listed, dict) else None
        ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if model is None:
            if len(ids) != 1 or not isinstance(ids[0], str):
                shown = _shown(", ".join(map(str, ids))) or "none"
                raise LLMServerError(f"{self.url} serves {len(ids)} models ({shown}): choose one with --model")
            return ids[0]
        if ids and model not in ids:
            raise LLMServerError(f"model {model!r} is not served at {self.url}; it serves: "
                                 f"{_shown(', '.join(map(str, ids)))}")
        return model

    def _call(self, path: str, method, *args, first: bool = False, **kwargs):
        """``method(*args, **kwargs)`` of the client, its errors as one-line :class:`LLMServerError` (the client's
        exception is the cause)."""
        import openai

        from fastprompt.methods.skicse.generation.transport import AnswerRefused, Cancelled

        where = f"{self.url}{path}"
        retried = "" if first else f" (gave up after {self.max_retries + 1} attempts)"
        try:
            return method(*args, **kwargs)
        except (Cancelled, AnswerRefused) as exc:
            raise LLMServerError(f"{where}: {exc}") from exc
        except openai.APITimeoutError as exc:
            raise LLMServerError(f"{where}: no complete answer within the {self.timeout:g} s deadline (--timeout)"
                                 f"{retried}") from exc
        except openai.APIConnectionError as exc:
            raise LLMServerError(self._connection_error(exc, where, first) + retried) from exc
        except openai.APIStatusError as exc:
            message = _error_message(exc)
            transient = exc.status_code in (408, 409, 429) or exc.status_code >= 500
            raise LLMServerError(self._http_error(exc.status_code, path, message)
                                 + (retried if transient else "")) from exc
        except openai.OpenAIError as exc:  # e.g. a redirect loop, a malformed header
            raise LLMServerError(f"{where}: {type(exc).__name__}: {_shown(exc, 200)}") from exc
        except ValueError as exc:  # a body that is not JSON (json.JSONDecodeError), or not the expected shape
            raise LLMServerError(f"{where}: the answer is not JSON of an OpenAI API ({_shown(exc, 200)})") from exc

    def _connection_error(self, exc, where: str, first: bool) -> str:
        import socket

        cause = exc.__cause__
        while cause is not None and cause.__cause__ is not None and not isinstance(cause, OSError):
            cause = cause.__cause__
        text = _shown(f"{type(cause).__name__}: {cause}" if cause is not None else exc)
        if "Name or service not known" in text or "nodename nor servname" in text or isinstance(cause,
                                                                                              socket.gaierror):
            return f"cannot resolve the host of {self.url} ({text[:200]}): check --url"
        if first and ("refused" in text.lower() or isinstance(cause, ConnectionRefusedError)):
            return (f"cannot connect to {self.url}: connection refused (is the server running, and is --url its "
                    "OpenAI base URL, e.g. http://127.0.0.1:8000/v1?)")
        return f"{where}: {text[:300]}"

    def _http_error(self, code: int, path: str, message: str) -> str:
        if code in (401, 403):
            return (f"{self.url}{path}: HTTP {code} ({message}): the server refused the credentials; put the API "
                    f"key in the environment variable {self.api_key_env}")
        if code == 404 and "model" in message.lower():
            return f"{self.url}{path}: HTTP 404: the server does not know the model {self.model!r}: {message}"
        if code == 404:
            return (f"{self.url}{path}: HTTP 404 ({message}): no such endpoint; is --url the server's OpenAI base "
                    f"URL (e.g. http://127.0.0.1:8000/v1), and does it serve {'chat ' if self.api == 'chat' else ''}"
                    "completions?")
        return f"{self.url}{path}: HTTP {code}: {message}"


def _error_message(exc) -> str:
    """The ``error.message`` of an OpenAI-style error body (or ``message``/``detail``), else the body's start."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return _shown(err.get("message") or err.get("detail") or err)
        return _shown(err)
    if body is not None:
        return _shown(body, 200)
    try:
        return _shown(exc.response.text, 200)
    except Exception:  # noqa: BLE001 - an unreadable body has nothing more to say
        return ""


def _get_waking(results: queue.SimpleQueue, every: float = 0.25):
    """``results.get()``, waking every ``every`` seconds: a Ctrl-C or SIGTERM is then handled within that time even
    when the kernel delivered the signal to a worker thread, which does not interrupt the main thread's wait."""
    while True:
        try:
            return results.get(timeout=every)
        except queue.Empty:
            continue
