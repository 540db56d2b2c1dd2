"""Kubernetes resource quantities, read exactly as the API server reads them.

A port of k8s.io/apimachinery/pkg/api/resource (quantity.go `ParseQuantity`,
`parseQuantityString`, `CanonicalizeBytes`, `RoundUp`; suffix.go; amount.go; math.go), v0.36 as
vendored by Kubernetes 1.36. `parse` gives the exact value ParseQuantity holds, `canonical` the
string the API server writes back (`Quantity.String` / `MarshalJSON`), `defaulted` what the Pod
defaulting does to every ResourceList entry (`SetDefaults_ResourceList`: RoundUp to milli) and
`whole` the whole number the scheduler needs, with one error text for webhook and extender.

Why it matters: the API server stores `nvidia.com/gpumem: 3000` as "3k", 1000 as "1k", and keeps
"4096", "4Gi" and "1e3" as written (tests/data/real-traces/quantities/quantities.json).

A value is `unscaled * 10**exp10` (Go keeps an int64 with a base-10 scale, or an inf.Dec for
what does not fit; the arithmetic here is exact Python ints, with Go's int32 wrap-around where Go
has it). One deviation: where ParseQuantity's slow path would build a power of ten of more than
MAX_DIGITS digits (e.g. "123456789012345678901e99999", or "5e-2147483648", whose exponent wraps
around to +2**31, or "0e-2147483648" once the defaulting rounds it), or the number has more than
MAX_DIGITS digits, it is refused here with ERR_RANGE; the API server would spend its memory and
time on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fractions import Fraction

DECIMAL_EXPONENT = "DecimalExponent"  # 12e6
BINARY_SI = "BinarySI"  # 12Mi
DECIMAL_SI = "DecimalSI"  # 12M

# quantity.go: the three errors ParseQuantity returns, word for word.
SPLIT_RE = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
ERR_FORMAT = f"quantities must match the regular expression '{SPLIT_RE}'"
ERR_NUMERIC = "unable to parse numeric part of quantity"
ERR_SUFFIX = "unable to parse quantity's suffix"

INT64_MAX = (1 << 63) - 1
MAX_DIGITS = 4096  # see the module docstring
ERR_RANGE = f"quantity out of range (more than {MAX_DIGITS} digits)"  # ours, not Go's

# suffix.go newSuffixer: decimal and binary suffixes (base 10 or 2, exponent).
_DEC = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BIN = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DEC_BY_EXP = {e: s for s, e in _DEC.items()}
_BIN_BY_EXP = {e: s for s, e in _BIN.items()}
_SUFFIX_CHARS = frozenset(b"eEinumkKMGTP")
_DIGITS = frozenset(b"0123456789")
# Go's unicode.IsSpace (strings.TrimSpace in Quantity.UnmarshalJSON).
_GO_SPACE = (
    "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)


class QuantityError(ValueError):
    """Not a quantity, or not the whole number asked for; str() completes "<key>=<value> ..."."""


def _i32(v: int) -> int:
    """Go's int32 conversion and int32 arithmetic: two's complement wrap-around."""
    return ((v + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)


def _gomod(a: int, b: int) -> int:
    """Go's % (truncated: the sign of the dividend)."""
    r = abs(a) % b
    return -r if a < 0 else r


@dataclass(frozen=True, slots=True)
class Quantity:
    unscaled: int  # value = unscaled * 10**exp10
    exp10: int
    format: str
    big: bool = False  # held as inf.Dec (ParseQuantity's slow path), else int64Amount
    cached: str = ""  # ParseQuantity's `s`: the input kept as the output when it was canonical

    def sign(self) -> int:
        return (self.unscaled > 0) - (self.unscaled < 0)

    def is_integer(self) -> bool:
        if self.exp10 >= 0 or self.unscaled == 0:
            return True
        return self.unscaled % 10 ** (-self.exp10) == 0

    def to_int(self) -> int | None:
        """The value when it is a whole number of at most 19 digits; None otherwise."""
        if not self.is_integer():
            return None
        if self.unscaled == 0:
            return 0
        if self.exp10 >= 0:
            if self.exp10 > 19:
                return None
            return self.unscaled * 10**self.exp10
        return self.unscaled // 10 ** (-self.exp10)


