"""What kube-apiserver does to a Pod between the request and the store, for the API stand-in
(sim/kubeapi.py), written from the v1.36 sources named beside each step and checked
against tests/data/real-traces/{webhook,quantities}:

1. decode: every resource quantity parsed and written back in canonical form (vgpu/quantity.py,
   a port of k8s.io/apimachinery/pkg/api/resource); one that does not parse is a 400;
2. defaulting (pkg/apis/core/v1/defaults.go): SetDefaults_ResourceList rounds each quantity up
   to milli, SetDefaults_Pod copies limits into requests that do not name the resource;
3. mutating admission webhooks (k8s.io/apiserver/pkg/admission/plugin/webhook): the
   MutatingWebhookConfigurations stored in the stand-in, selected by namespaceSelector,
   objectSelector, rules and matchConditions (CEL, evaluated by cel-python), called with
   `POST <path>?timeout=<timeoutSeconds>s` and the headers the recording shows, the answer
   checked as VerifyAdmissionResponse does, failurePolicy applied, the JSONPatch applied and the
   result defaulted again;
4. the name from generateName (after admission: the webhook sees neither name);
5. validation of container resources (pkg/apis/core/validation/validation.go
   validateResourceRequirements): extended resources must be whole, non-negative, and requests
   equal to limits; 422 with the API server's message.

Not modelled: other admission plugins (ServiceAccount's volume, LimitRanger...), reinvocation,
validating webhooks, dry run, the rest of Pod validation and defaulting.
"""

from __future__ import annotations

import base64
import copy
import functools
import http.client
import json
import socket
import ssl
import uuid as uuidlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from vgpu import quantity

Obj = dict[str, Any]

ADMISSION_V1 = "admission.k8s.io/v1"


class AdmissionError(Exception):
    """A Status the API server answers instead of storing the object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


# ----- 1 and 2: decode and defaulting ---------------------------------------------------------


def _containers(pod: Obj) -> list[Obj]:
    spec = pod.get("spec") or {}
    return [c for key in ("initContainers", "containers") for c in (spec.get(key) or []) if isinstance(c, dict)]


@functools.lru_cache(maxsize=4096)
def _stored(text: str) -> str:
    return quantity.defaulted(text)  # pure: the same string always gives the same stored form


def _canonical_list(rl: Any, kind: str) -> None:
    """ResourceList decode (Quantity.UnmarshalJSON), SetDefaults_ResourceList (RoundUp(-3)), encode."""
    if not isinstance(rl, dict):
        return
    for k, v in list(rl.items()):
        try:
            rl[k] = _stored(v) if isinstance(v, str) else quantity.defaulted(v)
        except quantity.QuantityError as e:
            # handlers/rest.go transformDecodeError
            raise AdmissionError(
                400, "BadRequest", f'{kind} in version "v1" cannot be handled as a {kind}: {e}'
            ) from None


def default_pod(pod: Obj) -> None:
    """Decode and default a Pod in place: canonical quantities, requests defaulted from limits."""
    for c in _containers(pod):
        res = c.get("resources")
        if not isinstance(res, dict):
            continue
        _canonical_list(res.get("limits"), "Pod")
        _canonical_list(res.get("requests"), "Pod")
        # SetDefaults_Pod: "If limits are specified, but requests are not, default requests to limits"
        # (an empty map of limits is dropped on decode: omitempty).
        if res.get("limits"):
            req = res.setdefault("requests", {})
            for k, v in res["limits"].items():
                req.setdefault(k, v)
        for key in ("limits", "requests"):
            if key in res and not res[key]:
                del res[key]  # omitempty: the webhook saw no "limits" for `limits: {}` (q-21)


def default_node(node: Obj) -> None:
    status = node.get("status")
    if not isinstance(status, dict):
        return
    _canonical_list(status.get("capacity"), "Node")
    _canonical_list(status.get("allocatable"), "Node")
    # SetDefaults_NodeStatus: allocatable defaults to capacity.
    if "allocatable" not in status and isinstance(status.get("capacity"), dict):
        status["allocatable"] = dict(status["capacity"])


def normalize(plural: str, obj: Obj) -> None:
    """What every write of `plural` goes through (decode + defaulting)."""
    if plural == "pods":
        default_pod(obj)
    elif plural == "nodes":
        default_node(obj)


# ----- 5: validation of container resources ---------------------------------------------------


def _native(name: str) -> bool:
    """helper.IsNativeResource: no domain, or kubernetes.io's."""
    return "/" not in name or "kubernetes.io/" in name


