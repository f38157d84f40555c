"""Stopping a thread that is blocked reading a streaming HTTP response (a watch).

A watch is read by one thread for minutes at a time. Closing its response from another thread does
not work: ``http.client``/``io.BufferedReader`` take the reader's buffer lock in ``close()``, so the
closing thread waits until the blocked read returns (the next watch event or bookmark, up to a
minute on a quiet cluster) and a SIGTERM'd process hangs in its shutdown. :func:`wake_reader` instead
shuts down the read side of the response's socket (``shutdown(SHUT_RD)``, a kernel call that is safe
from any thread and takes no Python lock): the blocked ``recv`` returns end-of-file at once, the
reading thread sees the stream end (or a protocol error), and it closes the response itself.
"""

from __future__ import annotations

import socket
from typing import Any


def response_socket(resp: Any) -> socket.socket | None:
    """The socket under a ``urllib3`` streaming response (``preload_content=False``), or None when
    it has none any more (already closed or released)."""
    conn = getattr(resp, "_connection", None)
    sock = getattr(conn, "sock", None)
    if sock is None:  # through http.client: HTTPResponse.fp (BufferedReader) -> SocketIO -> socket
        fp = getattr(resp, "_fp", None)
        raw = getattr(getattr(fp, "fp", None), "raw", None)
        sock = getattr(raw, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def wake_reader(resp: Any) -> bool:
    """Make a thread blocked reading ``resp`` see end-of-file now, without closing anything (the
    reading thread closes the response). Returns False when there was no open socket to wake.
    Never raises. For TLS sockets only the kernel socket is shut down: ``ssl.SSLSocket.shutdown``
    would also drop the SSL object under the reading thread."""
    sock = response_socket(resp)
    if sock is None:
        return False
    try:
        socket.socket.shutdown(sock, socket.SHUT_RD)  # the base method: no SSLSocket bookkeeping
    except OSError:  # already closed or not connected: nobody is blocked on it
        return False
    return True