def _scan(s: bytes) -> tuple[bool, bytes, bytes, bytes, bytes]:
    """quantity.go parseQuantityString: (positive, value, num, denom, suffix); QuantityError(ERR_FORMAT)."""
    positive = True
    pos = 0
    end = len(s)
    if pos < end:
        if s[0] == ord("-"):
            positive = False
            pos += 1
        elif s[0] == ord("+"):
            pos += 1
    # strip leading zeros
    i = pos
    while True:
        if i >= end:
            return positive, b"0", b"0", b"", b""
        if s[i] != ord("0"):
            break
        pos += 1
        i += 1
    # the numerator
    i = pos
    while True:
        if i >= end:
            return positive, s[:end], s[pos:end], b"", b""
        if s[i] not in _DIGITS:
            num = s[pos:i]
            pos = i
            break
        i += 1
    if not num:
        num = b"0"
    denom = b""
    if pos < end and s[pos] == ord("."):
        pos += 1
        i = pos
        while True:
            if i >= end:
                return positive, s[:end], num, s[pos:end], b""
            if s[i] not in _DIGITS:
                denom = s[pos:i]
                pos = i
                break
            i += 1
    value = s[:pos]
    # the suffix: letters of the suffix alphabet, an optional sign, digits
    start = pos
    i = pos
    while True:
        if i >= end:
            return positive, value, num, denom, s[start:end]
        if s[i] not in _SUFFIX_CHARS:
            pos = i
            break
        i += 1
    if pos < end and s[pos] in b"-+":
        pos += 1
    i = pos
    while True:
        if i >= end:
            return positive, value, num, denom, s[start:end]
        if s[i] not in _DIGITS:
            break
        i += 1
    raise QuantityError(ERR_FORMAT)


def _parse_int64(b: bytes) -> int | None:
    """strconv.ParseInt(b, 10, 64): optional sign, at least one digit, in range; None on error."""
    digits = b[1:] if b[:1] in (b"+", b"-") else b
    if not digits or any(c not in _DIGITS for c in digits):
        return None
    v = int(b)
    return v if -(1 << 63) <= v <= INT64_MAX else None


def _interpret(suffix: bytes) -> tuple[int, int, str]:
    """suffix.go fastLookup/suffixHandler.interpret: (base, exponent, format); QuantityError(ERR_SUFFIX)."""
    text = suffix.decode("ascii")  # _scan admits ASCII only into the suffix
    if text in _DEC:
        return 10, _DEC[text], DECIMAL_SI
    if text in _BIN:
        return 2, _BIN[text], BINARY_SI
    if len(text) > 1 and text[0] in "eE":
        parsed = _parse_int64(suffix[1:])
        if parsed is None:
            raise QuantityError(ERR_SUFFIX)
        return 10, _i32(parsed), DECIMAL_EXPONENT
    raise QuantityError(ERR_SUFFIX)


def _inf_scan(value: bytes) -> tuple[int, int]:
    """inf.v0 Dec.SetString: (unscaled, scale) for [sign]digits[.digits]; QuantityError(ERR_NUMERIC)."""
    body = value[1:] if value[:1] in (b"+", b"-") else value
    whole_part, dot, frac = body.partition(b".")
    if (not whole_part and not frac) or any(c not in _DIGITS for c in whole_part + frac):
        raise QuantityError(ERR_NUMERIC)
    if len(whole_part) + len(frac) > MAX_DIGITS:
        raise QuantityError(ERR_RANGE)  # see the module docstring
    unscaled = int(whole_part + frac or b"0")
    return (-unscaled if value[:1] == b"-" else unscaled), len(frac) if dot else 0


