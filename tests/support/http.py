"""JSON over HTTP as kube-scheduler, kube-apiserver or kubectl send it to the servers under test."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any


def post_json(url: str, body: Any, *, timeout: float = 10.0, context: ssl.SSLContext | None = None) -> tuple[int, Any]:
    """POST `body` as JSON (bytes or str: sent as they are); (status, decoded answer), errors too."""
    data = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_ok(url: str, body: Any, **kw: Any) -> Any:
    """post_json's answer, asserting 200."""
    status, out = post_json(url, body, **kw)
    assert status == 200, (status, out)
    return out
