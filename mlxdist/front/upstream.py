"""The front's client of the rank server: requests forwarded to rank 0's
HTTP server on loopback, whose address is read from the job on every call
(it changes when the job is restarted).

    upstream = Upstream(job)                 # job: base_url (None while not serving), state
    response = await upstream.post("/v1/chat/completions", body, headers)
    async with upstream.stream("/v1/chat/completions", body, headers) as response:
        async for line in response.aiter_lines():   # the SSE lines, as the rank server sends them
            ...

Both raise ``Unavailable`` (a 503, retry after some seconds) when the job is
not serving, when the connection to it fails, or when it drops mid-answer.
Any answer the rank server gives (its 4xx included) is returned as it is.

A request the job loses before it said anything (no answer yet; a stream
with no content chunk yet; one that came while the job served, not sent
before it stopped serving) is held (``hold`` seconds at most, ``max_held``
requests at most) and sent again to the job started on the ranks left, once
it serves: its client sees the new job's answer alone. A request that
arrives while the job does not serve is answered 503 at once; one lost
after it said something ends as it does without the hold.
"""

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator, Callable, Dict, Mapping, Optional, Union

import httpx

from mlxdist.front.errors import DEFAULT_RETRY_AFTER, Unavailable
from mlxdist.runtime.heartbeat import DEFAULT_HEARTBEAT

# What the front passes on to the rank server: the rest (Host, Authorization,
# hop-by-hop headers) is the front's own business.
FORWARDED_HEADERS = ("content-type", "accept", "user-agent")
_CONNECT_TIMEOUT = 5.0
DEFAULT_HOLD = 120.0  # seconds a request lost before it said anything waits for the new job
DEFAULT_MAX_HELD = 64
_NOTICE_SLACK = 2.0  # seconds past the heartbeat for the job to leave serving after a loss its server reported
_POLL = 0.05
_SERVING = ("ok", "degraded")
Body = Union[Dict[str, Any], bytes]  # a JSON object, or its bytes as the client sent them


