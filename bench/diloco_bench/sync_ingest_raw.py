"""The raw baseline of `diloco bench sync-ingest`: the same clients send the same bytes over plain
TCP to a server that only reads and decompresses them (``python -m diloco_bench.sync_ingest_raw PORT``
runs that server)."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys
import time

import zstandard

_LEN = struct.Struct("<Q")


async def raw_server(port: int) -> None:
    """Read length-prefixed codec blobs, decompress each, answer one byte: nothing else."""
    dctx = zstandard.ZstdDecompressor()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                blob = await reader.readexactly(size)
                dctx.decompress(blob[14:])  # the codec's prefix is 14 bytes, then one zstd frame
                writer.write(b"\x01")
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def raw_client(port: int, blobs: list[bytes], stop_at: float, totals: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = 0
    while time.perf_counter() < stop_at:
        blob = blobs[i % len(blobs)]
        i += 1
        writer.write(_LEN.pack(len(blob)) + blob)
        await writer.drain()
        await reader.readexactly(1)
        totals[0] += len(blob)
    writer.close()


async def run_raw(blobs: list[list[bytes]], seconds: float, port: int) -> float:
    """MB/s of payload that ``len(blobs)`` clients, each sending its own blobs in turn, get through."""
    proc = subprocess.Popen([sys.executable, "-m", "diloco_bench.sync_ingest_raw", str(port)])
    try:
        for _ in range(600):
            try:
                _r, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        totals = [0]
        start = time.perf_counter()
        await asyncio.gather(*(raw_client(port, b, start + seconds, totals) for b in blobs))
        return totals[0] / (time.perf_counter() - start) / 1e6
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    asyncio.run(raw_server(int(sys.argv[1])))