def _integer(name: str) -> bool:
    """helper.IsIntegerResourceName for the names a pod uses: extended resources (not native,
    not `requests.`-prefixed)."""
    return not _native(name) and not name.startswith("requests.")


def _overcommit(name: str) -> bool:
    """helper.IsOvercommitAllowed: native and not hugepages."""
    return _native(name) and not name.startswith("hugepages-")


def validate_pod(pod: Obj) -> None:
    """validateResourceRequirements of every container; AdmissionError 422 as kube-apiserver words it.

    Go walks the maps in random order; here names are sorted. Identical messages are reported
    once (field.ErrorList.ToAggregate).
    """
    errs: list[str] = []
    spec = pod.get("spec") or {}
    for key in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(key) or []):
            res = c.get("resources") or {}
            lim, req = res.get("limits") or {}, res.get("requests") or {}
            path = f"spec.{key}[{i}].resources"
            for part, rl in (("limits", lim), ("requests", req)):
                for name in sorted(rl):
                    q = quantity.parse(rl[name])
                    if q.sign() < 0:
                        errs.append(
                            f'{path}.{part}[{name}]: Invalid value: "{rl[name]}": must be greater than or equal to 0'
                        )
                    if _integer(name) and not q.is_integer():
                        errs.append(f'{path}.{part}[{name}]: Invalid value: "{rl[name]}": must be an integer')
            for name in sorted(req):
                if name in lim:
                    a, b = quantity.parse(req[name]), quantity.parse(lim[name])
                    va, vb = (a.unscaled, a.exp10), (b.unscaled, b.exp10)
                    if _value(va) != _value(vb) and not _overcommit(name):
                        where = f'{path}.requests: Invalid value: "{req[name]}"'
                        errs.append(f"{where}: must be equal to {name} limit of {lim[name]}")
                elif not _overcommit(name):
                    errs.append(f"{path}.limits: Required value: Limit must be set for non overcommitable resources")
    errs = list(dict.fromkeys(errs))
    if errs:
        name = (pod.get("metadata") or {}).get("name", "")
        body = errs[0] if len(errs) == 1 else "[" + ", ".join(errs) + "]"
        raise AdmissionError(422, "Invalid", f'Pod "{name}" is invalid: {body}')


def _value(v: tuple[int, int]) -> tuple[int, int]:
    """(unscaled, exp10) normalised so that equal values compare equal."""
    u, e = v
    if u == 0:
        return 0, 0
    while u % 10 == 0:
        u //= 10
        e += 1
    return u, e


# ----- 3: mutating admission webhooks ---------------------------------------------------------


def label_selector_matches(sel: Obj | None, labels: dict[str, str]) -> bool:
    """metav1.LabelSelectorAsSelector: matchLabels and matchExpressions; an empty selector matches all."""
    if not sel:
        return True
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and k in labels and labels[k] in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


def _rule_matches(rule: Obj, operation: str) -> bool:
    """predicates/rules/rules.go Matcher.Matches for a namespaced `pods` CREATE in core/v1."""

    def either(items: list[str], v: str) -> bool:
        return "*" in items or v in items

    scope = rule.get("scope") or "*"
    return (
        scope in ("*", "Namespaced")
        and either(rule.get("operations") or [], operation)
        and either(rule.get("apiGroups") or [], "")
        and either(rule.get("apiVersions") or [], "v1")
        and any(r in ("*", "pods", "*/*") for r in rule.get("resources") or [])
    )