class Upstream:
    """An ``httpx.AsyncClient`` to the job's rank server. ``job`` has
    ``base_url`` (``"http://127.0.0.1:PORT"`` or None while not serving) and
    ``state``, and may have ``api_key`` (the token the rank server was
    started with, sent as ``Authorization: Bearer``); ``read_timeout`` bounds the wait for the rank server's next
    bytes (None: unbounded; a step of a long prefill may take long)."""

    def __init__(self, job: Any, read_timeout: Optional[float] = None, retry_after: int = DEFAULT_RETRY_AFTER,
                 hold: float = DEFAULT_HOLD, max_held: int = DEFAULT_MAX_HELD):
        self.job = job
        self.retry_after = retry_after
        self.hold, self.max_held = hold, max_held
        self.held = 0  # requests waiting for the next job now
        self.replayed = 0  # requests sent again to a new job, ever
        timeout = httpx.Timeout(connect=_CONNECT_TIMEOUT, read=read_timeout, write=_CONNECT_TIMEOUT, pool=None)
        # no pool limit: the front's own connection cap bounds what reaches here
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)

    def _url(self, path: str) -> str:
        base = self.job.base_url
        if not base:
            raise Unavailable(_not_serving(getattr(self.job, "state", "stopped")), self.retry_after)
        return base.rstrip("/") + path

    def _headers(self, headers: Optional[Mapping[str, str]]) -> Dict[str, str]:
        out = {"content-type": "application/json", **_forwarded(headers)}
        token = getattr(self.job, "api_key", None)
        if token:
            out["authorization"] = f"Bearer {token}"
        return out

    def _unavailable(self, e: Exception) -> Unavailable:
        state = getattr(self.job, "state", "stopped")
        why = _not_serving(state) if state != "ok" else "the rank job stopped answering"
        return Unavailable(f"{why} ({type(e).__name__})", self.retry_after)

    async def get(self, path: str, headers: Optional[Mapping[str, str]] = None) -> httpx.Response:
        """The rank server's whole answer to ``GET path``."""
        url = self._url(path)
        try:
            return await self.client.get(url, headers=self._headers(headers))
        except httpx.TransportError as e:
            raise self._unavailable(e) from None

    async def post(self, path: str, body: Body, headers: Optional[Mapping[str, str]] = None) -> httpx.Response:
        """The rank server's whole answer to ``POST path`` with JSON ``body``
        (a dict, or bytes sent as they are) (its status, headers and body,
        read whole); from the next job where this one lost it (a 503 or a
        dropped connection) and one serves within the hold."""
        url, held_since = self._url(path), None
        while True:
            try:
                answer = await self.client.post(url, headers=self._headers(headers), **_content(body))
                failure: Optional[Exception] = None
                if answer.status_code != 503:
                    return answer
            except httpx.TransportError as e:
                failure = e
            held_since = held_since or time.monotonic()
            base = await self.next_job(url, held_since)
            if base is None:
                if failure is None:
                    return answer
                raise self._unavailable(failure) from None
            url = base.rstrip("/") + path

    async def _first_url(self, path: str, arrived: Optional[str]) -> str:
        """Where to send a request first: the serving job's ``path``, or
        the next job's where the one at ``arrived`` has stopped serving."""
        if self.job.base_url is None and arrived:
            base = await self.next_job(arrived.rstrip("/") + path, time.monotonic())
            if base is not None:
                return base.rstrip("/") + path
        return self._url(path)

    async def next_job(self, failed_url: str, held_since: float) -> Optional[str]:
        """The base URL of the job that serves after the one at ``failed_url``
        lost a request (each wait counted in ``held``; ``replayed`` where it
        returns one), or None: no hold (off, or ``max_held`` held already),
        the job still serving there past the heartbeat (the 503 or the
        dropped connection was no loss), the job stopped, or ``hold``
        seconds gone since ``held_since`` (``time.monotonic()``)."""
        if self.hold <= 0 or self.held >= self.max_held:
            return None
        failed = httpx.URL(failed_url)
        heartbeat = getattr(getattr(self.job, "spec", None), "heartbeat", None) or DEFAULT_HEARTBEAT
        notice_by = time.monotonic() + heartbeat + _NOTICE_SLACK
        left_serving = False
        self.held += 1
        try:
            while time.monotonic() < held_since + self.hold:
                state, base = getattr(self.job, "state", "stopped"), self.job.base_url
                if state == "stopped":
                    return None
                if base is None or state not in _SERVING:
                    left_serving = True
                elif left_serving or (httpx.URL(base).host, httpx.URL(base).port) != (failed.host, failed.port):
                    self.replayed += 1
                    return base
                elif time.monotonic() > notice_by:
                    return None
                await asyncio.sleep(_POLL)
            return None
        finally:
            self.held -= 1

    @contextlib.asynccontextmanager
    async def stream(self, path: str, body: Body, headers: Optional[Mapping[str, str]] = None,
                     whole: bool = False, arrived: Optional[str] = None) -> AsyncIterator[httpx.Response]:
        """The rank server's answer to ``POST path``, its body not read yet:
        ``aiter_lines()`` gives the SSE lines. Raises ``Unavailable`` on
        entry (not serving, no connection) and from the iteration (the
        connection dropped mid-answer). Lost before its first content chunk
        (a 503, a dropped connection, a 503 error event), it is sent again
        to the next job (``next_job``) and its lines are that job's alone.
        ``whole``: the lines make one answer the client gets at their end
        (a request that does not stream), so a loss anywhere before that end
        sends it again, and the lines come once the answer is whole.
        ``arrived``: the job's base URL when the request came; where the job
        has stopped serving since, the request is held for the next job as
        one it lost (not answered 503, as a request that came meanwhile is)."""
        guarded = _Guarded(self, path, body, headers, _said_nothing if whole else _says)
        try:
            await guarded.open(await self._first_url(path, arrived))
            yield guarded
        finally:
            await guarded.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()