def parse(text: str) -> Quantity:
    """quantity.go ParseQuantity(text); QuantityError with Go's message when it fails."""
    if not text:
        raise QuantityError(ERR_FORMAT)
    if text == "0":
        return Quantity(0, 0, DECIMAL_SI, cached="0")
    raw = text.encode("utf-8", "surrogatepass")  # Go indexes bytes
    positive, value, num, denom, suf = _scan(raw)
    base, exponent, fmt = _interpret(suf)

    precision = 0
    scale = 0
    mantissa = 1
    if fmt in (DECIMAL_EXPONENT, DECIMAL_SI):
        scale = exponent
        precision = 18 - (len(num) + len(denom))  # maxInt64Factors
    elif exponent >= 0 and not denom:  # BinarySI: only whole positive numbers take the fast path
        mantissa = 1 << exponent
        precision = 15 - len(num) - exponent * 3 // 10 - 1
    else:
        precision = -1

    if precision >= 0:
        scale = _i32(scale - len(denom))
        if scale >= -9:  # Nano
            shifted = num + denom
            v = int(shifted)
            result = v * mantissa
            if result <= INT64_MAX:  # int64Multiply
                if not positive:
                    result = -result
                keep = ""
                if fmt == BINARY_SI:
                    if exponent % 10 == 0 and v & 0x07 != 0:
                        keep = text
                elif scale % 3 == 0 and not shifted.endswith(b"000") and shifted[:1] != b"0":
                    keep = text
                return Quantity(result, scale, fmt, cached=keep)

    # The slow path: an inf.Dec.
    unscaled, inf_scale = _inf_scan(value)
    if base == 10:
        inf_scale = _i32(inf_scale + _i32(-exponent))  # SetScale(Scale() + Scale(exponent).infScale())
    else:
        unscaled *= 1 << exponent
    sign = -1 if unscaled < 0 else 1
    unscaled = abs(unscaled)
    if abs(inf_scale) > MAX_DIGITS or len(str(unscaled)) + 9 - inf_scale > MAX_DIGITS:
        # Go would spell out a power of ten this long: when rounding to nano here, or (a zero
        # too) when the defaulting rounds to milli (RoundUp) before the object is stored.
        raise QuantityError(ERR_RANGE)
    if unscaled != 0:
        # Round up (away from zero) to nano: the smallest amount asked for is never 0.
        if inf_scale > 9:
            drop = inf_scale - 9
            if drop > len(str(unscaled)):
                unscaled = 1
            else:
                q, r = divmod(unscaled, 10**drop)
                unscaled = q + (1 if r else 0)
            inf_scale = 9
    if fmt == BINARY_SI:
        # (base 2: inf_scale is the number of decimals, 0..9 here)
        if unscaled > INT64_MAX * 10**inf_scale:
            unscaled, inf_scale = INT64_MAX, 0  # the cap (maxAllowed)
        if 0 < unscaled < 10**inf_scale:
            fmt = DECIMAL_SI  # between 0 and 1: no binary suffix could show it
    return Quantity(sign * unscaled, -inf_scale, fmt, big=True)


def parse_json(value: object) -> Quantity:
    """Quantity.UnmarshalJSON of what a JSON decoder gave: a string (trimmed), a number (its JSON
    text), or null (the zero quantity); QuantityError otherwise."""
    if value is None:
        return Quantity(0, 0, "")
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (int, float)):
        text = repr(value) if isinstance(value, float) else str(value)
    elif isinstance(value, str):
        text = value.strip(_GO_SPACE)
    else:
        raise QuantityError(ERR_FORMAT)
    return parse(text)


def _strip(v: int, base: int) -> tuple[int, int]:
    """math.go removeInt64Factors / removeBigIntFactors: (v / base**n, n) for the largest n."""
    neg = v < 0
    v = abs(v)
    n = 0
    while v >= base and v % base == 0:
        v //= base
        n += 1
    return (-v if neg else v), n


def _round_away(unscaled: int, drop: int) -> tuple[int, bool]:
    """unscaled / 10**drop rounded away from zero (negativeScaleInt64, inf.RoundUp); (result, exact)."""
    if drop <= 0:
        return unscaled * 10 ** (-drop), True
    neg = unscaled < 0
    a = abs(unscaled)
    q, r = (0, a) if drop > len(str(a)) else divmod(a, 10**drop)
    if r:
        q += 1
    return (-q if neg else q), r == 0


def _decimal(q: Quantity, fmt: str) -> str:
    """AsCanonicalBytes + constructBytes(10, exponent, fmt): mantissa with the exponent a multiple of 3."""
    amount, times = _strip(q.unscaled, 10)
    exponent = _i32(_i32(q.exp10) + times)
    m = _gomod(exponent, 3)
    if m in (1, -2):
        amount *= 10
        exponent = _i32(exponent - 1)
    elif m in (2, -1):
        amount *= 100
        exponent = _i32(exponent - 2)
    if fmt == DECIMAL_SI:
        suffix = _DEC_BY_EXP.get(exponent, "")  # no such suffix: none is written (as Go does)
    else:
        suffix = f"e{exponent}" if exponent else ""
    return f"{amount}{suffix}"


