"""vgpu/quantity.py against what a real kube-apiserver v1.36.2 stored (tests/data/real-traces/quantities)
and against ParseQuantity's rules (k8s.io/apimachinery/pkg/api/resource/quantity.go): properties
with an independent oracle (exact fractions), and hand-checked edge cases."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import traces
from vgpu import quantity as q

CASES = traces.load_json("quantities/quantities.json")["cases"]

# What each value sent in the trace stands for (written by hand from its text, not computed).
MEANS: dict[str, int | None] = {
    "1000": 1000,
    "3000": 3000,
    "4096": 4096,
    "8192": 8192,
    "10000": 10000,
    '"1000"': 1000,
    '"4Gi"': 4 << 30,
    '"1e3"': 1000,
    "1000.0": 1000,
    '"0.5"': None,
    "0.5": None,
    '"1500m"': None,
    '"1k"': 1000,
    '"3000Mi"': 3000 << 20,
    '"-1"': -1,
    '"0"': 0,
    "1": 1,
    '"1"': 1,
    '"2000m"': 2,
    "2000": 2000,
}


class _Num(str):
    """A JSON number's text (Quantity.UnmarshalJSON gets the bytes of the number: 1000.0 stays 1000.0)."""


def _sent(case: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = json.loads(case["sent_resources_json"], parse_int=_Num, parse_float=_Num)
    return out


def _json_text(v: Any) -> str:
    return str(v) if isinstance(v, _Num) else json.dumps(v)


def test_every_recorded_input_is_stored_and_read_as_the_api_server_does() -> None:
    assert len(CASES) == 21
    seen = 0
    for case in CASES:
        sent = _sent(case)
        saw = case["mutating_webhook_saw_resources"]
        for part, values in sent.items():
            for key, v in values.items():
                seen += 1
                text = _json_text(v)
                # What the API server decoded, defaulted and sent the webhook (and stored on 201).
                assert q.defaulted(v) == saw[part][key], (text, saw)
                if case["http_status"] == 201:
                    assert q.defaulted(v) == case[f"stored_{part}"][key]
                n = MEANS[text]
                if n is None:
                    with pytest.raises(q.QuantityError, match=r"^is not a whole number$"):
                        q.whole(saw[part][key])
                    assert "must be an integer" in case["error"]
                elif n < 0:
                    with pytest.raises(q.QuantityError, match=r"^is negative$"):
                        q.whole(saw[part][key])
                    assert "must be greater than or equal to 0" in case["error"]
                else:
                    assert q.whole(saw[part][key]) == n  # the stored form ("3k") reads as 3000
                    assert q.whole(v if not isinstance(v, _Num) else json.loads(v)) == n
    assert seen == 41


# Checked against k8s.io/apimachinery v0.36.3 ParseQuantity + String() (and RoundUp(-3) for the
# stored form) by hand; each row names the rule of quantity.go it shows.
EDGES = [
    ("3000", "3k", "3k"),  # a multiple of 1000 is not kept: canonical form
    ("4096", "4096", "4096"),  # kept as written (scale%3 == 0, no trailing 000)
    ("05", "05", "05"),  # kept as written: leading zeros are not looked at
    ("+5", "+5", "+5"),
    ("01Ki", "01Ki", "01Ki"),  # BinarySI kept when the number is not a multiple of 8
    ("1024Ki", "1Mi", "1Mi"),
    ("1.5Gi", "1536Mi", "1536Mi"),
    ("0.5Ki", "512", "512"),  # |value| < 1024: DecimalSI
    ("1.1Ki", "1126400m", "1126400m"),  # not whole: DecimalSI, no precision lost
    ("1e3", "1e3", "1e3"),  # DecimalExponent kept
    ("1000e0", "1e3", "1e3"),
    ("1e21", "1e21", "1e21"),
    ("1000E", "1", "1"),  # Go writes no suffix for 10**21 in DecimalSI (constructBytes fails)
    ("0.9999999999", "1", "1"),  # rounded up to nano
    ("1.0000000001", "1000000001n", "1001m"),
    ("1n", "1n", "1m"),  # the ResourceList defaulting rounds up to milli
    ("2000m", "2", "2"),
    ("-0", "0", "0"),
    (".", "0", "0"),
    ("Gi", "0", "0"),  # no digits at all: zero (the fast path)
    ("1.G", "1.G", "1.G"),  # kept as written (a dot without decimals)
    ("1e2147483647", "10e2147483646", "10e2147483646"),  # int32 exponent arithmetic
    ("1.5e-2147483648", "150e2147483646", "150e2147483646"),  # ... wrapping around
    ("9999999999999.5Ei", "9223372036854775807", "9223372036854775807"),  # BinarySI capped at int64
    ("8Ei", "9223372036854775807", "9223372036854775807"),
    ("7Ei", "7Ei", "7Ei"),
    ("0.000000000000000000001", "1n", "1m"),
]


@pytest.mark.parametrize(("text", "string", "stored"), EDGES)
def test_edges_as_apimachinery(text: str, string: str, stored: str) -> None:
    assert q.canonical(q.parse(text)) == string
    assert q.defaulted(text) == stored


@pytest.mark.parametrize(
    ("text", "err"),
    [
        ("", q.ERR_FORMAT),
        ("1.2.3", q.ERR_FORMAT),
        ("1é", q.ERR_FORMAT),
        ("abc", q.ERR_FORMAT),
        ("1kk", q.ERR_SUFFIX),
        ("1K", q.ERR_SUFFIX),
        ("1e", q.ERR_SUFFIX),
        ("1e9223372036854775808", q.ERR_SUFFIX),  # strconv.ParseInt range
        ("-Ei", q.ERR_NUMERIC),  # slow path, no digits for inf.Dec
        ("5e-2147483648", q.ERR_RANGE),  # Go would build 10**(2**31): refused here
    ],
)
def test_errors_are_go_s(text: str, err: str) -> None:
    with pytest.raises(q.QuantityError) as e:
        q.parse(text)
    assert str(e.value) == err


def test_json_values_and_whitespace() -> None:
    assert q.defaulted(1000) == "1k" and q.defaulted(1000.0) == "1k" and q.defaulted(None) == "0"
    assert q.defaulted(" 3000\n") == "3k"  # UnmarshalJSON trims (strings.TrimSpace)
    with pytest.raises(q.QuantityError):
        q.parse_json(True)
    with pytest.raises(q.QuantityError, match=r"^is not a Kubernetes quantity \(quantities must match"):
        q.whole("3 k")
    with pytest.raises(q.QuantityError, match=r"^is too large$"):
        q.whole("9223372036854775808")
    with pytest.raises(q.QuantityError, match=r"^is too large$"):
        q.whole("1e20")
    assert q.whole("9223372036854775807") == q.INT64_MAX


# --- properties, against an independent oracle --------------------------------------------------

DEC = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
BIN = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}


