"""Printing text that came from the cluster: control characters never reach the terminal.

Names, GPU models, annotation contents and error messages are data written by anyone who can
create a pod or a node annotation; a ``\\x1b[2J`` in a container name would clear the screen. Every
string a table prints goes through :func:`safe` (JSON output is escaped by ``json.dumps``).
"""

from __future__ import annotations

import unicodedata

#: Unicode categories printed as escapes: controls (C0, DEL, C1), format characters (bidi
#: overrides, zero-width), line/paragraph separators, surrogates, unassigned/private use
_UNSAFE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})


def _escape(ch: str) -> str:
    o = ord(ch)
    if o < 0x100:
        return f"\\x{o:02x}"
    if o < 0x10000:
        return f"\\u{o:04x}"
    return f"\\U{o:08x}"


def safe(text: object) -> str:
    """``text`` as a string with every unsafe character written as a Python-style escape."""
    s = str(text)
    if s.isascii() and s.isprintable():
        return s
    return "".join(_escape(ch) if unicodedata.category(ch) in _UNSAFE else ch for ch in s)


