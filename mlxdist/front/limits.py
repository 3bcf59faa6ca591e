"""What one client may cost the front, at the connection: uvicorn's HTTP
protocol (h11) with deadlines, and the checks made before any route runs.

- ``write_timeout``: an answer whose client does not read it (the
  connection's send buffer full, writes paused) for that many seconds in a
  row is cut (the connection aborted), so a slow reader cannot hold a place;
- ``request_timeout``: a connection has that long to send its whole request,
  headers and body; past it the front answers 408 (nothing, where the client
  sent nothing) and closes;
- ``max_header_bytes``, ``max_headers``: a request line and headers past
  either are answered 431, read no further;
- ``max_connections``: past it, a complete request takes the place of the
  connection that has been sending its request the longest (answered 503);
  where every connection is being answered, the new request is answered 503
  with ``Retry-After``;
- ``Host`` must name the front (``allowed_hosts``; 421 otherwise), so a web
  page cannot reach it through DNS rebinding.

    protocol = front_protocol(settings)   # uvicorn.Config(http=protocol)
    app = Guard(app, settings)            # the outermost ASGI layer
"""

import json
import logging
import socket
from typing import Any, Callable, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxdist.front.errors import refusal
from mlxdist.front.settings import host_name

# Bytes an answer may hold in the front's buffer before its writes pause for
# the reader (uvicorn's default); the socket's own buffer is kept as small.
WRITE_BUFFER = 64 << 10
SEND_BUFFER = 64 << 10
_FLOOD = 4  # connections past max_connections x this are closed at once, unread
# h11's states of a client whose request has arrived whole: DONE, or MUST_CLOSE where it
# sent "Connection: close" (as urllib does), CLOSED once it shut its side after that.
_WHOLE = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)
_ANSWERED = (h11.SEND_BODY, h11.DONE, h11.MUST_CLOSE, h11.CLOSED)  # the answer's head is sent

log = logging.getLogger("mlxdist.front")


def front_protocol(settings: Any) -> type:
    """uvicorn's h11 protocol class for the front's ``settings``."""
    return type("FrontProtocol", (FrontProtocol,), {"settings": settings})


class FrontProtocol(H11Protocol):
    """uvicorn's h11 protocol with the write and request deadlines and the
    connection cap's shedding (``settings``: ``FrontSettings``)."""

    settings: Any

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        app = self.app

        async def with_connection(scope, receive, send):
            scope["mlxdist.connection"] = self
            await app(scope, receive, send)

        self.app = with_connection
        self.opened_at = 0.0
        self.received = False
        self.answering = False
        self._write_deadline: Optional[Any] = None
        self._head: Optional[bytearray] = bytearray()  # the request line and headers so far (None: whole)
        self._request_deadline: Optional[Any] = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.opened_at = self.loop.time()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            except OSError:
                pass
        transport.set_write_buffer_limits(high=WRITE_BUFFER)
        if len(self.connections) > self.settings.max_connections * _FLOOD:
            transport.abort()
            return
        self._arm_request_deadline()

    def data_received(self, data: bytes) -> None:
        self.received = self.received or bool(data)
        if self._head is not None and self.conn.their_state is h11.IDLE:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            head = self._head if end < 0 else self._head[:end]
            settings = self.settings
            if len(head) > settings.max_header_bytes or head.count(b"\n") > settings.max_headers:
                self.refuse(431, f"request headers too large: more than {settings.max_header_bytes} bytes or "
                                 f"{settings.max_headers} lines")
                return
            if end >= 0:
                self._head = None  # whole: the next request's head is counted after this answer
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are no HTTP request, in OpenAI's shape."""
        self.refuse(400, "not an HTTP/1.1 request this server reads")

    def connection_lost(self, exc) -> None:
        for timer in (self._write_deadline, self._request_deadline):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self.answering, self.received, self._head = False, False, bytearray()
        super().on_response_complete()
        self._arm_request_deadline()  # a kept-alive connection's next request has its own

    def _arm_request_deadline(self) -> None:
        if self._request_deadline is not None:
            self._request_deadline.cancel()
        self._request_deadline = self.loop.call_later(self.settings.request_timeout, self._request_late)

    def _request_late(self) -> None:
        self._request_deadline = None
        if self.transport.is_closing() or self.conn.their_state in _WHOLE or self.conn.our_state in _ANSWERED:
            return
        if self.received:
            self.refuse(408, f"the request did not arrive whole within {self.settings.request_timeout:g} s")
        else:
            self.transport.close()

    def refuse(self, status: int, message: str, headers: tuple = ()) -> None:
        """Answer ``status`` with an OpenAI-shaped body before any route ran, and close."""
        if self.transport.is_closing():
            return
        body = json.dumps(refusal(message, status)).encode()
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", "Connection: close", *headers]
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.settings.write_timeout, self._cut)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _cut(self) -> None:
        self._write_deadline = None
        log.info("%s: cut: the client read nothing of its answer for %g s", self.client,
                 self.settings.write_timeout)
        self.transport.abort()


def shed_for(connection: FrontProtocol) -> bool:
    """Room for ``connection``'s complete request at the cap: True where
    there is room or was made (the connection sending its request the
    longest answered 503 and closed), False where every other connection
    is being answered."""
    connection.answering = True
    others = [c for c in connection.connections if c is not connection and not c.transport.is_closing()]
    if len(others) < connection.settings.max_connections:
        return True
    reading = [c for c in others if not getattr(c, "answering", True)]
    if not reading:
        return False
    oldest = min(reading, key=lambda c: c.opened_at)
    if oldest.received:
        oldest.refuse(503, "the server is at its connection limit and another client's request was whole first")
    else:
        oldest.transport.close()
    return True


class Guard:
    """The outermost ASGI layer: ``Host`` checked against ``allowed_hosts``
    (421), and the connection cap (``shed_for``; 503 with ``Retry-After``)."""

    def __init__(self, app: Callable, settings: Any):
        self.app = app
        self.settings = settings
        self.any_host = "*" in settings.allowed_hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = _header(scope, b"host")
        if host is not None and not self.any_host and host_name(host) not in self.settings.allowed_hosts:
            await _send_refusal(send, 421, f"this server does not answer for host {host[:100]!r} "
                                           f"(--allowed-hosts)")
            return
        connection = scope.get("mlxdist.connection")
        if connection is not None and not shed_for(connection):
            await _send_refusal(send, 503, f"the server is answering {self.settings.max_connections} connections, "
                                           f"its limit (--max-connections): try again shortly",
                                [(b"retry-after", str(self.settings.retry_after).encode())])
            return
        await self.app(scope, receive, send)


def _header(scope, name: bytes) -> Optional[str]:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def _send_refusal(send, status: int, message: str, headers=()) -> None:
    body = json.dumps(refusal(message, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


_REASONS = {408: "Request Timeout", 503: "Service Unavailable", 431: "Request Header Fields Too Large"}
