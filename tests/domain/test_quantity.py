"""kube_vgpu.quantity: exact Kubernetes quantity parsing."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.errors import QuantityError, VGPUError
from kube_vgpu.quantity import parse_bytes_to_mib, parse_quantity, parse_whole

SETTINGS = settings(max_examples=200, deadline=None)

FACTORS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (0, Fraction(0)),
        (3000, Fraction(3000)),
        ("3000", Fraction(3000)),
        ("1500m", Fraction(3, 2)),
        ("2Gi", Fraction(2 * 2**30)),
        ("16Mi", Fraction(16 * 2**20)),
        ("1Ki", Fraction(1024)),
        ("1k", Fraction(1000)),
        ("3k", Fraction(3000)),
        ("2M", Fraction(2_000_000)),
        ("1G", Fraction(10**9)),
        ("1e3", Fraction(1000)),
        ("1E3", Fraction(1000)),  # exponent, not the exa suffix
        ("1E", Fraction(10**18)),  # exa suffix
        ("2.5e2", Fraction(250)),
        ("1e-3", Fraction(1, 1000)),
        ("+5", Fraction(5)),
        ("-3", Fraction(-3)),
        (".5", Fraction(1, 2)),
        ("0.5", Fraction(1, 2)),
        ("1.5Gi", Fraction(3 * 2**29)),
        ("100n", Fraction(1, 10**7)),
        ("250u", Fraction(1, 4000)),
        (1.5, Fraction(3, 2)),
        (0.1, Fraction(1, 10)),  # exact decimal, not the binary float 0.1000000000000000055...
        (2.0, Fraction(2)),
    ],
)
def test_parse_quantity_values(raw: object, expected: Fraction) -> None:
    got = parse_quantity(raw)
    assert got == expected
    assert isinstance(got, Fraction)


@pytest.mark.parametrize(
    "raw",
    [True, False, None, "abc", "1.2.3", "5Q", "", " ", "Gi", "e3", ".", "1 Gi", "--1", "1Gib", "0x10",
     "1e", "1e+", "1ki", [1], {"a": 1}, float("nan"), float("inf"), float("-inf"), b"1", object()],
)
def test_parse_quantity_rejects(raw: object) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(raw)


def test_quantity_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        parse_quantity("abc")
    assert issubclass(QuantityError, VGPUError)


def test_exponent_out_of_range() -> None:
    with pytest.raises(QuantityError, match="exponent"):
        parse_quantity("1e31")
    assert parse_quantity("1e30") == 10**30


@pytest.mark.parametrize(("raw", "expected"), [("3000", 3000), ("3k", 3000), (7, 7), ("1e2", 100), ("2000m", 2),
                                                (4.0, 4), ("-2", -2), ("1Gi", 2**30)])
def test_parse_whole_accepts(raw: object, expected: int) -> None:
    got = parse_whole(raw)
    assert got == expected
    assert type(got) is int


@pytest.mark.parametrize("raw", ["99.1", "50m", "1500m", 0.5, "1e-1", "abc", None, True])
def test_parse_whole_rejects(raw: object) -> None:
    with pytest.raises(QuantityError):
        parse_whole(raw)


@pytest.mark.parametrize(
    ("raw", "mib"),
    [("16Gi", 16384), ("1Mi", 1), ("1048575", 0), ("1048576", 1), ("1.5Mi", 1), ("2Mi", 2), ("1G", 953), (2**21, 2)],
)
def test_parse_bytes_to_mib(raw: object, mib: int) -> None:
    assert parse_bytes_to_mib(raw) == mib


@SETTINGS
@given(n=st.integers(min_value=0, max_value=10**12), suffix=st.sampled_from(sorted(FACTORS)))
def test_property_suffix_factor(n: int, suffix: str) -> None:
    assert parse_quantity(f"{n}{suffix}") == n * FACTORS[suffix]
    assert parse_quantity(f"-{n}{suffix}") == -n * FACTORS[suffix]


@SETTINGS
@given(n=st.integers(min_value=-(10**18), max_value=10**18))
def test_property_int_and_str_agree(n: int) -> None:
    assert parse_quantity(n) == n
    assert parse_quantity(str(n)) == n
    assert parse_whole(str(n)) == n


@SETTINGS
@given(milli=st.integers(min_value=0, max_value=10**9))
def test_property_milli(milli: int) -> None:
    assert parse_quantity(f"{milli}m") == Fraction(milli, 1000)


@SETTINGS
@given(junk=st.one_of(st.text(max_size=30), st.floats(), st.none(), st.booleans(), st.binary(max_size=8),
                      st.lists(st.integers(), max_size=3)))
def test_property_only_quantity_error(junk: object) -> None:
    try:
        parse_quantity(junk)
    except QuantityError:
        pass


@pytest.mark.parametrize("raw", ["9" * 5000, "0." + "1" * 5000])
def test_huge_digit_string_raises_quantity_error(raw: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(raw)


@pytest.mark.parametrize("raw", ["\u0661", "\u0663Gi", "\uff15"])  # Arabic-Indic 1, 3Gi; fullwidth 5
def test_non_ascii_digits_rejected(raw: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(raw)
