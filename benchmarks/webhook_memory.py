"""Webhook memory under abuse: RSS through aborted TLS handshakes and slow clients.

Starts ``kube-vgpu webhook`` as its own process (as in a cluster) with a certificate made by
``certs`` and the chart's flags for connection limits and timeouts, then plays, from this process:

1. **baseline**: a few good reviews;
2. **aborted handshakes** (``--handshakes``, default 10,000; ``--concurrency`` at a time): each
   connects, sends a real TLS ClientHello and resets the connection (half of them right away, half
   after the server's first flight, so the server has done its key exchange); plus
   ``--stalled`` connections that send a ClientHello and then nothing (the server must time them out);
3. **slow clients** (``--slow``, default 500): TLS completed, then half trickle header lines one at a
   time, half send complete headers with a large ``Content-Length`` and trickle the body. Each is
   held until the server closes it (or ``--slow-max`` seconds pass);
4. a good review again (the server must still answer).

Printed: the server's RSS (``VmRSS``) after each phase and its peak (``VmHWM``), in MiB, the number
of connections the server closed or refused, and the webhook's memory limit in the chart
(``webhook.resources.limits.memory`` in charts/kube-vgpu/values.yaml). Exit code 0 when the peak
stays under that limit and the last review is answered, 1 otherwise. Nothing is timed.

Usage: ``python benchmarks/webhook_memory.py [--handshakes 10000] [--slow 500] [--json]
[--server-arg=--max-connections=512 ...]`` (Linux: reads /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from certs import pki, store  # noqa: E402

MIB = 1024 * 1024
_UNITS = {"Ki": 1024, "Mi": MIB, "Gi": 1024 * MIB, "K": 1000, "M": 1000 ** 2, "G": 1000 ** 3}


def chart_memory_limit() -> tuple[str, int]:
    """The webhook's memory limit in the chart's values.yaml: (text, bytes)."""
    values = yaml.safe_load((ROOT / "charts" / "kube-vgpu" / "values.yaml").read_text())
    text = str(values["webhook"]["resources"]["limits"]["memory"])
    m = re.fullmatch(r"(\d+)([KMG]i?)?", text)
    if not m:
        raise ValueError(f"webhook.resources.limits.memory={text!r} is not a quantity this script reads")
    return text, int(m.group(1)) * _UNITS.get(m.group(2) or "", 1)


def chart_server_args() -> list[str]:
    """The connection-limit flags the chart passes, from values.yaml (so the bench measures the chart)."""
    w = yaml.safe_load((ROOT / "charts" / "kube-vgpu" / "values.yaml").read_text())["webhook"]
    lim = w.get("limits") or {}
    flags = {"maxConnections": "--max-connections", "tlsHandshakeTimeoutSeconds": "--tls-handshake-timeout",
             "headerTimeoutSeconds": "--header-timeout", "bodyTimeoutSeconds": "--body-timeout",
             "idleTimeoutSeconds": "--idle-timeout", "keepAliveTimeoutSeconds": "--keepalive-timeout"}
    return [f"{flag}={lim[k]}" for k, flag in flags.items() if k in lim]


def rss(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def client_hello() -> bytes:
    """A real TLS ClientHello (what a client sends first), made with a memory BIO."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname="webhook")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return out.read()


def _rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


async def _aborted(port: int, hello: bytes, wait_reply: bool, stats: dict[str, int]) -> None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:  # reset by a server at its connection cap
        stats["refused"] += 1
        return
    try:
        writer.write(hello)
        await writer.drain()
        if wait_reply:
            data = await asyncio.wait_for(reader.read(1), 30)
            stats["reset_after_server_reply" if data else "refused"] += 1
        else:
            stats["reset_after_hello"] += 1
    except (TimeoutError, OSError):
        stats["refused"] += 1
    finally:
        _rst(writer)


async def _stalled(port: int, hello: bytes, hold: float, stats: dict[str, int]) -> None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        stats["stalled_refused"] += 1
        return
    try:
        writer.write(hello)
        await writer.drain()
        end = time.monotonic() + hold
        while time.monotonic() < end:  # the server's first flight, then EOF when it gives up on us
            data = await asyncio.wait_for(reader.read(65536), end - time.monotonic())
            if not data:
                stats["stalled_closed_by_server"] += 1
                return
        stats["stalled_still_open"] += 1
    except TimeoutError:
        stats["stalled_still_open"] += 1
    except OSError:
        stats["stalled_closed_by_server"] += 1
    finally:
        _rst(writer)


async def handshakes(port: int, n: int, stalled: int, concurrency: int, hold: float) -> dict[str, int]:
    hello = client_hello()
    stats = {"reset_after_hello": 0, "reset_after_server_reply": 0, "refused": 0, "stalled_closed_by_server": 0,
             "stalled_refused": 0, "stalled_still_open": 0}
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await _aborted(port, hello, i % 2 == 1, stats)

    await asyncio.gather(*(one(i) for i in range(n)))
    # then the stalled ones, all at once: more than the connection cap, so some are refused
    await asyncio.gather(*(_stalled(port, hello, hold, stats) for _ in range(stalled)))
    return stats


async def _slow(port: int, ctx: ssl.SSLContext, body: bool, hold: float, stats: dict[str, int]) -> None:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=ctx), 60)
    except (TimeoutError, OSError, ssl.SSLError):
        stats["refused"] += 1
        return
    head = b"POST /mutate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
    end = time.monotonic() + hold
    try:
        if body:
            writer.write(head + b"Content-Length: 1000000\r\n\r\n{")
        else:
            writer.write(head)
        await writer.drain()
        while time.monotonic() < end:
            writer.write(b" " if body else b"X-Slow: 1\r\n")
            await writer.drain()
            try:
                data = await asyncio.wait_for(reader.read(65536), 0.5)
            except TimeoutError:
                continue
            if not data:
                stats["closed_by_server"] += 1
                return
            stats["answered"] += 1  # e.g. 408 for a body that did not arrive in time
            return
        stats["still_open"] += 1
    except (OSError, ssl.SSLError):
        stats["closed_by_server"] += 1
    finally:
        writer.transport.abort()


