"""Generation tok/s projected over a link between machines, from what each
mode puts on the wire per decode step (``decide/traffic.py``).

A projection adds, per layer, hops x latency + bytes / bandwidth to the step
time measured on one machine (where the ranks' exchange is loopback, small
against these links): a model, not a measurement.
"""

from dataclasses import dataclass
from typing import Dict, Optional

from mlxdist.decide.traffic import WIDTH_MODES, Shape, collectives, traffic  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class Link:
    latency: float  # seconds per hop
    bandwidth: float  # bytes per second, one direction
    source: str


LINKS: Dict[str, Link] = {
    "10 GbE (TCP)": Link(
        100e-6, 1.1e9,
        "10 Gb/s line rate (IEEE 802.3ae) less framing; 100 µs per hop assumed for MPI/ring over "
        "TCP between Macs (tuned Linux TCP reaches 25-50 µs; Apple's TN3205 puts TCP over "
        "Thunderbolt near 300 µs)"),
    "Thunderbolt (TCP)": Link(
        300e-6, 2.0e9,
        "MPI or MLX's ring over the Thunderbolt Bridge (IP): ~300 µs per hop (Apple's TN3205 puts TCP "
        "over Thunderbolt near 300 µs; users report 0.3-0.7 ms round trips over Thunderbolt 5), "
        "2.0 GB/s (16.4 Gb/s iperf3 TCP between a Mac and a PC over a 20 Gb/s USB4 link, "
        "jiribrejcha.net; a Thunderbolt 5 bridge is not measured here)"),
    "Thunderbolt 5 (RDMA)": Link(
        8e-6, 7.4e9,
        "macOS 26.2 RDMA over Thunderbolt 5 (MLX's JACCL backend): 5-9 µs latency reported by "
        "users, 7.4 GB/s measured between nodes (zingnex.cn, 2026-04-07)"),
}


def projected_tps(mode: str, n: int, b: int, shape: Shape, step_seconds: float, link: Link) -> Optional[float]:
    """Generation tok/s with the exchange over ``link`` instead of loopback."""
    if not step_seconds:
        return None
    ops, layers = collectives(mode, n, b, shape)
    wire = layers * sum(hops * link.latency + size / link.bandwidth for size, hops in ops)
    return b / (step_seconds + wire)
