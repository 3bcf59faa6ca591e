"""A lost rank noticed in seconds: heartbeats on connections of their own.

A rank that stops answering (a Mac asleep, a cable pulled, a process
stopped) stops no collective by itself: the others wait in MPI, and the
watchdog (``watchdog.py``) sees no progress only after ``--timeout`` (10 x
that while serving). So each rank other than 0 holds one TCP connection to
rank 0, apart from MPI and MLX, and a daemon thread at each end sends one
byte on it every ``interval`` (a fifth of ``--heartbeat``, at most 1 s):

- rank 0 listens on a port the system picks, on the address each rank
  reaches it at (``addresses.address_toward``, as the ring backend chooses
  it: loopback on one host), and tells the ranks the port and a token over
  the control plane; each rank connects and sends ``<token> <rank>``;
- a rank silent for ``--heartbeat`` seconds is lost: rank 0 tells the ranks
  left (``!<line>``) and each of them and rank 0 prints the one line
  ``rank R (host H) sent no heartbeat for S s: lost`` and exits with status
  1 (rank 0 after the ``watchdog.ON_FATAL`` callbacks: the server answers
  its requests). A rank that loses rank 0 says the same of rank 0 and exits.

The thread needs no MPI progress and no main thread: a rank busy in a long
prefill or load still beats (MLX and mpi4py release the GIL while they
wait), while a stopped process's thread stops with it. A peer whose
connection closes (its process ended) goes silent; mpirun usually ends the
job first. Once a rank is exiting (``ACTIVITY.phase``), nothing is judged;
a rank whose own thread was held up (stopped, then continued) hears its
peers afresh before it judges them, and says nothing when the launcher
then stops it (``watchdog.HELD_UP``).
In a fault-tolerant job (``--survive``, ``survival.py``) rank 0 leaves a lost
rank other than 0 to Open MPI's failure detector and goes on.

Under the Python API (``rank0_thread.py``) rank 0 hands the line to the
``ON_LOST`` callbacks instead of exiting: its caller raises ``RankLost``.
It tells the ranks left with ``HOLD``: each says the line and waits, beating,
until rank 0's process ends (its connection closes), then exits with status
1, so that the launcher does not stop rank 0 while its script handles the error.

A rank's beat carries its link's byte counters (``link_bytes.py``):
``L <sent> <received> <interface>\n`` where the interface toward rank 0 is
known, else ``.``. Rank 0 keeps each rank's latest (``link_bytes()``, which
the rank server's ``/health`` reports).
"""

import argparse
import math
import os
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from mlxdist import envs
from mlxdist.inputs.digits import parse_seconds_or_off
from mlxdist.errors import UserError, say_error
from mlxdist.runtime.addresses import address_toward, describe_host
from mlxdist.runtime.link_bytes import LinkCounter
from mlxdist.runtime.watchdog import ACTIVITY, HELD_UP, run_on_fatal
from mlxdist.runtime.world import World
from mlxdist.runtime.exits import leave_mpi_unfinalized, set_exit_code, tell_the_launch

DEFAULT_HEARTBEAT = 5.0  # MLXDIST_HEARTBEAT's default
FROM_ENVIRONMENT = "default"  # init's and the command lines' default: MLXDIST_HEARTBEAT, else DEFAULT_HEARTBEAT
MIN_HEARTBEAT = 1.0  # below this a busy host's scheduler alone could look like a loss
# Rank 0's takers of a loss line: while there is one, the process goes on after a
# loss (the API's Rank0Thread raises RankLost in its caller).
ON_LOST: List[Callable[[str], None]] = []
BEATS_PER_PERIOD = 5
MAX_INTERVAL = 1.0
BEAT = b"."
MAX_REPORT = 96  # bytes of a link report line kept while it is incomplete
NOTICE = b"!"  # rank 0 to the ranks left: the loss line follows, up to a newline
HOLD = b"?"  # the same, but rank 0 goes on (its API caller raises RankLost): wait until it ends
CONNECT_SECONDS = 30.0
OTHERS_EXIT_AFTER = 3.0  # a start-up failure is said by rank 0; the others give it that long


def default_heartbeat() -> Optional[float]:
    """The heartbeat where none is given: ``MLXDIST_HEARTBEAT`` (None: off),
    else ``DEFAULT_HEARTBEAT``; ``BadVariable`` where it does not read."""
    return envs.get("MLXDIST_HEARTBEAT")