async def slow_clients(port: int, n: int, hold: float, peak: list[float], pid: int) -> dict[str, int]:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    stats = {"refused": 0, "closed_by_server": 0, "answered": 0, "still_open": 0}
    tasks = [asyncio.create_task(_slow(port, ctx, i % 2 == 1, hold, stats)) for i in range(n)]
    while not all(t.done() for t in tasks):  # sample RSS while they are connected
        await asyncio.sleep(0.5)
        peak.append(rss(pid)[0])
    await asyncio.gather(*tasks)
    return stats


def good_review(port: int, ca: Path) -> bool:
    import http.client
    body = json.dumps({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": "default",
        "operation": "CREATE", "userInfo": {"username": "admin"},
        "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"name": "p", "namespace": "default"},
                   "spec": {"containers": [{"name": "c", "image": "x",
                                            "resources": {"limits": {"nvidia.com/gpumem": "1000"}}}]}}}})
    ctx = ssl.create_default_context(cafile=str(ca))
    for _ in range(50):
        try:
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
            conn.request("POST", "/mutate", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            ok = resp.status == 200 and json.loads(resp.read())["response"]["allowed"] is True
            conn.close()
            return ok
        except OSError:
            time.sleep(0.2)
    return False


#: the malloc settings charts/kube-vgpu/templates/webhook.yaml gives the container
CHART_MALLOC_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def start_server(tls: Path, extra: list[str], malloc_env: bool = True) -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kube_vgpu_cli", "webhook", "--bind-address", "127.0.0.1", "--port", str(port),
           "--tls-cert-file", str(tls / "tls.crt"), "--tls-key-file", str(tls / "tls.key"),
           "--log-level", "warning", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(CHART_MALLOC_ENV if malloc_env else {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    return proc, port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--handshakes", type=int, default=10_000)
    ap.add_argument("--stalled", type=int, default=1000, help="handshakes that stall after the ClientHello")
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--slow", type=int, default=500)
    ap.add_argument("--slow-max", type=float, default=60.0, help="seconds a slow client keeps trying")
    ap.add_argument("--server-arg", action="append", default=None,
                    help="a flag for the webhook (repeat); default: the chart's limits from values.yaml")
    ap.add_argument("--no-malloc-env", action="store_true", help="run without the chart's MALLOC_* settings")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    limit_text, limit = chart_memory_limit()
    server_args = args.server_arg if args.server_arg is not None else chart_server_args()
    with tempfile.TemporaryDirectory() as d:
        tls = Path(d)
        store.write_files(tls, pki.create_bundle(pki.service_dns_names("wh", "ns"), ["127.0.0.1"]))
        proc, port = start_server(tls, server_args, not args.no_malloc_env)
        try:
            if not good_review(port, tls / "ca.crt"):
                print("webhook did not answer", file=sys.stderr)
                return 1
            for _ in range(20):
                good_review(port, tls / "ca.crt")
            base, _ = rss(proc.pid)
            hs = asyncio.run(handshakes(port, args.handshakes, args.stalled, args.concurrency, args.slow_max))
            after_hs, peak_hs = rss(proc.pid)
            samples: list[float] = []
            sl = asyncio.run(slow_clients(port, args.slow, args.slow_max, samples, proc.pid))
            after_slow, peak = rss(proc.pid)
            answered = good_review(port, tls / "ca.crt")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    out: dict[str, Any] = {
        "server_args": server_args, "malloc_env": not args.no_malloc_env, "baseline_mib": round(base, 1),
        "after_handshakes_mib": round(after_hs, 1), "peak_during_handshakes_mib": round(peak_hs, 1),
        "handshakes": args.handshakes, "stalled": args.stalled, "handshake_stats": hs,
        "max_during_slow_clients_mib": round(max(samples, default=after_slow), 1),
        "after_slow_clients_mib": round(after_slow, 1), "peak_mib": round(peak, 1),
        "slow_clients": args.slow, "slow_stats": sl, "answers_after_abuse": answered,
        "chart_memory_limit": limit_text, "chart_memory_limit_mib": round(limit / MIB, 1)}
    ok = answered and peak * MIB < limit
    if args.json:
        print(json.dumps(out))
    else:
        print(f"webhook flags: {' '.join(server_args) or '(defaults)'}; chart MALLOC_* env: {not args.no_malloc_env}")
        print(f"baseline RSS:                          {out['baseline_mib']:8.1f} MiB")
        print(f"after {args.handshakes} aborted + {args.stalled} stalled handshakes: {out['after_handshakes_mib']:8.1f} MiB "
              f"(peak {out['peak_during_handshakes_mib']:.1f}); {hs}")
        print(f"with {args.slow} slow clients connected (max): {out['max_during_slow_clients_mib']:8.1f} MiB")
        print(f"after the slow clients:                {out['after_slow_clients_mib']:8.1f} MiB; {sl}")
        print(f"peak RSS (VmHWM) over the run:         {out['peak_mib']:8.1f} MiB")
        print(f"chart memory limit:                    {limit_text} ({out['chart_memory_limit_mib']:.0f} MiB)")
        print(f"good review answered after the abuse:  {answered}")
        print("result:", "peak under the limit" if ok else "OVER THE LIMIT or not answering")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
