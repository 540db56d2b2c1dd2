"""vgpu.quantity as the DRA plugin uses it (exact values, `Quantity.Value()`, the canonical texts
of the integers it publishes) against the recorded kube-apiserver (K3: what it stored for each
quantity it was sent) and against the kubernetes client's own parser."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.utils.quantity import parse_quantity

from tests.support import traces
from vgpu import quantity


def exact(text: str) -> Fraction:
    return quantity.exact(quantity.parse(text))


CASES = traces.load_json("quantities/quantities.json")["cases"]


def _sent_and_stored() -> list[tuple[object, str]]:
    out = []
    for c in CASES:
        if c["http_status"] != 201:
            continue
        sent = json.loads(c["sent_resources_json"])["limits"]
        for key, stored in c["stored_limits"].items():
            out.append((sent[key], stored))
    return out


@pytest.mark.parametrize(("sent", "stored"), _sent_and_stored())
def test_value_of_what_was_sent_is_the_value_the_api_server_stored(sent: object, stored: str) -> None:
    text = sent if isinstance(sent, str) else json.dumps(sent)
    assert exact(text) == exact(stored)


def _integers_sent() -> list[tuple[object, str]]:
    """The cases in a form we write ourselves: integers in DecimalSI or BinarySI. "1e3" keeps its
    exponent form (DecimalExponent) and "0.5" is not an integer: neither is ever written by us."""
    out = []
    for sent, stored in _sent_and_stored():
        text = sent if isinstance(sent, str) else json.dumps(sent)
        if "e" not in text.lower() and exact(text).denominator == 1:
            out.append((sent, stored))
    return out


def test_the_integer_cases_are_most_of_the_trace() -> None:
    assert len(_integers_sent()) >= len(_sent_and_stored()) - 2


@pytest.mark.parametrize(("sent", "stored"), _integers_sent())
def test_canonical_text_is_what_the_api_server_stored(sent: object, stored: str) -> None:
    # A number (JSON) or a suffix-less string is DecimalSI, "Gi"/"Mi" strings are BinarySI.
    text = sent if isinstance(sent, str) else json.dumps(sent)
    v = exact(text)
    fmt = quantity.format_binary if text.endswith("i") else quantity.format_decimal
    assert fmt(int(v)) == stored


def test_rejected_texts() -> None:
    for bad in ("", "abc", "1Q", "1.5.3", "1e", "1Gb", "1 Gi"):
        with pytest.raises(quantity.QuantityError):
            quantity.parse(bad)
    # parseQuantityString takes a missing number as 0 ("Gi", "+", "."), and so do we.
    assert exact("Gi") == exact("+") == exact(".") == 0


def test_value_rounds_up_as_quantity_value() -> None:
    assert quantity.value("500m") == 1
    assert quantity.value("1500m") == 2
    assert quantity.value("6Gi") == 6 << 30
    assert quantity.value("6G") == 6_000_000_000
    assert quantity.value("1.5Gi") == 3 << 29


@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(["", "m", "k", "M", "G", "Ki", "Mi", "Gi", "Ti", "e3", "E2", "n", "u"]),
    st.sampled_from(["", ".5", ".25"]),
)
def test_parse_matches_the_kubernetes_client(n: int, suffix: str, frac: str) -> None:
    text = f"{n}{frac}{suffix}"
    # ParseQuantity rounds up to nano (quantity.go: "the smallest amount asked for is never 0");
    # the client's parser keeps "0.5n" exact.
    client = Fraction(Decimal(parse_quantity(text)))
    assert exact(text) == Fraction(math.ceil(client * 10**9), 10**9)


@given(st.integers(min_value=0, max_value=1 << 62))
def test_formats_round_trip(n: int) -> None:
    assert quantity.value(quantity.format_binary(n)) == n
    assert quantity.value(quantity.format_decimal(n)) == n
