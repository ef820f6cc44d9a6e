"""A TCP relay: ``python -m diloco_testbed.relay [--instance=TAG] LISTEN_HOST:PORT=TARGET_HOST:PORT ...``.

A real node runs in its own network namespace, joined to this machine's by a veth pair; servers the
tests start on loopback (the kube-apiserver, SeaweedFS) are reached from there through this relay,
which listens on the host end of the pair. It copies bytes both ways and nothing else.
``--instance`` is not used: it tags the process, so that a later clean-up finds it by its node.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def _handler(host: str, port: int):  # type: ignore[no-untyped-def]
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return handle


def parse(spec: str) -> tuple[str, int, str, int]:
    """``LISTEN_HOST:PORT=TARGET_HOST:PORT`` as its four parts."""
    listen, _, target = spec.partition("=")
    lhost, _, lport = listen.rpartition(":")
    thost, _, tport = target.rpartition(":")
    if not (lhost and lport.isdigit() and thost and tport.isdigit()):
        raise ValueError(f"expected LISTEN_HOST:PORT=TARGET_HOST:PORT, got {spec!r}")
    return lhost, int(lport), thost, int(tport)


async def main(specs: list[str]) -> None:
    servers = []
    for spec in specs:
        lhost, lport, thost, tport = parse(spec)
        servers.append(await asyncio.start_server(_handler(thost, tport), lhost, lport, reuse_address=True))
    print(f"relaying {' '.join(specs)}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


if __name__ == "__main__":
    asyncio.run(main([a for a in sys.argv[1:] if not a.startswith("--instance=")]))
