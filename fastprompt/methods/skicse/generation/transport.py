"""The HTTP layer under the ``openai`` client of the server backend: what the client does not bound by itself.

httpx's timeouts bound each socket operation, not a request: a server sending one byte a second never times out,
and an endless answer is read whole into memory. :class:`GuardedClient` (the client's ``http_client``) starts a
deadline and a byte budget for each attempt; its :class:`GuardedTransport` is an ``httpx2.HTTPTransport`` whose
connections run on :class:`_GuardedBackend`, a network backend that gives every read and write of a request
attempt only what is left of the attempt's wall-clock deadline (``httpcore2.ReadTimeout`` past it: a timeout the
``openai`` client retries like any other), counts the bytes read (headers and body) against a budget
(:class:`AnswerRefused` past it, which the client does not retry), and can cut every request in flight
(:meth:`Guard.cut`: their sockets are shut down, which wakes a blocked read at once). The deadline, budget and
cancellation of the requests a thread sends are set with :meth:`Guard.limits`. Compressed answers are refused
(their decoded size is not bounded by the bytes read), and ``Accept-Encoding: identity`` asks for none.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request

import httpcore2
import httpx2
import openai


class AnswerRefused(openai.OpenAIError):
    """An answer past its byte budget, or compressed (not retried: the server would send it again)."""


class Cancelled(openai.OpenAIError):
    """The run is stopping: no new attempt, and a request in flight ends at once (not retried)."""


class Guard:
    """Deadline, byte budget and cancellation of the request attempt each thread is sending."""

    def __init__(self, timeout: float, max_bytes: int):
        self.timeout, self.max_bytes = timeout, max_bytes
        self._local = threading.local()
        self._busy: set = set()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def limits(self, *, max_bytes: int | None = None, cancel: threading.Event | None = None):
        """The requests this thread sends inside the block read at most ``max_bytes`` each and stop when ``cancel``
        is set."""
        saved = dict(self._local.__dict__)
        self._local.max_bytes, self._local.cancel = max_bytes or self.max_bytes, cancel
        try:
            yield
        finally:
            self._local.__dict__.clear()
            self._local.__dict__.update(saved)

    def start_attempt(self) -> None:
        """A new attempt (the first or a retry) of this thread's request: its own deadline and budget."""
        self.check_cancelled()
        self._local.deadline = time.monotonic() + self.timeout
        self._local.left = self._local.budget = getattr(self._local, "max_bytes", None) or self.max_bytes

    def check_cancelled(self) -> None:
        cancel = getattr(self._local, "cancel", None)
        if cancel is not None and cancel.is_set():
            raise Cancelled("cancelled")

    def time_left(self, timeout: float | None, error: type[Exception]) -> float | None:
        """``timeout`` cut to what is left of this thread's deadline; ``error`` once it has passed."""
        self.check_cancelled()
        deadline = getattr(self._local, "deadline", None)
        if deadline is None:
            return timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise error(f"no complete answer within the {self.timeout:g} s deadline")
        return left if timeout is None else min(timeout, left)

    def count(self, n: int) -> None:
        if getattr(self._local, "left", None) is None:
            return
        self._local.left -= n
        if self._local.left < 0:
            raise AnswerRefused(f"the answer is larger than {self._local.budget} bytes")

    @contextlib.contextmanager
    def busy(self, stream):
        with self._lock:
            self._busy.add(stream)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(stream)
        self.check_cancelled()  # a read that a cut ended returns what it had: stop here, not in a retry

    def cut(self) -> None:
        """Shut down the socket of every request now reading or writing: each ends at once."""
        with self._lock:
            streams = list(self._busy)
        for stream in streams:
            sock = stream.get_extra_info("socket")
            with contextlib.suppress(OSError, AttributeError):
                sock.shutdown(socket.SHUT_RDWR)


class _GuardedStream(httpcore2.NetworkStream):
    def __init__(self, stream: httpcore2.NetworkStream, guard: Guard):
        self._stream, self._guard = stream, guard

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        timeout = self._guard.time_left(timeout, httpcore2.ReadTimeout)
        with self._guard.busy(self):
            data = self._stream.read(max_bytes, timeout)
        self._guard.count(len(data))
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        timeout = self._guard.time_left(timeout, httpcore2.WriteTimeout)
        with self._guard.busy(self):
            self._stream.write(buffer, timeout)

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None, timeout: float | None = None):
        timeout = self._guard.time_left(timeout, httpcore2.ConnectTimeout)
        return _GuardedStream(self._stream.start_tls(ssl_context, server_hostname, timeout), self._guard)

    def get_extra_info(self, info: str):
        return self._stream.get_extra_info(info)


class _GuardedBackend(httpcore2.NetworkBackend):
    def __init__(self, guard: Guard):
        self._backend, self._guard = httpcore2.SyncBackend(), guard

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        timeout = self._guard.time_left(timeout, httpcore2.ConnectTimeout)
        return _GuardedStream(self._backend.connect_tcp(host, port, timeout, local_address, socket_options),
                              self._guard)

    def connect_unix_socket(self, path, timeout=None, socket_options=None):  # pragma: no cover (no --uds option)
        timeout = self._guard.time_left(timeout, httpcore2.ConnectTimeout)
        return _GuardedStream(self._backend.connect_unix_socket(path, timeout, socket_options), self._guard)

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class GuardedTransport(httpx2.HTTPTransport):
    """An ``httpx2.HTTPTransport`` (through the proxy the environment names for ``url``, as urllib would) whose
    connections are guarded by ``guard``; compressed answers are refused."""

    def __init__(self, url: str, guard: Guard):
        super().__init__(proxy=_environment_proxy(url))
        if not hasattr(self._pool, "_network_backend"):  # httpcore's pools keep it there; fail loudly if not
            raise RuntimeError("httpcore2's connection pool has no _network_backend: this httpx2 is not supported")
        self._pool._network_backend = _GuardedBackend(guard)
        self.guard = guard

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = super().handle_request(request)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            response.close()
            raise AnswerRefused(f"the answer is compressed ({encoding}) though identity was asked for: its size "
                                 "once decoded is unbounded")
        return response


def _environment_proxy(url: str) -> str | None:
    """The proxy that http_proxy/https_proxy/no_proxy name for ``url`` (None: a direct connection)."""
    parsed = urllib.request.urlparse(url)
    if urllib.request.proxy_bypass(parsed.hostname or ""):
        return None
    return urllib.request.getproxies().get(parsed.scheme)


class GuardedClient(httpx2.Client):
    """The httpx client the ``openai`` client runs on (its ``http_client``): each ``send`` (one attempt of the
    ``openai`` client: redirects followed and the whole body read) gets its own deadline and byte budget. Redirects
    are followed, at most 5 (httpx drops the Authorization header when one leaves the origin); no compressed
    answers."""

    def __init__(self, url: str, guard: Guard):
        super().__init__(transport=GuardedTransport(url, guard), trust_env=False, follow_redirects=True,
                         max_redirects=5, headers={"Accept-Encoding": "identity"},
                         timeout=httpx2.Timeout(guard.timeout))
        self.guard = guard

    def send(self, request: httpx2.Request, **kwargs) -> httpx2.Response:
        self.guard.start_attempt()
        return super().send(request, **kwargs)
