"""The server backend: any OpenAI-compatible endpoint (vLLM, llama.cpp's server, TGI, a hosted API).

Standard library only (urllib + a thread pool): ``concurrency`` requests in flight, each retried with
exponential backoff on transient failures (HTTP 408/429/5xx, connection reset or refused after the server
was reached once, timeouts), honouring ``Retry-After``. A wrong URL (connection refused at the first
contact, unknown host, HTTP 404), an unknown model, a refused API key or a malformed answer stops the run
with a one-line :class:`LLMServerError`; rows already written stay.
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import random
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from fastprompt.choices import SERVER_APIS, check_choice
from fastprompt.data.ski.filters import Generation
from fastprompt.data.ski.prompt import Sampling

logger = logging.getLogger(__name__)

#: HTTP statuses worth retrying: timeout, conflict/too early, rate limit, server errors and overload.
TRANSIENT_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"


class LLMServerError(RuntimeError):
    """The server cannot answer (wrong URL or model, refused key, retries exhausted, malformed answer)."""


class _Transient(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def _error_message(body: bytes) -> str:
    """The ``error.message`` of an OpenAI-style error body (or ``message``/``detail``), else the body's start."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:300]
        return str(err)[:300]
    return text[:200]


def _retry_after(headers) -> float | None:
    try:
        return max(0.0, float(headers.get("Retry-After")))
    except (TypeError, ValueError):
        return None