def match_conditions(conds: list[Obj], obj: Obj, request: Obj, failure_policy: str) -> tuple[bool, str]:
    """matchconditions/matcher.go Match: (call?, error). Any false: not called; an error: the
    failurePolicy decides (Fail: the request is refused; Ignore: not called). `object` is a
    DynType in the webhook CEL environment (plugin/cel/compile.go), i.e. the object's JSON."""
    if not conds:
        return True, ""
    import celpy  # cel-python: a CEL implementation (dev dependency)

    env = celpy.Environment()
    act = {"object": celpy.json_to_cel(obj), "oldObject": None, "request": celpy.json_to_cel(request)}
    errors: list[str] = []
    for c in conds:
        try:
            result = env.program(env.compile(c["expression"])).evaluate(act)
        except Exception as e:  # compile or evaluation error
            errors.append(f"{c['name']}: {e}")
            continue
        if isinstance(result, celpy.CELEvalError) or not isinstance(result, celpy.celtypes.BoolType):
            errors.append(f"{c['name']}: {result}")  # (Go refuses a non-bool expression when it is created)
        elif not result:
            return False, ""  # "If any condition false, skip calling webhook always"
    if errors:
        if failure_policy == "Ignore":
            return False, ""
        return False, "; ".join(errors)
    return True, ""


def verify_admission_response(uid: str, review: Any) -> Obj:
    """request/admissionreview.go VerifyAdmissionResponse (v1, mutating): the checked response;
    ValueError with Go's message otherwise."""
    if not isinstance(review, dict):
        raise ValueError("cannot decode the webhook response")
    r = review.get("response")
    if not isinstance(r, dict):
        raise ValueError("webhook response was absent")
    if r.get("uid") != uid:
        raise ValueError(f'expected response.uid="{uid}", got "{r.get("uid")}"')
    if review.get("apiVersion") != ADMISSION_V1 or review.get("kind") != "AdmissionReview":
        got = f"{review.get('apiVersion')}, Kind={review.get('kind')}"
        raise ValueError(f"expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview, got {got}")
    patch = r.get("patch")
    if patch and r.get("patchType") is None:
        raise ValueError("webhook returned response.patch but not response.patchType")
    if not patch and r.get("patchType") is not None:
        raise ValueError("webhook returned response.patchType but not response.patch")
    if r.get("patchType") is not None and not r["patchType"]:
        raise ValueError('webhook returned invalid response.patchType of ""')
    return r


class Endpoints:
    """Where a webhook's clientConfig.service is served: {(namespace, name): (host, port)}."""

    def __init__(self) -> None:
        self.services: dict[tuple[str, str], tuple[str, int]] = {}


def _post(cc: Obj, timeout_s: int, body: bytes, endpoints: Endpoints) -> Any:
    """POST the AdmissionReview as kube-apiserver does: `<path>?timeout=<N>s` (client-go adds the
    deadline of the webhook's timeoutSeconds, mutating/dispatcher.go), the recorded headers, TLS
    verified against caBundle (ServerName <service>.<namespace>.svc for a service)."""
    if "url" in cc:
        u = urlsplit(cc["url"])
        host, port, server_name, path = u.hostname or "", u.port or 443, u.hostname or "", u.path or "/"
        host_header = u.netloc
    else:
        svc = cc["service"]
        port = int(svc.get("port") or 443)
        server_name = f"{svc['name']}.{svc['namespace']}.svc"
        host, port = endpoints.services[(svc["namespace"], svc["name"])]
        path = svc.get("path") or "/"
        host_header = f"{server_name}:{int(svc.get('port') or 443)}"
    ctx = ssl.create_default_context()
    if cc.get("caBundle"):
        ctx.load_verify_locations(cadata=base64.b64decode(cc["caBundle"]).decode())
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        tls = ctx.wrap_socket(sock, server_hostname=server_name)
        head = (
            f"POST {path}?timeout={timeout_s}s HTTP/1.1\r\n"
            f"Host: {host_header}\r\n"
            "User-Agent: kube-apiserver-admission\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Accept: application/json, */*\r\n"
            "Content-Type: application/json\r\n"
            "Accept-Encoding: gzip\r\n\r\n"
        )
        tls.sendall(head.encode() + body)
        resp = http.client.HTTPResponse(tls)
        resp.begin()
        data = resp.read()
    finally:
        sock.close()
    if not 200 <= resp.status < 300:
        raise OSError(f"the server answered {resp.status}: {data[:200]!r}")
    return json.loads(data)