def oracle(sign: str, number: str, suffix: str) -> Fraction:
    """The value ParseQuantity holds, from the text alone: the exact number times the suffix,
    rounded up (away from zero) to 10**-9, BinarySI capped at 2**63-1."""
    v = Fraction(number if number.strip(".") else "0")
    if suffix in DEC:
        v *= Fraction(10) ** DEC[suffix]
    elif suffix in BIN:
        v *= 2 ** BIN[suffix]
    else:
        v *= Fraction(10) ** int(suffix[1:])
    v = Fraction(math.ceil(v * 10**9), 10**9)
    if suffix in BIN:
        v = min(v, Fraction(q.INT64_MAX))
    return -v if sign == "-" else v


def value(x: q.Quantity) -> Fraction:
    return Fraction(x.unscaled) * Fraction(10) ** x.exp10


numbers = st.one_of(
    st.integers(0, 10**20).map(str),
    st.tuples(st.integers(0, 10**12), st.text("0123456789", max_size=12)).map(lambda t: f"{t[0]}.{t[1]}"),
    st.text("0123456789", min_size=1, max_size=12).map(lambda s: "." + s),
)
suffixes = st.one_of(
    st.sampled_from(sorted(DEC) + sorted(BIN)),
    st.tuples(st.sampled_from("eE"), st.sampled_from(["", "+", "-"]), st.integers(0, 40)).map(
        lambda t: f"{t[0]}{t[1]}{t[2]}"
    ),
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["", "+", "-"]), numbers, suffixes)
def test_value_is_exact_and_the_canonical_form_reads_back(sign: str, number: str, suffix: str) -> None:
    x = q.parse(sign + number + suffix)
    assert value(x) == oracle(sign, number, suffix)
    text = q.canonical(x)
    if abs(value(x)) < 10**21:  # above, Go writes DecimalSI without its (missing) suffix
        again = q.parse(text)
        assert value(again) == value(x)
        assert q.canonical(again) == text  # the canonical form is a fixed point
    stored = q.round_up(x)
    assert value(stored) == Fraction(math.ceil(abs(value(x)) * 1000), 1000) * (-1 if value(x) < 0 else 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, q.INT64_MAX))
def test_every_int64_reads_back_from_what_the_api_server_stores(n: int) -> None:
    stored = q.defaulted(n)
    assert q.whole(stored) == q.whole(str(n)) == q.whole(n) == n
    assert q.defaulted(stored) == stored
    assert stored.rstrip("kMGTPE").isdigit()  # a whole number is written without decimals
    if n and n % 1000 == 0 and n < 10**21:
        assert stored[-1] in "kMGTPE" and not stored[:-1].endswith("000")


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([*sorted(BIN), "k", "M", "G", "T"]))
def test_suffixed_whole_numbers(n: int, suffix: str) -> None:
    mult = 2 ** BIN[suffix] if suffix in BIN else 10 ** DEC[suffix]
    if n * mult <= q.INT64_MAX:
        assert q.whole(f"{n}{suffix}") == n * mult


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**9), st.integers(1, 999))
def test_fractions_are_refused(n: int, milli: int) -> None:
    with pytest.raises(q.QuantityError, match=r"^is not a whole number$"):
        q.whole(f"{n}.{milli:03d}")
    with pytest.raises(q.QuantityError, match=r"^is not a whole number$"):
        q.whole(f"{n * 1000 + milli}m")


def test_node_allocatable_as_the_api_server_writes_it() -> None:
    from vgpu import scheduling as sc

    def node(v: str) -> dict[str, Any]:
        return {"status": {"allocatable": {"nvidia.com/gpu": v}}}

    assert sc.node_allocatable(node("1k")) == 1000  # 125 GPUs split 8 ways: the kubelet's 1000
    assert sc.node_allocatable(node("16")) == 16
    assert sc.node_allocatable(node("x")) == 0 and sc.node_allocatable({}) == -1