class ServerBackend:
    """An OpenAI-compatible server at ``url`` (its base, e.g. ``http://127.0.0.1:8000/v1``).

    ``api="chat"`` posts to ``/chat/completions`` (the server applies the model's chat template);
    ``"completions"`` posts the raw prompt to ``/completions`` (base models). ``model=None`` takes the only
    model the server lists at ``/models``. The API key, if any, is read from the environment variable
    ``api_key_env`` and never recorded. The server is contacted when the backend is created, so a wrong
    URL or model fails before any output is written.
    """

    name = "server"

    def __init__(self, url: str, model: str | None = None, *, api: str = "chat", concurrency: int = 8,
                 timeout: float = 300.0, max_retries: int = 6, backoff: float = 1.0, max_backoff: float = 60.0,
                 api_key_env: str = DEFAULT_API_KEY_ENV):
        check_choice("api", api, SERVER_APIS)
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {url!r}")
        if concurrency < 1 or max_retries < 0 or timeout <= 0 or backoff < 0:
            raise ValueError("concurrency must be >= 1, max_retries >= 0, timeout > 0 and backoff >= 0")
        self.url = url.rstrip("/")
        for suffix in ("/chat/completions", "/completions"):  # a pasted endpoint instead of the base
            if self.url.endswith(suffix):
                self.url = self.url[: -len(suffix)]
        self.api, self.concurrency, self.timeout = api, concurrency, timeout
        self.max_retries, self.backoff, self.max_backoff = max_retries, backoff, max_backoff
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(api_key_env) if api_key_env else None
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        self.api_key_env = api_key_env
        self._reached = False  # after one answer, a refused connection is a restart, not a wrong URL
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
        stop = threading.Event()
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="ski-server")
        pending = iter(range(len(prompts)))
        in_flight = {}

        def submit_next():
            i = next(pending, None)
            if i is not None:
                in_flight[pool.submit(self.complete, prompts[i], sampling, seeds[i], stop)] = i

        try:
            for _ in range(2 * self.concurrency):  # a small queue keeps every worker busy
                submit_next()
            while in_flight:
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    i = in_flight.pop(future)
                    yield i, future.result()
                    submit_next()
        finally:
            stop.set()  # wakes retry sleeps; requests on the wire finish or time out on their own
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------ requests
    def complete(self, prompt: str, sampling: Sampling, seed: int, stop: threading.Event | None = None) -> Generation:
        """One answer to ``prompt`` (retried on transient failures)."""
        payload = {"model": self.model, "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                   "top_p": sampling.top_p, "seed": seed, "n": 1}
        if self.api == "chat":
            payload["messages"] = [{"role": "user", "content": prompt}]
        else:
            payload["prompt"] = prompt
        data = self._request("POST", f"/{'chat/completions' if self.api == 'chat' else 'completions'}", payload, stop)
        try:
            choice = data["choices"][0]
            text = choice["message"]["content"] if self.api == "chat" else choice["text"]
            usage = data.get("usage") or {}
            tokens = usage.get("completion_tokens")
            return Generation(text or "", choice.get("finish_reason") != "length",
                              int(tokens) if tokens is not None else None)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LLMServerError(f"{self.url}: the answer is not an OpenAI {self.api} completion "
                                 f"({type(exc).__name__}: {exc}): {json.dumps(data)[:200]}") from None

    def _check_model(self, model: str | None) -> str:
        """The model to use, checked against ``/models`` when the server lists them (not every server does)."""
        try:
            listed = self._request("GET", "/models")
        except LLMServerError as exc:
            if "HTTP 404" not in str(exc):
                raise
            if model is None:
                raise LLMServerError(f"{self.url}/models is not available, so the model cannot be chosen "
                                     "automatically: give --model") from None
            return model
        ids = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)] if isinstance(listed, dict) else []
        if model is None:
            if len(ids) != 1:
                raise LLMServerError(f"{self.url} serves {len(ids)} models ({', '.join(map(str, ids)) or 'none'}): "
                                     "choose one with --model")
            return ids[0]
        if ids and model not in ids:
            raise LLMServerError(f"model {model!r} is not served at {self.url}; it serves: {', '.join(map(str, ids))}")
        return model

    def _request(self, method: str, path: str, payload: dict | None = None,
                 stop: threading.Event | None = None) -> dict:
        stop = stop or threading.Event()
        for attempt in range(self.max_retries + 1):
            try:
                return self._request_once(method, path, payload)
            except _Transient as exc:
                if attempt == self.max_retries:
                    raise LLMServerError(f"{self.url}{path}: {exc} (gave up after {attempt + 1} attempts)") from None
                delay = exc.retry_after
                if delay is None:  # exponential backoff with jitter, so parallel requests do not retry in step
                    delay = self.backoff * 2 ** attempt * random.uniform(0.5, 1.5)
                delay = min(delay, self.max_backoff)
                logger.info("%s%s: %s; retry %d/%d in %.2f s", self.url, path, exc, attempt + 1, self.max_retries,
                            delay)
                if stop.wait(delay):
                    raise LLMServerError(f"{self.url}{path}: cancelled") from None
        raise AssertionError("unreachable")

    def _request_once(self, method: str, path: str, payload: dict | None) -> dict:
        url = self.url + path
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(url, data=data, headers=self._headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
            if exc.code in TRANSIENT_STATUS:
                raise _Transient(f"HTTP {exc.code}: {_error_message(body)}", _retry_after(exc.headers)) from None
            raise LLMServerError(self._http_error(exc.code, path, _error_message(body))) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, socket.gaierror):
                raise LLMServerError(f"cannot resolve the host of {self.url} ({reason}): check --url") from None
            if isinstance(reason, ConnectionRefusedError) and not self._reached:
                raise LLMServerError(f"cannot connect to {self.url}: connection refused (is the server running, "
                                     "and is --url its OpenAI base URL, e.g. http://127.0.0.1:8000/v1?)") from None
            if isinstance(reason, (OSError, TimeoutError)):
                raise _Transient(f"{type(reason).__name__}: {reason}") from None
            raise LLMServerError(f"{url}: {reason}") from None
        except (TimeoutError, ConnectionError, http.client.HTTPException) as exc:  # reset, cut, timed out mid-answer
            raise _Transient(f"{type(exc).__name__}: {exc}") from None
        self._reached = True
        try:
            return json.loads(body)
        except ValueError:
            raise LLMServerError(f"{url}: the answer is not JSON: {body[:200]!r}") from None

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
