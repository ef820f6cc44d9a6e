"""A wide-area link between two real nodes on this machine: two "regions".

Each real node runs in a network namespace of its own (``diloco_testbed.node``). ``Wan`` joins the
namespaces of two nodes with a veth pair of their own, the only path between them (this machine does
not forward between the nodes' links to it), and makes it behave like a thin, fragile WAN link:

- ``limit(rate)`` puts a token-bucket filter (tc ``tbf``) on both ends, so each direction carries at
  most ``rate`` (each end shapes what it sends: region b's end its uploads, region a's end what
  region b downloads);
- ``cut()`` takes both ends down, ``restore()`` brings them up again;
- ``counters()`` reads what each end has sent and received, and what its shaper held back.

Addresses: the link of instances ``a`` and ``b`` is 10.236.<a>.<8b>/29, region a's end ``.8b+1``,
region b's ``.8b+2``; ``.8b+3`` (``outsider``) is a second address of region b's end, which nothing
uses as its source unless asked (``connects(source=...)``): another host of region b's network. Each namespace also gets a blackhole route for 10.236.0.0/16, so that while
the link is down nothing meant for the other region leaves by the node's default route. Everything
lives in the two namespaces and goes with them (a node's sweep deletes its namespace); ``close()``
removes it earlier.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any

from diloco_testbed.node import Instance

WAN_NET = "10.236.0.0/16"
BURST = "4kb"  # a few packets: the rate holds even for uploads of a few tens of kB
LATENCY = "100ms"  # what the shaper may queue before it drops


@dataclass(frozen=True)
class WanEnd:
    """One end of the link: in ``netns``, device ``dev`` with ``address``."""

    netns: str
    dev: str
    address: str


@dataclass(frozen=True)
class EndCounters:
    """What one end has sent and received (bytes, from the device), and its shaper's counters."""

    sent_bytes: int
    received_bytes: int
    shaped_bytes: int = 0
    overlimits: int = 0  # packets the shaper held back because the bucket was empty
    drops: int = 0


def _run(*argv: str) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def wan_ends(a: Instance, b: Instance) -> tuple[WanEnd, WanEnd]:
    """The two ends of the link between instances ``a`` and ``b`` (names and addresses)."""
    base = 8 * b.index
    return (
        WanEnd(a.netns, f"dlc-w{a.index}-{b.index}", f"10.236.{a.index}.{base + 1}"),
        WanEnd(b.netns, f"dlc-w{b.index}-{a.index}", f"10.236.{a.index}.{base + 2}"),
    )


class Wan:
    """The link between the namespaces of node instances ``a`` and ``b`` (see the module docstring)."""

    def __init__(self, a: Instance, b: Instance) -> None:
        if a.index == b.index:
            raise ValueError("a link joins two different node instances")
        self.a, self.b = wan_ends(a, b)
        self.outsider = self.b.address.rsplit(".", 1)[0] + f".{int(self.b.address.rsplit('.', 1)[1]) + 1}"
        self.rate: str | None = None

    def open(self) -> None:
        a, b = self.a, self.b
        _run(
            "ip", "-n", a.netns, "link", "add", a.dev, "type", "veth", "peer", "name", b.dev, "netns", b.netns
        )
        for end in (a, b):
            _run("ip", "-n", end.netns, "addr", "add", f"{end.address}/29", "dev", end.dev)
            _run("ip", "-n", end.netns, "link", "set", end.dev, "up")
            _run("ip", "-n", end.netns, "route", "add", "blackhole", WAN_NET)
        _run("ip", "-n", b.netns, "addr", "add", f"{self.outsider}/29", "dev", b.dev)

    def limit(self, rate: str) -> None:
        """At most ``rate`` (tc's units: ``2mbit``) each way."""
        for end in (self.a, self.b):
            _run("tc", "-n", end.netns, "qdisc", "replace", "dev", end.dev, "root", "tbf", "rate", rate,
                 "burst", BURST, "latency", LATENCY)  # fmt: skip
        self.rate = rate

    def cut(self) -> None:
        for end in (self.a, self.b):
            _run("ip", "-n", end.netns, "link", "set", end.dev, "down")

    def restore(self) -> None:
        for end in (self.a, self.b):
            _run("ip", "-n", end.netns, "link", "set", end.dev, "up")

    def connects(self, port: int, *, source: str, timeout_s: float = 5.0) -> bool:
        """Whether a TCP connection from region b's namespace, from address ``source``, to region a's
        end at ``port`` is accepted within ``timeout_s``."""
        probe = (f"import socket; socket.create_connection(({self.a.address!r}, {port}), timeout={timeout_s}, "
                 f"source_address=({source!r}, 0)).close()")  # fmt: skip
        done = subprocess.run(["nsenter", f"--net=/run/netns/{self.b.netns}", "--", "python3", "-c", probe],
                              capture_output=True, text=True, timeout=timeout_s + 30, check=False)  # fmt: skip
        return done.returncode == 0

    def counters(self) -> dict[str, EndCounters]:
        """``{"a": ..., "b": ...}``: each end's counters since the link was opened."""
        return {"a": _counters(self.a), "b": _counters(self.b)}

    def close(self) -> None:
        """Remove the link (both ends, their shapers) and the blackhole routes; nothing if gone."""
        for end in (self.a, self.b):
            subprocess.run(["ip", "-n", end.netns, "route", "del", "blackhole", WAN_NET], capture_output=True,
                           check=False)  # fmt: skip
        subprocess.run(
            ["ip", "-n", self.a.netns, "link", "del", self.a.dev], capture_output=True, check=False
        )


def _counters(end: WanEnd) -> EndCounters:
    (link,) = json.loads(_run("ip", "-n", end.netns, "-s", "-j", "link", "show", "dev", end.dev))
    stats = link["stats64"]
    qdiscs: list[dict[str, Any]] = json.loads(
        _run("tc", "-n", end.netns, "-s", "-j", "qdisc", "show", "dev", end.dev)
    )
    tbf = next((q for q in qdiscs if q.get("kind") == "tbf"), {})
    return EndCounters(
        sent_bytes=int(stats["tx"]["bytes"]), received_bytes=int(stats["rx"]["bytes"]),
        shaped_bytes=int(tbf.get("bytes", 0)), overlimits=int(tbf.get("overlimits", 0)),
        drops=int(tbf.get("drops", 0)),
    )  # fmt: skip