def parse_heartbeat(text: str, field: str = "--heartbeat") -> Optional[float]:
    """``text`` as heartbeat seconds: ``off`` (or ``0``) is None, else a
    finite ASCII number of at least ``MIN_HEARTBEAT``; ValueError otherwise."""
    return parse_seconds_or_off(text, field, MIN_HEARTBEAT)


def arg_heartbeat(text: str) -> Union[None, float, str]:
    """An argparse type: ``parse_heartbeat``, but ``FROM_ENVIRONMENT`` (the
    options' default) kept for ``check_heartbeat``."""
    if text == FROM_ENVIRONMENT:
        return text
    try:
        return parse_heartbeat(text, "the value")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_heartbeat(value: Union[None, int, float, str]) -> Optional[float]:
    """``init(heartbeat=)``: seconds (a number or its text), None / ``"off"`` /
    0 for none, or ``FROM_ENVIRONMENT`` for ``default_heartbeat()``;
    ``UserError`` with one line otherwise."""
    if value == FROM_ENVIRONMENT:
        return default_heartbeat()
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value == 0:
            return None
        if math.isfinite(value) and value >= MIN_HEARTBEAT:
            return float(value)
        value = repr(value)
    if not isinstance(value, str):
        raise UserError(f"heartbeat must be a number of seconds or None, not {type(value).__name__}")
    try:
        return parse_heartbeat(value, "heartbeat")
    except ValueError as e:
        raise UserError(str(e)) from None


@dataclass
class Peer:
    """The other end of one heartbeat connection."""

    rank: int
    host: str
    sock: socket.socket
    heard: float  # monotonic time of its latest byte
    notice: Optional[bytearray] = None  # a loss line from rank 0, being received
    hold: bool = False  # the notice is HOLD's: rank 0 goes on
    link: Optional[Tuple[int, int, str]] = None  # its latest (sent, received, interface), on rank 0
    partial: bytes = b""  # a report line being received, on rank 0


