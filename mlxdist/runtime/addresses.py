"""Which address a rank is reached at by a given peer, across hosts.

A host name's address is no answer: Debian and Ubuntu map the host's own
name to 127.0.1.1, and Macs cabled point to point over Thunderbolt have one
address per cable. So each rank lists its interfaces' IPv4 addresses (with
their prefix lengths) and the peers choose from that list:

- the same host (equal names and address lists): loopback;
- else a named interface (``MLXDIST_RING_INTERFACE``): its address;
- else the address of mine on a network one of the peer's addresses is on
  (a cable, a bridge, a LAN);
- else the source address the kernel picks on its route to the peer.

A loopback address is never given to a peer on another host: where no
route is found the start is refused in one line naming both hosts.
"""

import ipaddress
import json
import socket
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

Interfaces = List[Tuple[str, str, int]]  # (interface, IPv4 address, prefix length)


def interfaces() -> Interfaces:
    """This host's IPv4 addresses on interfaces that are up, loopback left out."""
    found = _linux_interfaces() if sys.platform.startswith("linux") else _bsd_interfaces()
    return [(name, addr, prefix) for name, addr, prefix in found if not ipaddress.ip_address(addr).is_loopback]


def _linux_interfaces() -> Interfaces:
    try:
        out = subprocess.run(["ip", "-j", "-4", "addr", "show", "up"], capture_output=True, text=True, timeout=10)
        entries = json.loads(out.stdout or "[]")
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return _ioctl_interfaces()
    return [(e["ifname"], a["local"], int(a["prefixlen"])) for e in entries for a in e.get("addr_info", [])
            if a.get("family") == "inet"]


def _ioctl_interfaces() -> Interfaces:
    """Without iproute2: each interface's one address and netmask by ioctl."""
    import fcntl
    import struct

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            packed = struct.pack("256s", name[:15].encode())
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, packed)[20:24])  # SIOCGIFADDR
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891B, packed)[20:24])  # SIOCGIFNETMASK
            except OSError:
                continue
            found.append((name, addr, ipaddress.ip_network(f"0.0.0.0/{mask}").prefixlen))
    return found


def _bsd_interfaces() -> Interfaces:
    """macOS: ``ifconfig``'s ``inet A netmask 0xffffff00`` lines."""
    try:
        text = subprocess.run(["ifconfig"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    found, name = [], None
    for line in text.splitlines():
        if line and not line[0].isspace():
            name = line.split(":", 1)[0]
        words = line.split()
        if len(words) >= 4 and words[0] == "inet" and words[2] == "netmask":
            found.append((name, words[1], bin(int(words[3], 16)).count("1")))
    return found


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (e.g. ``bridge0``, the
    Thunderbolt bridge on macOS, or ``en5``)."""
    found = _linux_interfaces() if sys.platform.startswith("linux") else _bsd_interfaces()
    for iface, addr, _ in found:
        if iface == name:
            return addr
    raise RuntimeError(f"MLXDIST_RING_INTERFACE={name}: no IPv4 address on that interface here")


def describe_host() -> Dict[str, Any]:
    """What the peers need to choose this host's address toward them (JSON)."""
    return {"name": socket.gethostname(), "addresses": [[addr, prefix] for _, addr, prefix in interfaces()]}


def same_host(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Whether two ``describe_host`` answers come from one host."""
    return a["name"] == b["name"] and sorted(map(tuple, a["addresses"])) == sorted(map(tuple, b["addresses"]))


def route_source(peer: str) -> Optional[str]:
    """The address this host sends from on its route to ``peer`` (None: no route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))  # UDP: picks the route, sends nothing
            return s.getsockname()[0]
        except OSError:
            return None


def address_toward(mine: Dict[str, Any], peer: Dict[str, Any], interface: Optional[str] = None) -> str:
    """The address of mine (``describe_host``) that ``peer`` reaches me at."""
    if same_host(mine, peer):
        return "127.0.0.1"
    if interface:
        return interface_address(interface)
    for addr, prefix in mine["addresses"]:
        network = ipaddress.ip_network(f"{addr}/{prefix}", strict=False)
        if any(ipaddress.ip_address(theirs) in network for theirs, _ in peer["addresses"]):
            return addr
    for theirs, _ in peer["addresses"]:
        source = route_source(theirs)
        if source and not ipaddress.ip_address(source).is_loopback:
            return source
    raise RuntimeError(f"no route from host {mine['name']} to host {peer['name']} "
                       f"(its addresses: {', '.join(a for a, _ in peer['addresses']) or 'none'}): "
                       f"name the interface between them with MLXDIST_RING_INTERFACE")
