"""JSON without the `json` package: the C scanner and string encoder of `_json`, directly.

The OCI hook runs for every container on the node; `import json` pulls in `re` (~7 ms on a
node's python3), more than the hook's own work. This module imports nothing but `_json`, and
decodes and encodes the documents of our on-disk contracts (vgpu.schemas) and the OCI state and
config the hook reads. Daemons use it too: one reader and one writer for every contract file.
"""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` imports `re`: keep it off the hook's path
if TYPE_CHECKING:
    from typing import Any


class Malformed(ValueError):
    """Not a JSON document; the message is a short reason."""


def _const(name: str) -> Any:
    raise Malformed(f"non-standard JSON constant {name}")


def _make_loads() -> Any:
    try:
        import _json  # the C accelerator; no `re`, no json package

        class _Ctx:
            strict = True
            object_hook = None
            object_pairs_hook = None
            parse_float = float
            parse_int = int
            parse_constant = staticmethod(_const)
            memo: dict[str, str] = {}

        scan = _json.make_scanner(_Ctx())  # type: ignore[arg-type]
    except Exception:  # pragma: no cover - interpreters without _json
        import json

        return json.loads

    ws = " \t\n\r"

    def loads(text: str) -> Any:
        n = len(text)
        i = 0
        while i < n and text[i] in ws:
            i += 1
        try:
            obj, end = scan(text, i)
        except (RecursionError, Malformed):
            raise
        except Exception:
            # Error path only: the C scanner reports errors through json.decoder's
            # JSONDecodeError and raises SystemError when that module is not
            # loaded yet.  Let the json package produce the real message.
            import json

            json.loads(text)
            raise Malformed(f"no JSON value at offset {i}") from None
        while end < n and text[end] in ws:
            end += 1
        if end != n:
            raise Malformed(f"extra data at offset {end}")
        return obj

    return loads


_loads = _make_loads()


def loads(data: bytes) -> Any:
    """Decode JSON bytes; raises Malformed (a ValueError) with a short reason."""
    try:
        return _loads(data.decode("utf-8"))
    except Malformed:
        raise
    except RecursionError:
        raise Malformed("JSON nested too deeply") from None
    except (ValueError, TypeError) as e:  # UnicodeDecodeError, JSONDecodeError
        raise Malformed(str(e).split("\n", 1)[0][:120]) from None


def _make_quote() -> Any:
    try:
        from _json import encode_basestring_ascii

        return encode_basestring_ascii
    except ImportError:  # pragma: no cover
        from json.encoder import py_encode_basestring_ascii

        return py_encode_basestring_ascii


_quote = _make_quote()


def _encode(obj: object, out: list[str]) -> None:
    t = type(obj)
    if t is str:
        out.append(_quote(obj))
    elif t is bool:
        out.append("true" if obj else "false")
    elif t is int:
        out.append(int.__repr__(obj))  # type: ignore[arg-type]
    elif t is float:
        if obj != obj or obj in (float("inf"), float("-inf")):
            raise ValueError(f"not a JSON number: {obj!r}")
        out.append(float.__repr__(obj))  # type: ignore[arg-type]
    elif obj is None:
        out.append("null")
    elif t is dict:
        out.append("{")
        first = True
        for k, v in obj.items():  # type: ignore[attr-defined]
            if type(k) is not str:
                raise TypeError(f"JSON object keys must be str, not {type(k).__name__}")
            if not first:
                out.append(",")
            first = False
            out.append(_quote(k))
            out.append(":")
            _encode(v, out)
        out.append("}")
    elif t is list or t is tuple:
        out.append("[")
        for i, v in enumerate(obj):  # type: ignore[arg-type]
            if i:
                out.append(",")
            _encode(v, out)
        out.append("]")
    else:
        raise TypeError(f"cannot encode {t.__name__} as JSON")


def dumps(obj: object) -> bytes:
    """Compact JSON (no spaces, ASCII, keys in the order given) of dicts, lists, str, int,
    float, bool and None; NaN and infinities are refused."""
    out: list[str] = []
    _encode(obj, out)
    return "".join(out).encode()
