"""Self-signed TLS for the vgpu-scheduler webhook, made by the chart's cert Job (`python -m vgpu_scheduler.certgen`).

The image is Debian minbase + our venv: no openssl binary and no `cryptography` wheel. The
standard library has what is needed: `secrets` (randomness), `pow` (RSA), `hashlib` (SHA-256)
and DER written by hand below, so the Job needs nothing but this image. It makes a CA (RSA 2048,
CA:TRUE) and a serving certificate signed by it (serverAuth; SANs `<svc>`, `<svc>.<ns>`,
`<svc>.<ns>.svc`, `<svc>.<ns>.svc.cluster.local`), stores them in a `kubernetes.io/tls` Secret
(`tls.crt`, `tls.key`, `ca.crt`) and writes the CA into `caBundle` of every webhook of the
MutatingWebhookConfiguration. A Secret whose certificate still has more than `renew_days` left
and names the same hosts is kept (helm upgrade re-runs the Job): only caBundle is re-patched.

Security: the keys come from `secrets` (the OS CSPRNG); the CA's private key is never stored
(nothing else can be signed with it later); the RSA arithmetic here is not constant-time, which
does not matter for a one-shot Job whose timing nobody can observe.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import json
import logging
import math
import secrets
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vgpu_scheduler.certgen")

# --- RSA --------------------------------------------------------------------------------
_SMALL_PRIMES = [p for p in range(3, 2000, 2) if all(p % q for q in range(3, math.isqrt(p) + 1, 2))]


def _probable_prime(n: int, rounds: int = 40) -> bool:
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for _ in range(rounds):
        a = secrets.randbelow(n - 3) + 2
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def _prime(bits: int, e: int) -> int:
    while True:
        # Top two bits set: p*q has exactly 2*bits bits; odd.
        c = secrets.randbits(bits) | (3 << (bits - 2)) | 1
        if math.gcd(c - 1, e) == 1 and _probable_prime(c):
            return c


@dataclass(frozen=True)
class RSAKey:
    n: int
    e: int
    d: int
    p: int
    q: int

    @classmethod
    def generate(cls, bits: int = 2048, e: int = 65537) -> RSAKey:
        while True:
            p, q = _prime(bits // 2, e), _prime(bits // 2, e)
            if p != q:
                break
        lam = math.lcm(p - 1, q - 1)
        return cls(n=p * q, e=e, d=pow(e, -1, lam), p=p, q=q)

    def sign(self, data: bytes) -> bytes:
        """RSASSA-PKCS1-v1_5 with SHA-256 (RFC 8017 §8.2)."""
        k = (self.n.bit_length() + 7) // 8
        digest_info = bytes.fromhex("3031300d060960864801650304020105000420") + hashlib.sha256(data).digest()
        em = b"\x00\x01" + b"\xff" * (k - len(digest_info) - 3) + b"\x00" + digest_info
        return pow(int.from_bytes(em, "big"), self.d, self.n).to_bytes(k, "big")

    def public_der(self) -> bytes:
        """SubjectPublicKeyInfo."""
        rsa_pub = _seq(_int(self.n), _int(self.e))
        return _seq(_seq(_oid("1.2.840.113549.1.1.1"), b"\x05\x00"), _bitstring(rsa_pub))

    def private_pem(self) -> str:
        """PKCS#1 RSAPrivateKey ("RSA PRIVATE KEY")."""
        der = _seq(
            _int(0),
            _int(self.n),
            _int(self.e),
            _int(self.d),
            _int(self.p),
            _int(self.q),
            _int(self.d % (self.p - 1)),
            _int(self.d % (self.q - 1)),
            _int(pow(self.q, -1, self.p)),
        )
        return _pem("RSA PRIVATE KEY", der)


# --- DER (X.690) ----------------------------------------------------------------------
def _tlv(tag: int, body: bytes) -> bytes:
    n = len(body)
    if n < 0x80:
        length = bytes([n])
    else:
        raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
        length = bytes([0x80 | len(raw)]) + raw
    return bytes([tag]) + length + body


def _seq(*parts: bytes) -> bytes:
    return _tlv(0x30, b"".join(parts))


def _set(*parts: bytes) -> bytes:
    return _tlv(0x31, b"".join(parts))


