"""A pod's traffic as the real node's network counts it, read from this machine (the real node's
pods run here): the bytes and packets of the pod's interface (``/proc/<pid>/net/dev`` of one of
its processes, found by its cgroup), and of its TCP traffic to and from chosen ports, counted by
rules added to the pod's own network namespace (``iptables``: the IP packets' lengths, headers
included). Nothing here reads what the pod's programs say of themselves."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
_COMMENT = "diloco-test-count"


@dataclass(frozen=True)
class Counts:
    """Bytes and packets each way (``sent``: leaving the pod)."""

    sent_bytes: int
    sent_packets: int
    received_bytes: int
    received_packets: int

    def __sub__(self, other: Counts) -> Counts:
        return Counts(
            self.sent_bytes - other.sent_bytes,
            self.sent_packets - other.sent_packets,
            self.received_bytes - other.received_bytes,
            self.received_packets - other.received_packets,
        )


def pod_pid(uid: str, root: Path = CGROUP_ROOT) -> int:
    """A process of the pod ``uid`` (its sandbox or a container: they share the network namespace),
    from the kubelet's cgroup of the pod (``pod<uid>``; the systemd driver writes ``_`` for ``-``)."""
    names = {f"pod{uid}", f"pod{uid.replace('-', '_')}"}
    hierarchy = root / "pids" if (root / "pids").is_dir() else root
    for folder in hierarchy.rglob("pod*"):
        if folder.name.removesuffix(".slice").endswith(tuple(names)):
            for procs in folder.rglob("cgroup.procs"):
                pids = procs.read_text().split()
                if pids:
                    return int(pids[0])
    raise LookupError(f"no process of pod {uid} under {hierarchy}")


def interface_counts(pid: int, interface: str = "eth0") -> Counts:
    """The counters of ``interface`` in the network namespace of process ``pid`` (``net/dev``:
    Ethernet frames, their 14-byte headers included)."""
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
        name, _, figures = line.partition(":")
        if name.strip() == interface:
            f = [int(x) for x in figures.split()]
            return Counts(sent_bytes=f[8], sent_packets=f[9], received_bytes=f[0], received_packets=f[1])
    raise LookupError(f"no interface {interface} in the network namespace of process {pid}")


def _iptables(pid: int, *args: str) -> str:
    argv = ["nsenter", f"--net=/proc/{pid}/ns/net", "--", "iptables", "-w", *args]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def _comment(port: int) -> str:
    return f"{_COMMENT}-{port}"


def count_port(pid: int, port: int) -> None:
    """Rules that count (and only count) the TCP packets the pod of process ``pid`` sends to
    ``port`` and receives from it; they go with the pod's network namespace."""
    for chain, way in (("OUTPUT", "--dport"), ("INPUT", "--sport")):
        _iptables(pid, "-I", chain, "-p", "tcp", way, str(port), "-m", "comment", "--comment", _comment(port))


def port_counts(pid: int, ports: Iterable[int]) -> Counts:
    """What the rules of ``count_port`` for ``ports`` counted so far, summed."""
    wanted = {_comment(port) for port in ports}
    totals = {}
    for chain in ("OUTPUT", "INPUT"):
        packets = size = 0
        for line in _iptables(pid, "-nvxL", chain).splitlines():
            if any(f"/* {c} */" in line for c in wanted):
                fields = line.split()
                packets, size = packets + int(fields[0]), size + int(fields[1])
        totals[chain] = (size, packets)
    return Counts(totals["OUTPUT"][0], totals["OUTPUT"][1], totals["INPUT"][0], totals["INPUT"][1])


def tcp_payload(counts: Counts, header: int = 52) -> tuple[int, int]:
    """The TCP payload in ``counts`` (IP packets), each way: their bytes less ``header`` per packet
    (IPv4's 20 and TCP's 20 with the 12 of the timestamp option, which Linux sends on every segment
    once both sides agreed to it)."""
    return (
        counts.sent_bytes - header * counts.sent_packets,
        counts.received_bytes - header * counts.received_packets,
    )
