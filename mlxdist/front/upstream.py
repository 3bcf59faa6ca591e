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
"""

import contextlib
from typing import Any, AsyncIterator, Dict, Mapping, Optional, Union

import httpx

from mlxdist.front.errors import DEFAULT_RETRY_AFTER, Unavailable

# What the front passes on to the rank server: the rest (Host, Authorization,
# hop-by-hop headers) is the front's own business.
FORWARDED_HEADERS = ("content-type", "accept", "user-agent")
_CONNECT_TIMEOUT = 5.0
Body = Union[Dict[str, Any], bytes]  # a JSON object, or its bytes as the client sent them


class Upstream:
    """An ``httpx.AsyncClient`` to the job's rank server. ``job`` has
    ``base_url`` (``"http://127.0.0.1:PORT"`` or None while not serving) and
    ``state``, and may have ``api_key`` (the token the rank server was
    started with, sent as ``Authorization: Bearer``); ``read_timeout`` bounds the wait for the rank server's next
    bytes (None: unbounded; a step of a long prefill may take long)."""

    def __init__(self, job: Any, read_timeout: Optional[float] = None, retry_after: int = DEFAULT_RETRY_AFTER):
        self.job = job
        self.retry_after = retry_after
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
        (a dict, or bytes sent as they are) (its status, headers and body, read whole)."""
        url = self._url(path)
        try:
            return await self.client.post(url, headers=self._headers(headers), **_content(body))
        except httpx.TransportError as e:
            raise self._unavailable(e) from None

    @contextlib.asynccontextmanager
    async def stream(self, path: str, body: Body, headers: Optional[Mapping[str, str]] = None
                     ) -> AsyncIterator[httpx.Response]:
        """The rank server's answer to ``POST path``, its body not read yet:
        ``aiter_lines()`` gives the SSE lines. Raises ``Unavailable`` on
        entry (not serving, no connection) and from the iteration (the
        connection dropped mid-answer)."""
        url = self._url(path)
        request = self.client.build_request("POST", url, headers=self._headers(headers), **_content(body))
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as e:
            raise self._unavailable(e) from None
        try:
            yield _Guarded(response, self)
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()


class _Guarded:
    """An ``httpx.Response`` whose iteration raises ``Unavailable`` when the
    connection drops mid-answer (other attributes are the response's)."""

    def __init__(self, response: httpx.Response, upstream: Upstream):
        self._response = response
        self._upstream = upstream

    async def aiter_lines(self) -> AsyncIterator[str]:
        try:
            async for line in self._response.aiter_lines():
                yield line
        except (httpx.TransportError, httpx.StreamError) as e:
            raise self._upstream._unavailable(e) from None

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
