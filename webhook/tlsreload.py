"""A TLS server context whose certificate follows the files on disk.

The listening socket keeps one *base* ``ssl.SSLContext``; its SNI callback (called by OpenSSL for
every new handshake, with or without a server name from the client) hands the connection the
context built from the newest certificate. A watcher re-stats ``--tls-cert-file`` and
``--tls-key-file`` (mtime, size, inode; symlinks followed, so Secret volume ``..data`` swaps count)
every ``interval`` seconds and builds a fresh context when they change. Connections already open
keep the context they were made with, so no request is dropped. A pair that fails to load (e.g. the
key written before the certificate) keeps the old context and is retried on the next tick.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path

from cryptography import x509

log = logging.getLogger("kube_vgpu.webhook.tls")


def _stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A TLS 1.2+ server context with the PEM pair loaded. Raises ssl.SSLError / OSError."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


def cert_not_after(cert_file: str) -> float:
    """Expiry of the first certificate in a PEM file, unix seconds."""
    cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    return cert.not_valid_after_utc.replace(tzinfo=dt.UTC).timestamp()


class ReloadingTLS:
    """Holds the current server context; ``base`` goes to the listening socket.

    on_reload(result, not_after) is called after each load attempt (result ``ok`` or ``error``;
    not_after in unix seconds, 0 on error) so the caller can export metrics.
    Raises (constructor): ssl.SSLError / OSError if the initial pair cannot be loaded.
    """

    def __init__(self, cert_file: str, key_file: str, interval: float = 2.0,
                 on_reload: Callable[[str, float], None] | None = None):
        self.cert_file = cert_file
        self.key_file = key_file
        self.interval = interval
        self._on_reload = on_reload
        self._stamps = self._read_stamps()
        self.current = server_context(cert_file, key_file)
        self.base = server_context(cert_file, key_file)
        self.base.sni_callback = self._sni
        self.reloads = 0
        self._report("ok")

    def _read_stamps(self) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
        try:
            return (_stamp(self.cert_file), _stamp(self.key_file))
        except OSError:
            return None

    def _report(self, result: str) -> None:
        if self._on_reload is None:
            return
        try:
            not_after = cert_not_after(self.cert_file) if result == "ok" else 0.0
        except (OSError, ValueError):
            not_after = 0.0
        self._on_reload(result, not_after)

    def _sni(self, sslobj: ssl.SSLObject | ssl.SSLSocket, server_name: str | None,
             ctx: ssl.SSLContext) -> None:
        if self.current is not ctx:
            sslobj.context = self.current
        return None

    def check(self) -> bool:
        """Reload if the files changed. Returns True when a new context took effect."""
        stamps = self._read_stamps()
        if stamps is None or stamps == self._stamps:
            return False
        try:
            ctx = server_context(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError, ValueError) as e:
            log.warning("TLS reload failed, keeping the previous certificate", extra={"error": str(e)})
            self._report("error")
            return False  # stamps not stored: retried next tick
        if self._read_stamps() != stamps:
            return False  # a writer is mid-way (key and cert are two files): take the pair next tick
        self._stamps = stamps
        self.current = ctx
        self.reloads += 1
        log.info("TLS certificate reloaded", extra={"cert_file": self.cert_file})
        self._report("ok")
        return True

    async def watch(self) -> None:
        """Poll forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.interval)
            self.check()