def admission_review(pod: Obj, namespace: str) -> Obj:
    """The AdmissionReview v1 request, field for field as recorded (webhook/*.json)."""
    gvk = {"group": "", "version": "v1", "kind": "Pod"}
    gvr = {"group": "", "version": "v1", "resource": "pods"}
    req: Obj = {"uid": str(uuidlib.uuid4()), "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr}
    name = (pod.get("metadata") or {}).get("name")
    if name:
        req["name"] = name  # absent for generateName (d-job-created-pod-generateName.json)
    req.update(
        {
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "admin", "uid": "admin", "groups": ["system:masters", "system:authenticated"]},
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"},
        }
    )
    return {"kind": "AdmissionReview", "apiVersion": ADMISSION_V1, "request": req}


def mutate(
    pod: Obj,
    namespace: str,
    configs: list[Obj],
    namespace_labels: dict[str, str],
    endpoints: Endpoints,
    apply_patch: Callable[[Any, list[Obj]], Any],
    calls: list[Obj] | None = None,
) -> Obj:
    """mutating/dispatcher.go Dispatch for one Pod CREATE: the mutated pod, or AdmissionError."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    for cfg in sorted(configs, key=lambda c: c["metadata"]["name"]):
        for hook in cfg.get("webhooks") or []:
            if not label_selector_matches(hook.get("namespaceSelector"), namespace_labels):
                continue
            if not label_selector_matches(hook.get("objectSelector"), labels):
                continue
            if not any(_rule_matches(r, "CREATE") for r in hook.get("rules") or []):
                continue
            policy = hook.get("failurePolicy") or "Fail"  # v1 default
            review = admission_review(pod, namespace)
            call, err = match_conditions(hook.get("matchConditions") or [], pod, review["request"], policy)
            if err:
                raise AdmissionError(403, "Forbidden", f"pods is forbidden: {err}")
            if not call:
                continue
            timeout_s = int(hook.get("timeoutSeconds") or 10)
            # The encoder adds a newline: the recorded Content-Length is the compact JSON + 1.
            body = json.dumps(review, separators=(",", ":")).encode() + b"\n"
            if calls is not None:
                calls.append(review)
            uid = review["request"]["uid"]
            try:
                r = verify_admission_response(uid, _post(hook["clientConfig"], timeout_s, body, endpoints))
                if r.get("allowed") is not True:
                    st = r.get("status") or {}
                    denied = f'admission webhook "{hook["name"]}" denied the request'
                    msg = st.get("message") or st.get("reason")
                    code = max(int(st.get("code") or 0), 400)  # errors/statuserror.go ToStatusErr
                    raise AdmissionError(
                        code, st.get("reason") or "", f"{denied}: {msg}" if msg else f"{denied} without explanation"
                    )
                if r.get("patch"):
                    ops = json.loads(base64.b64decode(r["patch"]))
                    pod = apply_patch(copy.deepcopy(pod), ops)
                    default_pod(pod)  # o.GetObjectDefaulter().Default(attr.VersionedObject)
            except AdmissionError:
                raise
            except (OSError, ValueError, KeyError, http.client.HTTPException) as e:
                if policy == "Ignore":
                    continue  # "failing open"
                raise AdmissionError(
                    500, "InternalError", f'Internal error occurred: failed calling webhook "{hook["name"]}": {e}'
                ) from None
    return pod
