"""Bytes on the link: the operating system's counters of the network
interface a rank reaches rank 0 through (psutil, on Linux and macOS), since
the job started.

They count everything that interface carries, not only this job's
exchange: on one host the ranks share the loopback interface, and its
counters hold every local connection's bytes; across Macs the Thunderbolt
bridge or Ethernet port the ranks use is usually theirs alone. Each rank
sends its own on its heartbeat connection (``heartbeat.py``), and rank 0's
server reports every rank's in ``/health`` (``link_bytes``) for the front's
``/metrics``.
"""

import ipaddress
from dataclasses import dataclass
from typing import Optional, Tuple

import psutil


def interface_of(address: str) -> Optional[str]:
    """The name of the interface that holds ``address`` (None: none here,
    or ``address`` is no IP address)."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            try:
                if ipaddress.ip_address(entry.address.split("%", 1)[0]) == wanted:
                    return name
            except ValueError:
                continue
    return None


def _read(interface: str) -> Optional[Tuple[int, int]]:
    counters = psutil.net_io_counters(pernic=True).get(interface)
    return None if counters is None else (counters.bytes_sent, counters.bytes_recv)


@dataclass
class LinkCounter:
    """One interface's bytes sent and received since this object was made."""

    interface: str
    start: Tuple[int, int]

    @classmethod
    def of(cls, address: str) -> Optional["LinkCounter"]:
        """The counter of the interface holding ``address`` (None: not found)."""
        interface = interface_of(address)
        start = _read(interface) if interface else None
        return cls(interface, start) if start is not None else None

    def read(self) -> Tuple[int, int]:
        """(sent, received) bytes since the start; a counter that went back
        (the interface reset) counts from zero again."""
        now = _read(self.interface) or self.start
        if now[0] < self.start[0] or now[1] < self.start[1]:
            self.start = (0, 0)
        return now[0] - self.start[0], now[1] - self.start[1]