class Heartbeat:
    """This rank's beating and listening thread (``start_heartbeat`` makes it)."""

    def __init__(self, world: World, seconds: float, peers: List[Peer], host: str = "",
                 links: Sequence[LinkCounter] = ()):
        self.world = world
        self.seconds = seconds
        self.interval = min(seconds / BEATS_PER_PERIOD, MAX_INTERVAL)
        self.peers = peers
        self.host = host  # this rank's host name
        self.links = list(links)  # this rank's interfaces toward its peers (a rank's: the one toward rank 0)
        self.last_pass = time.monotonic()  # when the thread last looked
        self.held_up_at = -math.inf  # when it last found itself held up
        self.holding = False  # told HOLD by rank 0: end when rank 0's process does

    def start(self) -> None:
        HELD_UP.append(self.held_up)
        threading.Thread(target=self._run, name="mlxdist-heartbeat", daemon=True).start()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        for peer in self.peers:
            peer.sock.setblocking(False)
            selector.register(peer.sock, selectors.EVENT_READ, peer)
        next_beat = 0.0
        while True:
            if time.monotonic() >= next_beat:
                beat = self._beat()
                for peer in self.peers:
                    _send(peer.sock, beat)
                next_beat = time.monotonic() + self.interval
            # Read before judging: beats that waited while this thread did not run are news.
            for key, _ in selector.select(timeout=max(0.0, next_beat - time.monotonic())):
                self._read(selector, key.data)
            now = time.monotonic()
            if now - self.last_pass > self.seconds / 2:  # this process was stopped or starved: not the peers' silence
                self.held_up_at = now
                for peer in self.peers:
                    peer.heard = max(peer.heard, now)
            self.last_pass = now
            if ACTIVITY.phase == "exiting":
                continue
            for peer in list(self.peers):
                if now - peer.heard > self.seconds:
                    self._lost(selector, peer)

    def _beat(self) -> bytes:
        """One beat: a rank's link counters where it has them, else ``BEAT``."""
        if self.world.is_root or not self.links:
            return BEAT
        sent, received = self.links[0].read()
        return f"L {sent} {received} {self.links[0].interface}\n".encode()

    def link_bytes(self) -> List[Dict[str, Union[int, str]]]:
        """Rank 0: the bytes on each rank's link since the job started, as
        the ranks' latest beats said (rank 0's own read now): one entry per
        rank and interface, ``rank``, ``host``, ``interface``, ``sent``, ``received``."""
        rows: List[Dict[str, Union[int, str]]] = []
        for link in self.links:
            sent, received = link.read()
            rows.append({"rank": self.world.rank, "host": self.host, "interface": link.interface,
                         "sent": sent, "received": received})
        for peer in list(self.peers):
            if peer.link is not None:
                sent, received, interface = peer.link
                rows.append({"rank": peer.rank, "host": peer.host, "interface": interface,
                             "sent": sent, "received": received})
        return rows

    def held_up(self) -> bool:
        """Whether this process was held up (stopped, starved) for half the
        heartbeat or more, now or within the last heartbeat."""
        now = time.monotonic()
        return now - self.last_pass > self.seconds / 2 or now - self.held_up_at < self.seconds

    def _read(self, selector: selectors.BaseSelector, peer: Peer) -> None:
        try:
            data = peer.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # its process closed the connection: silence from now on
            selector.unregister(peer.sock)
            if self.holding:  # rank 0's script is done with the loss
                set_exit_code(1)
                os._exit(1)
            return
        peer.heard = time.monotonic()
        if self.world.is_root:
            _take_report(peer, data)
            return
        if peer.rank == 0 and peer.notice is None:
            at = min((data.find(mark) for mark in (NOTICE, HOLD) if mark in data), default=-1)
            if at >= 0:
                peer.hold = data[at:at + 1] == HOLD
                peer.notice, data = bytearray(), data[at + 1:]
        if peer.rank == 0 and peer.notice is not None:
            peer.notice += data
            if b"\n" in peer.notice and ACTIVITY.phase != "exiting":
                line = bytes(peer.notice).split(b"\n", 1)[0].decode(errors="replace")
                if peer.hold:
                    self._hold(line)
                else:
                    self._end(line)

    def _lost(self, selector: selectors.BaseSelector, peer: Peer) -> None:
        line = f"rank {peer.rank} (host {peer.host}) sent no heartbeat for {self.seconds:.1f} s: lost"
        if self.world.is_root and self.world.tolerant:  # survival.py goes on without it
            selector.unregister(peer.sock)
            self.peers.remove(peer)
            return
        goes_on = self.world.is_root and bool(ON_LOST)
        if goes_on:  # first: the caller, once woken, may end the process at once
            ACTIVITY.at("exiting")
            leave_mpi_unfinalized(line)
        if self.world.is_root:
            for other in self.peers:
                if other is not peer:
                    _send(other.sock, (HOLD if goes_on else NOTICE) + line.encode() + b"\n")
        if goes_on:  # the API's caller raises it; keep beating to the ranks left
            selector.unregister(peer.sock)
            self.peers.remove(peer)
            for take in list(ON_LOST):
                take(line)
            return
        self._end(line)

    def _hold(self, line: str) -> None:
        """Rank 0 goes on after a loss: say ``line``, then wait for its end."""
        ACTIVITY.at("exiting")
        say_error(line)
        leave_mpi_unfinalized(line)
        self.holding = True

    def _end(self, line: str) -> None:
        """Say ``line`` and end this process (the launcher then ends the job)."""
        ACTIVITY.phase = "exiting"  # the launcher's stop that follows needs no report of its own
        say_error(line)
        if not run_on_fatal():
            time.sleep(0.5)  # the notices reach the ranks left before the launcher stops them
        tell_the_launch(line)
        set_exit_code(1)
        os._exit(1)


def _take_report(peer: Peer, data: bytes) -> None:
    """Rank 0: the newest whole ``L <sent> <received> <interface>`` line in
    ``peer``'s bytes as its link counters; anything else is only a beat."""
    *lines, rest = (peer.partial + data).split(b"\n")
    peer.partial = rest[-MAX_REPORT:]
    for line in reversed(lines):
        words = line.lstrip(BEAT).split()
        if len(words) == 4 and words[0] == b"L" and words[1].isdigit() and words[2].isdigit() \
                and len(words[1]) < 20 and len(words[2]) < 20 and len(words[3]) <= 32 \
                and words[3].isascii() and words[3].decode().isprintable():
            peer.link = (int(words[1]), int(words[2]), words[3].decode())
            return


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.send(data)
    except OSError:  # a full buffer (a stopped peer) or a closed connection: silence judges it
        pass


