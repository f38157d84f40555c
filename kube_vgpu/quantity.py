"""Kubernetes resource quantity parsing (``k8s.io/apimachinery/pkg/api/resource.Quantity``).

Grammar: ``<sign><digits>[.<digits>][<suffix>]`` where suffix is a binary SI suffix
(``Ki Mi Gi Ti Pi Ei``), a decimal SI suffix (``n u m k M G T P E``) or a decimal exponent
(``e3``/``E3``). Values are returned exactly as :class:`fractions.Fraction`.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

from .errors import QuantityError

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_RE = re.compile(r"^([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])|[eE]([+-]?[0-9]+))?$")
#: longer strings are never a sensible quantity (and would hit int-conversion limits)
MAX_LEN = 64


def parse_quantity(value: object) -> Fraction:
    """Parse a Kubernetes quantity (str, int or float as found in pod JSON) exactly.

    Returns: the value as a Fraction (``"1500m"`` -> 3/2, ``"2Gi"`` -> 2147483648).
    Raises: QuantityError if the value is not a quantity.
    """
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise QuantityError(f"{value!r} is not a finite quantity")
        return Fraction(str(value))
    if not isinstance(value, str):
        raise QuantityError(f"{value!r} is not a quantity string")
    if len(value) <= MAX_LEN:  # the same few strings ("1", "1000") in every pod: parse each once
        return _parse_str(value)
    return _parse_str.__wrapped__(value)


@lru_cache(maxsize=1024)
def _parse_str(value: str) -> Fraction:
    """:func:`parse_quantity` of a string (cached for strings of at most MAX_LEN characters: a
    Fraction is immutable; errors are raised, never cached). Raises QuantityError."""
    s = value.strip()
    if len(s) > MAX_LEN:
        raise QuantityError(f"{value[:20]!r}... is too long to be a quantity ({len(s)} characters, at most {MAX_LEN})")
    m = _RE.match(s)
    if not m:
        raise QuantityError(f"{value!r} is not a Kubernetes quantity (e.g. 3000, 1Gi, 500m)")
    sign, num, suffix, exp = m.groups()
    q = Fraction(num)
    if suffix in _BINARY:
        q *= _BINARY[suffix]
    elif suffix is not None:
        q *= _DECIMAL[suffix]
    elif exp is not None:
        e = int(exp)
        if abs(e) > 30:
            raise QuantityError(f"{value!r}: exponent out of range")
        q *= Fraction(10) ** e
    return -q if sign == "-" else q


def parse_whole(value: object) -> int:
    """Parse a quantity that must be a whole number (e.g. ``"3000"``, ``"3k"``).

    Raises: QuantityError if unparseable or not an integer (``"99.1"``, ``"50m"``).
    """
    q = parse_quantity(value)
    if q.denominator != 1:
        raise QuantityError(f"{value!r} is not a whole number")
    return int(q)


def parse_bytes_to_mib(value: object) -> int:
    """Parse a memory quantity in bytes (``"16Gi"``) and return whole MiB (floor)."""
    q = parse_quantity(value)
    return int(q // (1 << 20))
