"""Kubernetes resource quantities (the `resource.Quantity` of the API objects), exact.

A model of k8s.io/apimachinery/pkg/api/resource/quantity.go: `parse` follows `ParseQuantity`
(`parseQuantityString` for the grammar, `quantitySuffixer.interpret` for the suffixes) and
gives the exact value as a Fraction; `value` is `Quantity.Value()` (rounded up to an integer,
as `ScaledValue(0)` does); `format_binary` and `format_decimal` give the canonical text the API
server stores for an integer in the BinarySI and DecimalSI formats (`CanonicalizeBytes`), so that
what we publish reads back unchanged.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}  # powers of 1024
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
# parseQuantityString: optional sign, digits, optional "." and digits, then the suffix.
_SHAPE = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?(.*)", re.DOTALL)
_EXPONENT = re.compile(r"[eE]([+-]?[0-9]+)")


class QuantityError(ValueError):
    """Not a quantity the API server would accept."""


def parse(text: str) -> Fraction:
    """The exact value of a quantity string; QuantityError for what ParseQuantity rejects."""
    if not isinstance(text, str) or not text or len(text) > 128:
        raise QuantityError(f"invalid quantity {str(text)[:40]!r}")
    m = _SHAPE.fullmatch(text)
    if m is None:  # pragma: no cover - the pattern matches every string
        raise QuantityError(f"invalid quantity {text[:40]!r}")
    sign, whole, frac, suffix = m.group(1), m.group(2), m.group(3) or "", m.group(4)
    number = Fraction(int(whole or "0")) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
    if suffix in _BINARY:
        scale = Fraction(1024 ** _BINARY[suffix])
    elif suffix in _DECIMAL:
        scale = Fraction(10) ** _DECIMAL[suffix]
    else:
        e = _EXPONENT.fullmatch(suffix)
        if e is None or len(e.group(1)) > 6:
            raise QuantityError(f"invalid quantity {text[:40]!r}: unknown suffix {suffix[:16]!r}")
        scale = Fraction(10) ** int(e.group(1))
    value = number * scale
    return -value if sign == "-" else value


def value(text: str) -> int:
    """`Quantity.Value()`: the value rounded up to an integer."""
    return math.ceil(parse(text))


def format_decimal(n: int) -> str:
    """Canonical DecimalSI text of an integer: the largest exact suffix of k, M, G, T, P, E."""
    if n == 0:
        return "0"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for suffix, exp in (("E", 18), ("P", 15), ("T", 12), ("G", 9), ("M", 6), ("k", 3)):
        if n % 10**exp == 0:
            return f"{sign}{n // 10**exp}{suffix}"
    return f"{sign}{n}"


def format_binary(n: int) -> str:
    """Canonical BinarySI text of an integer: below 1024 in DecimalSI, else the largest exact
    power of 1024 (Ki ... Ei), else the plain number."""
    if -1024 < n < 1024:
        return format_decimal(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for suffix, exp in (("Ei", 6), ("Pi", 5), ("Ti", 4), ("Gi", 3), ("Mi", 2), ("Ki", 1)):
        if n % 1024**exp == 0:
            return f"{sign}{n // 1024**exp}{suffix}"
    return f"{sign}{n}"