def start_heartbeat(world: World, seconds: Optional[float]) -> Optional[Heartbeat]:
    """Connect every rank to rank 0 and start beating (None: one rank, or
    ``seconds`` None). Every rank calls it at once (three control-plane
    exchanges). A connection that cannot be made ends the job at start
    with one line from rank 0."""
    if world.size == 1 or seconds is None:
        return None
    hosts = world.control.allgather_json(describe_host())
    listeners: Dict[str, socket.socket] = {}
    plan = None
    if world.is_root:
        try:
            plan = _listen(hosts, listeners)
        except (OSError, RuntimeError) as e:
            plan = {"error": f"rank 0 cannot listen for heartbeats: {e}"}
    plan = world.control.allgather_json(plan)[0]
    error = plan.get("error")
    sock = None
    if not error and not world.is_root:
        address, port = plan["at"][world.rank]
        try:
            sock = socket.create_connection((address, port), timeout=CONNECT_SECONDS)
            sock.sendall(f"{plan['token']} {world.rank}\n".encode())
        except OSError as e:
            error = f"rank {world.rank} (host {hosts[world.rank]['name']}) cannot reach rank 0's heartbeat at " \
                    f"{address}:{port}: {e}"
    errors = [e for e in world.control.allgather_json(error) if e]
    peers: List[Peer] = []
    if not errors and world.is_root:
        try:
            peers = _accept(listeners, plan["token"], hosts)
        except OSError as e:
            errors = [f"rank 0 heard no heartbeat connection from every rank: {e}"]
    for listener in listeners.values():
        listener.close()
    verdict = world.control.bcast_bytes((errors[0] if errors else "").encode() if world.is_root else None).decode()
    if verdict:
        if world.is_root:
            say_error(verdict)
        else:
            time.sleep(OTHERS_EXIT_AFTER)
        set_exit_code(1)
        raise SystemExit(1)
    if not world.is_root:
        peers = [Peer(0, hosts[0]["name"], sock, time.monotonic())]
        addresses = [sock.getsockname()[0]]
    else:
        addresses = sorted({address for address, _ in plan["at"][1:]})
    links = {}
    for address in addresses:
        link = LinkCounter.of(address)
        if link is not None:
            links.setdefault(link.interface, link)
    heartbeat = Heartbeat(world, seconds, peers, hosts[world.rank]["name"], list(links.values()))
    heartbeat.start()
    global RUNNING
    RUNNING = heartbeat
    return heartbeat


RUNNING: Optional[Heartbeat] = None  # this process's, once started


def _listen(hosts: List[dict], listeners: Dict[str, socket.socket]) -> dict:
    """Rank 0: one listening socket per address a rank reaches it at; the plan the ranks read."""
    at: List[Optional[list]] = [None]
    for host in hosts[1:]:
        address = address_toward(hosts[0], host, envs.get("MLXDIST_RING_INTERFACE"))
        if address not in listeners:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((address, 0))
            listener.listen(len(hosts))
            listeners[address] = listener
        at.append([address, listeners[address].getsockname()[1]])
    return {"token": secrets.token_hex(16), "at": at}


def _accept(listeners: Dict[str, socket.socket], token: str, hosts: List[dict]) -> List[Peer]:
    """Rank 0: every rank's connection, told apart by the hello line (the
    ranks have connected and sent it already: the backlog holds them)."""
    deadline = time.monotonic() + CONNECT_SECONDS
    found: Dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    for listener in listeners.values():
        selector.register(listener, selectors.EVENT_READ)
    while len(found) < len(hosts) - 1:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(1, len(hosts))) - set(found))
            raise OSError(f"none from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
        for key, _ in selector.select(timeout=left):
            conn, _ = key.fileobj.accept()
            rank = _hello(conn, token, min(5.0, max(0.1, deadline - time.monotonic())))
            if rank is None or not 0 < rank < len(hosts) or rank in found:
                conn.close()  # not one of ours
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            found[rank] = conn
    selector.close()
    return [Peer(rank, hosts[rank]["name"], found[rank], time.monotonic()) for rank in sorted(found)]


def _hello(conn: socket.socket, token: str, seconds: float) -> Optional[int]:
    """The rank a new connection's ``<token> <rank>`` line names (None: not that)."""
    conn.settimeout(seconds)
    line = b""
    try:
        while b"\n" not in line and len(line) < 128:
            chunk = conn.recv(128)
            if not chunk:
                return None
            line += chunk
    except OSError:
        return None
    words = line.split(b"\n", 1)[0].decode(errors="replace").split()
    if len(words) != 2 or not secrets.compare_digest(words[0], token):
        return None
    if not (words[1].isascii() and words[1].isdigit()):
        return None
    return int(words[1])