class _Guarded:
    """An ``httpx.Response`` whose iteration raises ``Unavailable`` when the
    connection drops mid-answer, and sends the request again to the next job
    where it was lost before it said anything (other attributes are the
    current response's)."""

    def __init__(self, upstream: Upstream, path: str, body: Body, headers: Optional[Mapping[str, str]],
                 says: Callable[[str], Optional[bool]]):
        self._upstream, self._path, self._body, self._headers = upstream, path, body, headers
        self._says = says
        self._response: Optional[httpx.Response] = None
        self._url = ""
        self._held_since: Optional[float] = None

    async def open(self, url: str) -> None:
        """Send the request to ``url`` until an answer that is not a loss, or
        one the hold cannot carry over (its 503, or ``Unavailable``)."""
        upstream = self._upstream
        while True:
            await self.aclose()
            self._url = url
            request = upstream.client.build_request("POST", url, headers=upstream._headers(self._headers),
                                                    **_content(self._body))
            try:
                self._response = await upstream.client.send(request, stream=True)
                failure: Optional[Exception] = None
                if self._response.status_code != 503:
                    return
                await self._response.aread()
            except (httpx.TransportError, httpx.StreamError) as e:
                failure = e
            base = await self._next_job()
            if base is None:
                if failure is None:
                    return
                raise upstream._unavailable(failure) from None
            url = base.rstrip("/") + self._path

    async def _next_job(self) -> Optional[str]:
        self._held_since = self._held_since or time.monotonic()
        return await self._upstream.next_job(self._url, self._held_since)

    async def aclose(self) -> None:
        if self._response is not None:
            await self._response.aclose()

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The answer's SSE lines. Until the first line that says something
        (``_says``), a loss sends the request again: data chunks that say
        nothing (a role alone) are kept back meanwhile, and dropped then."""
        started, kept = False, []
        while True:
            failure: Optional[Exception] = None
            loss_event: Optional[str] = None  # the rank server's error event of a lost rank
            ended = False  # the answer's end as the rank server writes it ([DONE], or an error event)
            try:
                async for line in self._response.aiter_lines():
                    ended = ended or _ends(line)
                    if started:
                        yield line
                        continue
                    says = self._says(line)
                    if says is None:
                        loss_event = line
                        break
                    if says:
                        started = True
                        for earlier in kept:
                            yield earlier
                        kept.clear()
                        yield line
                    elif kept or line.startswith("data:"):
                        kept.append(line)
                    else:  # a comment (keep-alive) or a blank line before any chunk
                        yield line
                else:
                    if ended:
                        for earlier in kept:
                            yield earlier
                        return
                    # closed without its end: the rank server's process ended mid-answer (a rank
                    # killed on another host can end the job before the launcher reports it)
                    failure = httpx.RemoteProtocolError("the answer stopped before its end")
                    if started:
                        raise self._upstream._unavailable(failure)
            except (httpx.TransportError, httpx.StreamError) as e:
                if started:
                    raise self._upstream._unavailable(e) from None
                failure = e
            base = await self._next_job()
            if base is None:
                if loss_event is None:
                    raise self._upstream._unavailable(failure) from None
                for earlier in kept:  # the error event ends the answer, as without the hold
                    yield earlier
                yield loss_event
                return
            kept.clear()
            await self.open(base.rstrip("/") + self._path)
            if self._response.status_code != 200:
                body = await self.aread()
                raise Unavailable(f"the job started on the ranks left answered {self._response.status_code}: "
                                  f"{_message(body)}", self._upstream.retry_after)

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except (httpx.TransportError, httpx.StreamError) as e:
            raise self._upstream._unavailable(e) from None

    async def aread(self) -> bytes:
        try:
            return await self._response.aread()
        except (httpx.TransportError, httpx.StreamError) as e:
            raise self._upstream._unavailable(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._response, name)


def _ends(line: str) -> bool:
    """Whether an SSE line of the rank server's ends its answer: ``[DONE]``,
    or an error event (after which it writes nothing more)."""
    if not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    if '"error"' not in data:
        return False
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    return isinstance(chunk, dict) and chunk.get("error") is not None


def _says(line: str) -> Optional[bool]:
    """Whether an SSE line of the rank server's says something to the client:
    a data line does, unless it is a chunk whose every choice is empty (no
    text, no content but a role, no finish) and has no usage; None for an
    error event of a lost rank (code 503); a comment or a blank line does not."""
    if not line.startswith("data:"):
        return False
    try:
        chunk = json.loads(line[5:])
    except ValueError:
        return True
    if not isinstance(chunk, dict):
        return True
    error = chunk.get("error")
    if error is not None:
        return None if isinstance(error, dict) and error.get("code") == 503 else True
    choices = chunk.get("choices")
    if chunk.get("usage") is not None or not isinstance(choices, list) or not choices:
        return True
    return not all(_empty_choice(c) for c in choices)


def _said_nothing(line: str) -> Optional[bool]:
    """``_says`` for an answer the client gets whole at its end: no line says
    anything before it, but a lost rank's error event is still one (None)."""
    return None if _says(line) is None else False


def _empty_choice(choice: Any) -> bool:
    if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
        return False
    if choice.get("text") not in (None, "") or choice.get("logprobs") is not None:
        return False
    delta = choice.get("delta", {})
    return isinstance(delta, dict) and all(k == "role" or v in (None, "", []) for k, v in delta.items())


def _message(content: bytes) -> str:
    try:
        error = json.loads(content).get("error")
        return str(error.get("message") if isinstance(error, dict) else error)[:300]
    except (ValueError, AttributeError):
        return content[:300].decode("utf-8", "replace")


def _content(body: Body) -> Dict[str, Any]:
    if isinstance(body, (bytes, bytearray)):
        return {"content": bytes(body)}
    return {"json": body}


def _forwarded(headers: Optional[Mapping[str, str]]) -> Dict[str, str]:
    if not headers:
        return {}
    return {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}


def _not_serving(state: str) -> str:
    return {
        "starting": "the model is loading",
        "recovering": "the server lost a rank and is starting again on the survivors",
    }.get(state, "the rank job is not serving")