def _int(v: int) -> bytes:
    raw = v.to_bytes(v.bit_length() // 8 + 1, "big", signed=False) if v else b"\x00"
    return _tlv(0x02, raw)


def _oid(dotted: str) -> bytes:
    parts = [int(x) for x in dotted.split(".")]
    body = bytearray([40 * parts[0] + parts[1]])
    for p in parts[2:]:
        chunk = [p & 0x7F]
        p >>= 7
        while p:
            chunk.append(0x80 | (p & 0x7F))
            p >>= 7
        body.extend(reversed(chunk))
    return _tlv(0x06, bytes(body))


def _bitstring(b: bytes) -> bytes:
    return _tlv(0x03, b"\x00" + b)


def _octets(b: bytes) -> bytes:
    return _tlv(0x04, b)


def _utf8(s: str) -> bytes:
    return _tlv(0x0C, s.encode())


def _time(t: datetime.datetime) -> bytes:
    if t.year < 2050:
        return _tlv(0x17, t.strftime("%y%m%d%H%M%SZ").encode())  # UTCTime (RFC 5280 §4.1.2.5)
    return _tlv(0x18, t.strftime("%Y%m%d%H%M%SZ").encode())


def _explicit(n: int, body: bytes) -> bytes:
    return _tlv(0xA0 | n, body)


def _pem(label: str, der: bytes) -> str:
    b64 = base64.b64encode(der).decode()
    lines = [b64[i : i + 64] for i in range(0, len(b64), 64)]
    return f"-----BEGIN {label}-----\n" + "\n".join(lines) + f"\n-----END {label}-----\n"


def _name(cn: str) -> bytes:
    return _seq(_set(_seq(_oid("2.5.4.3"), _utf8(cn))))


def _ext(oid: str, critical: bool, value: bytes) -> bytes:
    return _seq(_oid(oid), *([b"\x01\x01\xff"] if critical else []), _octets(value))


def _ski(key: RSAKey) -> bytes:
    return hashlib.sha1(_int(key.n) + _int(key.e), usedforsecurity=False).digest()


def certificate(
    subject: str,
    key: RSAKey,
    issuer: str,
    issuer_key: RSAKey,
    days: int,
    ca: bool,
    dns_names: tuple[str, ...] = (),
    now: datetime.datetime | None = None,
) -> bytes:
    """An X.509 v3 certificate (DER), sha256WithRSAEncryption."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    sig_alg = _seq(_oid("1.2.840.113549.1.1.11"), b"\x05\x00")
    exts = [
        _ext("2.5.29.19", True, _seq(b"\x01\x01\xff") if ca else _seq()),  # basicConstraints
        # keyUsage (named bits, trailing zeros dropped): keyCertSign+cRLSign | digitalSignature+keyEncipherment
        _ext("2.5.29.15", True, _tlv(0x03, b"\x01\x06" if ca else b"\x05\xa0")),
        _ext("2.5.29.14", False, _octets(_ski(key))),  # subjectKeyIdentifier
        _ext("2.5.29.35", False, _seq(_tlv(0x80, _ski(issuer_key)))),  # authorityKeyIdentifier
    ]
    if not ca:
        exts.append(_ext("2.5.29.37", False, _seq(_oid("1.3.6.1.5.5.7.3.1"))))  # extKeyUsage serverAuth
        exts.append(_ext("2.5.29.17", False, _seq(*(_tlv(0x82, n.encode()) for n in dns_names))))  # SAN dNSName
    tbs = _seq(
        _explicit(0, _int(2)),  # v3
        _int(secrets.randbits(120) | 1 << 120),  # positive serial, 16 bytes
        sig_alg,
        _name(issuer),
        _seq(_time(now - datetime.timedelta(minutes=5)), _time(now + datetime.timedelta(days=days))),
        _name(subject),
        key.public_der(),
        _explicit(3, _seq(*exts)),
    )
    return _seq(tbs, sig_alg, _bitstring(issuer_key.sign(tbs)))


@dataclass(frozen=True)
class TLSFiles:
    cert_pem: str
    key_pem: str
    ca_pem: str


def hosts(service: str, namespace: str) -> list[str]:
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def make(
    service: str, namespace: str, days: int = 3650, bits: int = 2048, now: datetime.datetime | None = None
) -> TLSFiles:
    ca_key, key = RSAKey.generate(bits), RSAKey.generate(bits)
    ca_name = f"{service}-ca"
    ca = certificate(ca_name, ca_key, ca_name, ca_key, days, ca=True, now=now)
    leaf = certificate(
        f"{service}.{namespace}.svc",
        key,
        ca_name,
        ca_key,
        days,
        ca=False,
        dns_names=tuple(hosts(service, namespace)),
        now=now,
    )
    return TLSFiles(cert_pem=_pem("CERTIFICATE", leaf), key_pem=key.private_pem(), ca_pem=_pem("CERTIFICATE", ca))


# --- Kubernetes -------------------------------------------------------------------------
def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


HOSTS_ANNOTATION = "vgpu.k8s.io/cert-hosts"
NOT_AFTER_ANNOTATION = "vgpu.k8s.io/cert-not-after"  # unix seconds


def _still_good(secret: dict[str, Any], names: list[str], renew_days: int, now: float) -> bool:
    """The stored certificate (as its Secret's annotations describe it) names these hosts and
    lives longer than renew_days; a Secret edited by hand without them is renewed."""
    meta = secret.get("metadata") or {}
    ann = meta.get("annotations") or {}
    data = secret.get("data") or {}
    if not all(data.get(k) for k in ("tls.crt", "tls.key", "ca.crt")):
        return False
    if ann.get(HOSTS_ANNOTATION) != ",".join(names):
        return False
    try:
        not_after = float(ann.get(NOT_AFTER_ANNOTATION, ""))
    except ValueError:
        return False
    return not_after - now > renew_days * 86400


def run(
    core: Any,
    admission: Any,
    namespace: str,
    service: str,
    secret: str,
    webhook_config: str,
    days: int = 3650,
    renew_days: int = 30,
) -> str:
    """Ensure the Secret and patch caBundle; returns "created", "renewed" or "kept"."""
    from kubernetes.client.exceptions import ApiException

    names = hosts(service, namespace)
    try:
        cur = core.read_namespaced_secret(secret, namespace, _preload_content=False)
        existing: dict[str, Any] | None = json.loads(cur.data)
    except ApiException as e:
        if e.status != 404:
            raise
        existing = None
    now = datetime.datetime.now(datetime.timezone.utc)
    if existing is not None and _still_good(existing, names, renew_days, now.timestamp()):
        outcome = "kept"
        ca_b64 = (existing.get("data") or {})["ca.crt"]
    else:
        tls = make(service, namespace, days, now=now)
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {
                "name": secret,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/part-of": "k8s-vgpu"},
                "annotations": {
                    HOSTS_ANNOTATION: ",".join(names),
                    NOT_AFTER_ANNOTATION: str(int((now + datetime.timedelta(days=days)).timestamp())),
                },
            },
            "data": {"tls.crt": _b64(tls.cert_pem), "tls.key": _b64(tls.key_pem), "ca.crt": _b64(tls.ca_pem)},
        }
        if existing is None:
            core.create_namespaced_secret(namespace, body)
            outcome = "created"
        else:
            body["metadata"]["resourceVersion"] = existing["metadata"].get("resourceVersion")
            core.replace_namespaced_secret(secret, namespace, body)
            outcome = "renewed"
        ca_b64 = body["data"]["ca.crt"]
    mwc = admission.read_mutating_webhook_configuration(webhook_config)
    ops = [
        {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": ca_b64}
        for i in range(len(mwc.webhooks or []))
    ]
    if ops:
        admission.patch_mutating_webhook_configuration(webhook_config, ops, _content_type="application/json-patch+json")
    return outcome


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vgpu_scheduler.certgen", description="self-signed TLS for the vGPU webhook"
    )
    p.add_argument("--namespace", required=True)
    p.add_argument("--service", required=True, help="the webhook's Service name (certificate hosts)")
    p.add_argument("--secret", required=True, help="kubernetes.io/tls Secret to create or keep")
    p.add_argument("--webhook-config", required=True, help="MutatingWebhookConfiguration whose caBundle is set")
    p.add_argument("--days", type=int, default=3650, help="validity (default 3650)")
    p.add_argument("--renew-days", type=int, default=30, help="renew when fewer days are left (default 30)")
    p.add_argument("--kubeconfig", default=None, help="default: in-cluster, else $KUBECONFIG")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from vgpu import kube

    try:
        api = kube.load(a.kubeconfig or "")
    except kube.KubeConfigError as e:
        print(f"certgen: {e}", file=sys.stderr)
        return 2
    if api is None:
        print("certgen: no Kubernetes API configuration (in-cluster or kubeconfig)", file=sys.stderr)
        return 2
    from kubernetes import client

    try:
        outcome = run(
            client.CoreV1Api(api),
            client.AdmissionregistrationV1Api(api),
            a.namespace,
            a.service,
            a.secret,
            a.webhook_config,
            a.days,
            a.renew_days,
        )
    except Exception as e:  # ApiException (RBAC, missing objects), connection errors
        status = getattr(e, "status", None)
        why = f"HTTP {status} {getattr(e, 'reason', '')}" if status else str(e).splitlines()[0]
        print(f"certgen: {why}", file=sys.stderr)
        return 1
    print(f"certgen: secret {a.namespace}/{a.secret} {outcome}; caBundle of {a.webhook_config} set")
    return 0


if __name__ == "__main__":
    sys.exit(main())
