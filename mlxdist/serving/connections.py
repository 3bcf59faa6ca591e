"""Rank 0's connections: what one may cost before its request is complete.

Every connection reads its request through a ``RequestReader``: the whole
request (request line, headers and body) must arrive within
``request_timeout`` seconds of the connection's start, whatever the pace
(a client sending one byte a second is cut off as surely as one that sends
nothing), and the request line with its headers is bounded in bytes and in
header lines before anything else (the API key included) is looked at.

``HTTPServer`` holds at most ``max_connections`` connections. At the cap, a
new connection takes the place of the one that has been sending its
request the longest (a slow or half-open client), so a client with a
complete request is still served; only when every held connection is
being answered is the new one closed unanswered.

    connection states:  reading (its request is still arriving) -> answering
"""

import io
import logging
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Dict, Optional, Tuple

from mlxdist.errors import HeadersTooLarge, RequestTimeout, keep_traceback, one_line

DEFAULT_REQUEST_TIMEOUT = 30.0  # seconds for a whole request: request line, headers and body
DEFAULT_MAX_HEADER_BYTES = 32 << 10  # the request line and every header line together
DEFAULT_MAX_HEADERS = 64
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_BODY = 4 << 20  # bytes
DEFAULT_IDLE_TIMEOUT = 30.0  # seconds a connection may send nothing
DEFAULT_MAX_QUEUED = 256  # requests waiting for the generation loop
DEFAULT_MAX_QUEUED_CHARS = 8 << 20  # their prompt text, together


class Connection:
    """One accepted socket, as the server sees it (changed under the server's lock)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.started = time.monotonic()
        self.received = 0  # bytes of the request so far
        self.answering = False
        self.shed = False


class _DeadlineSocket(io.RawIOBase):
    """A socket's reading side that raises ``RequestTimeout`` past the
    request's deadline and ``TimeoutError`` after ``idle`` seconds without a
    byte; counts the bytes it gives."""

    def __init__(self, connection: Connection, deadline: float, idle: float):
        self.connection = connection
        self.deadline = deadline
        self.idle = idle

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestTimeout("the request did not arrive in time")
        sock = self.connection.sock
        sock.settimeout(min(self.idle, left))
        try:
            n = sock.recv_into(buffer)
        except socket.timeout:
            if time.monotonic() >= self.deadline:
                raise RequestTimeout("the request did not arrive in time") from None
            raise
        self.connection.received += n
        return n


class RequestReader:
    """The handler's ``rfile``: buffered reads under the request's deadline,
    with the request line and headers (read by ``readline`` until
    ``end_of_headers``) bounded in bytes and in lines."""

    def __init__(self, connection: Connection, deadline: float, idle: float, max_header_bytes: int,
                 max_headers: int):
        self._raw = _DeadlineSocket(connection, deadline, idle)
        self._buffered = io.BufferedReader(self._raw, 8192)
        self._header_bytes_left = max_header_bytes
        self._header_lines_left = max_headers + 1  # the request line too
        self.max_header_bytes, self.max_headers = max_header_bytes, max_headers
        self.in_headers = True

    def readline(self, limit: int = -1) -> bytes:
        if not self.in_headers:
            return self._buffered.readline(limit)
        if self._header_lines_left <= 0:
            raise HeadersTooLarge(f"more than {self.max_headers} header lines")
        room = self._header_bytes_left + 1
        line = self._buffered.readline(room if limit < 0 else min(limit, room))
        self._header_bytes_left -= len(line)
        if self._header_bytes_left < 0:
            raise HeadersTooLarge(f"the request line and headers exceed {self.max_header_bytes} bytes")
        if line not in (b"\r\n", b"\n"):
            self._header_lines_left -= 1
        return line

    def end_of_headers(self) -> None:
        self.in_headers = False

    def read(self, n: int = -1) -> bytes:
        return self._buffered.read(n)

    def close(self) -> None:
        self._buffered.close()


class HTTPServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` of them; at
    the cap a new connection sheds the longest-reading one (see above)."""

    request_queue_size = 1024  # the listen backlog: the default 5 resets bursts of clients
    daemon_threads = True

    def __init__(self, address, handler, max_connections: int = DEFAULT_MAX_CONNECTIONS):
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._held: Dict[socket.socket, Connection] = {}
        self._lock = threading.Lock()
        self.shed = 0  # connections closed to make room (for tests and logs)

    def connection(self, sock: socket.socket) -> Connection:
        return self._held[sock]

    def answering(self, connection: Connection) -> bool:
        """Mark ``connection``'s request complete; False if it was shed meanwhile."""
        with self._lock:
            if connection.shed:
                return False
            connection.answering = True
            return True

    def process_request(self, request, client_address):
        with self._lock:
            full, victim = self._make_room()
            if full:
                self.shutdown_request(request)
                return
            self._held[request] = Connection(request)
        if victim is not None:
            _shed(victim)
        super().process_request(request, client_address)

    def _make_room(self) -> Tuple[bool, Optional[Connection]]:
        """Under the lock: whether the server is full (every held connection
        answering), and the connection to shed to make room (the one that
        has been reading its request the longest), if any is needed."""
        live = [c for c in self._held.values() if not c.shed]
        if len(live) < self.max_connections:
            return False, None
        reading = [c for c in live if not c.answering]
        if not reading:
            return True, None
        victim = min(reading, key=lambda c: c.started)
        victim.shed = True
        self.shed += 1
        return False, victim

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._held.pop(request, None)

    def handle_error(self, request, client_address):
        """A client that left costs one line (at INFO); anything else one line
        at ERROR, its traceback kept in the rank's log file."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            logging.info("%s: the client left (%s)", client_address[0], one_line(error))
            return
        path = keep_traceback(0)
        logging.error("%s: a request failed: %s%s", client_address[0], one_line(error),
                      f" (traceback in {path})" if path else "")


_SHED_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Content-Length: %d\r\n\r\n%s")


def _shed(connection: Connection) -> None:
    """Close a connection that has not finished sending its request; one
    that sent part of one is told why (503), without waiting on it."""
    if connection.received:
        body = (b'{"error": {"message": "the server is at its connection cap and closed a request that had not '
                b'arrived whole", "type": "server_error", "param": null, "code": 503}}')
        try:
            connection.sock.send(_SHED_REPLY % (len(body), body), socket.MSG_DONTWAIT)
        except OSError:
            pass
    try:
        connection.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