def canonical(q: Quantity) -> str:
    """Quantity.String() / MarshalJSON: the kept input, else the canonical form (CanonicalizeBytes)."""
    if q.cached:
        return q.cached
    if q.unscaled == 0:
        return "0"
    fmt = q.format
    if fmt not in (DECIMAL_EXPONENT, DECIMAL_SI, BINARY_SI):
        fmt = DECIMAL_EXPONENT
    if fmt == BINARY_SI:
        # Bounded: ParseQuantity caps a BinarySI value at int64.
        if abs(q.unscaled) < 1024 * 10 ** max(0, -q.exp10) // 10 ** max(0, q.exp10):
            fmt = DECIMAL_SI  # -1024 < value < 1024: "avoids rounding and hopefully confusion"
        else:
            int_part, exact = _round_away(q.unscaled, -q.exp10)  # AsScale(0)
            if not exact:
                fmt = DECIMAL_SI  # "don't lose precision"
            else:
                amount, times = _strip(int_part, 1024)  # AsCanonicalBase1024Bytes
                return f"{amount}{_BIN_BY_EXP.get(times * 10, '')}"
    return _decimal(q, fmt)


def round_up(q: Quantity, scale: int = -3) -> Quantity:
    """Quantity.RoundUp(scale): the value rounded away from zero to 10**scale; the kept input is
    dropped when the value's scale changes (int64Amount) and always for an inf.Dec."""
    if not q.big and q.exp10 >= scale:
        return q
    if q.exp10 >= scale:
        return replace(q, cached="")
    unscaled, _ = _round_away(q.unscaled, scale - q.exp10)
    return replace(q, unscaled=unscaled, exp10=scale, cached="")


def defaulted(value: object) -> str:
    """What the API server stores for a ResourceList entry sent as `value` (decode, RoundUp(-3), encode)."""
    return canonical(round_up(parse_json(value), -3))


def whole(value: object) -> int:
    """The whole, non-negative number a resource quantity stands for (as the API server stores it).

    QuantityError's text completes "<key>=<value> ...": "is not a whole number", "is negative",
    "is too large", or why it is not a quantity. The webhook and the extender both say it.
    """
    try:
        q = round_up(parse_json(value), -3)
    except QuantityError as e:
        raise QuantityError(f"is not a Kubernetes quantity ({e})") from None
    if q.sign() < 0:
        raise QuantityError("is negative")
    n = q.to_int()
    if n is None:
        raise QuantityError("is too large" if q.is_integer() else "is not a whole number")
    if n > INT64_MAX:
        raise QuantityError("is too large")
    return n


def exact(q: Quantity) -> Fraction:
    """The exact value of a parsed quantity (for comparisons: "16Gi" equals "17179869184")."""
    from fractions import Fraction  # only where exact values are compared (DRA capacities)

    return Fraction(q.unscaled) * Fraction(10) ** q.exp10


def value(text: str) -> int:
    """quantity.go `Quantity.Value()` of a quantity string: its value rounded up to an integer,
    away from zero (`ScaledValue(0)`); QuantityError when it is not a quantity."""
    q = parse(text)
    if q.exp10 >= 0:
        if q.exp10 > MAX_DIGITS:
            raise QuantityError(ERR_RANGE)
        return q.unscaled * 10**q.exp10
    return _round_away(q.unscaled, -q.exp10)[0]


def format_binary(n: int) -> str:
    """The text the API server stores for the integer n held as BinarySI (CanonicalizeBytes):
    the largest exact power of 1024 (Ki ... Ei), below 1024 DecimalSI, else the plain number."""
    return canonical(Quantity(n, 0, BINARY_SI))


def format_decimal(n: int) -> str:
    """The text the API server stores for the integer n held as DecimalSI: the largest exact
    suffix of k, M, G, T, P, E."""
    return canonical(Quantity(n, 0, DECIMAL_SI))
