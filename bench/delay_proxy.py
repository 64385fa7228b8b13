#!/usr/bin/env python3
"""A TCP proxy that puts a network's round trip between a client and a store on one machine.

Every byte a client sends is passed on `delay_ms` after it arrived; the store's answers pass
straight back. Each request to the store (an S3 GET on a kept-alive connection) then takes one
more `delay_ms` to reach it, as a request across a network does, while the bytes of a large
answer still stream at the speed of loopback. This kernel has no `netem` qdisc
(`CONFIG_NET_SCH_NETEM` unset), so a link cannot be delayed with `tc`; the proxy is the stand-in.

It runs as a process of its own, so it shares no interpreter lock with the process measured:

    python3 bench/delay_proxy.py --upstream 127.0.0.1:3900 --delay-ms 10   # prints "port N"

or from a benchmark:

    proxy = DelayProxy("127.0.0.1", 3900, delay_ms=10)
    endpoint = f"http://127.0.0.1:{proxy.port}"   # signed requests keep working: the Host
                                                  # header is the one the client signed
    proxy.close()
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys


class DelayProxy:
    """The proxy as a child process, listening on 127.0.0.1:`port` until `close`."""

    def __init__(self, host: str, port: int, delay_ms: float):
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--upstream", f"{host}:{port}", "--delay-ms", str(delay_ms)],
            stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline()
        if not line.startswith("port "):
            self._proc.kill()
            raise RuntimeError(f"delay proxy did not start: {line!r}")
        self.port = int(line.split()[1])

    def close(self):
        self._proc.terminate()
        self._proc.wait(timeout=10)


async def _delayed(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float):
    """Passes `src` on to `dst`, each piece `delay` seconds after it arrived, in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def send():
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if dst.can_write_eof():
                    dst.write_eof()
                return
            dst.write(data)
            await dst.drain()

    sender = asyncio.ensure_future(send())
    try:
        while True:
            data = await src.read(1 << 16)
            queue.put_nowait((loop.time() + delay, data))
            if not data:
                break
        await sender
    finally:
        sender.cancel()


async def _straight(src: asyncio.StreamReader, dst: asyncio.StreamWriter):
    while data := await src.read(1 << 18):
        dst.write(data)
        await dst.drain()
    dst.close()


async def serve(upstream: tuple[str, int], delay: float):
    async def one(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        try:
            store_r, store_w = await asyncio.open_connection(*upstream)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(_delayed(client_r, store_w, delay), _straight(store_r, client_w),
                                 return_exceptions=True)
        finally:
            for w in (client_w, store_w):
                w.close()

    server = await asyncio.start_server(one, "127.0.0.1", 0)
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        # Until the parent goes away (it holds our stdin) or terminates us.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the store")
    ap.add_argument("--delay-ms", type=float, required=True, help="added to every request on its way")
    args = ap.parse_args()
    host, _, port = args.upstream.rpartition(":")
    asyncio.run(serve((host, int(port)), args.delay_ms / 1000.0))


if __name__ == "__main__":
    main()
