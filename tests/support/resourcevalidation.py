"""A model of kube-apiserver's validation of `resource.k8s.io/v1` ResourceSlice and DeviceClass
objects (Kubernetes v1.36), for the objects our DRA plugin and chart produce. NOT the API server.

Written from pkg/apis/resource/validation/validation.go (ValidateResourceSlice,
validateResourceSliceSpec, validateResourcePool, validateDevice, validateDeviceAttribute,
validateMultiAllocatableDeviceCapacity / validateSingleAllocatableDeviceCapacity,
validateRequestPolicy, validateRequestPolicyRange(Step), validateRequestPolicyValidValues,
validateQualifiedName, validateCIdentifier, ValidateDeviceClass, validateDeviceClassSpec) and the
limits in staging/src/k8s.io/api/resource/v1/types.go; helpers from
pkg/apis/core/validation/validation.go (ValidateCSIDriverName) and
pkg/apis/core/v1/helper/helpers.go (IsExtendedResourceName). Each check names its origin.
Not modelled: CEL compilation of selectors (only presence and length), taints, counters,
binding conditions, per-device node selection (our objects use none of them).
`validate(obj)` returns the errors as "path: message" (empty: valid).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from vgpu import quantity

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # content.IsCIdentifier
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")  # validation.IsQualifiedName
# validation.go semverRe
_NUM = r"(0|[1-9]\d*)"
_PRE = r"(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
_BUILD = r"[0-9a-zA-Z-]+"
_SEMVER = re.compile(rf"{_NUM}\.{_NUM}\.{_NUM}(-{_PRE}(\.{_PRE})*)?(\+{_BUILD}(\.{_BUILD})*)?")

MAX_DEVICES = 128  # ResourceSliceMaxDevices
MAX_ATTRS_AND_CAPS = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
MAX_ATTR_VALUE = 64  # DeviceAttributeMaxValueLength
MAX_DOMAIN = 63  # DeviceMaxDomainLength
MAX_ID = 32  # DeviceMaxIDLength
POOL_NAME_MAX = 253  # PoolNameMaxLength
MAX_VALID_VALUES = 10  # CapacityRequestPolicyDiscreteMaxOptions
MAX_SELECTORS = 32  # DeviceSelectorsMaxSize
CEL_MAX_LENGTH = 10 * 1024  # CELSelectorExpressionMaxLength


def _subdomain(s: Any) -> bool:
    return isinstance(s, str) and 0 < len(s) <= 253 and bool(_DNS1123_SUBDOMAIN.fullmatch(s))


def _label(s: Any) -> bool:
    return isinstance(s, str) and 0 < len(s) <= 63 and bool(_DNS1123_LABEL.fullmatch(s))


def _driver_name(s: Any, path: str, errs: list[str]) -> None:
    # ValidateCSIDriverName: required, at most 63, DNS-1123 subdomain of the lower-cased name.
    if not isinstance(s, str) or not s:
        errs.append(f"{path}: Required value")
        return
    if len(s) > 63:
        errs.append(f"{path}: Too long: may not be more than 63 bytes")
    if not _subdomain(s.lower()):
        errs.append(f"{path}: Invalid value: {s!r}: a lowercase RFC 1123 subdomain")


def _qty(v: Any, path: str, errs: list[str]) -> Fraction | None:
    try:
        return quantity.exact(quantity.parse(v))
    except (quantity.QuantityError, TypeError):
        errs.append(f"{path}: Invalid value: {v!r}: not a quantity")
        return None


def _qualified_name(name: str, path: str, errs: list[str]) -> None:
    # validateQualifiedName: "<C identifier>" or "<driver name>/<C identifier>"; key length
    # at most DeviceMaxDomainLength + 1 + DeviceMaxIDLength (validateMap truncateKeyLen).
    if len(name) > MAX_DOMAIN + 1 + MAX_ID:
        errs.append(f"{path}: Too long")
    parts = name.split("/")
    ident = parts[-1]
    if len(parts) == 2:
        if not parts[0]:
            errs.append(f"{path}: the domain must not be empty")
        else:
            _driver_name(parts[0], path, errs)
    if not ident:
        errs.append(f"{path}: the name must not be empty")
        return
    if len(ident) > MAX_ID:
        errs.append(f"{path}: Too long: may not be more than {MAX_ID} bytes")
    if not _C_IDENTIFIER.fullmatch(ident):
        errs.append(f"{path}: Invalid value: {ident!r}: a valid C identifier")


def _attribute(attr: Any, path: str, errs: list[str]) -> None:
    # validateDeviceAttribute: exactly one of int, bool, string, version (+ list forms).
    if not isinstance(attr, dict):
        errs.append(f"{path}: Invalid value: not an object")
        return
    known = ("int", "bool", "string", "version", "ints", "bools", "strings", "versions")
    unknown = [k for k in attr if k not in known]
    if unknown:
        errs.append(f"{path}: unknown field {unknown[0]!r}")
    set_fields = [k for k in known if attr.get(k) is not None]
    if len(set_fields) != 1:
        errs.append(f"{path}: Invalid value: exactly one value must be specified")
    if "int" in attr and not (isinstance(attr["int"], int) and not isinstance(attr["int"], bool)):
        errs.append(f"{path}.int: Invalid value: not an integer")
    if "bool" in attr and not isinstance(attr["bool"], bool):
        errs.append(f"{path}.bool: Invalid value: not a boolean")
    if "string" in attr:
        if not isinstance(attr["string"], str):
            errs.append(f"{path}.string: Invalid value: not a string")
        elif len(attr["string"]) > MAX_ATTR_VALUE:
            errs.append(f"{path}.string: Too long: may not be more than {MAX_ATTR_VALUE} bytes")
    if "version" in attr:
        v = attr["version"]
        if not isinstance(v, str) or not _SEMVER.fullmatch(v):
            errs.append(f"{path}.version: Invalid value: {v!r}: must be a string compatible with semver.org spec 2.0.0")
        elif len(v) > MAX_ATTR_VALUE:
            errs.append(f"{path}.version: Too long")


def _policy(capacity: Fraction, policy: Any, path: str, errs: list[str]) -> None:
    # validateRequestPolicy / validateValidRequestValues / validateRequestPolicyRange(Step)
    if not isinstance(policy, dict):
        errs.append(f"{path}: Invalid value: not an object")
        return
    valid_values, valid_range = policy.get("validValues"), policy.get("validRange")
    default = _qty(policy["default"], f"{path}.default", errs) if policy.get("default") is not None else None
    if valid_values and valid_range is not None:
        errs.append(
            f'{path}: Forbidden: exactly one policy can be specified, cannot specify "validValues" and "validRange"'
        )
        return
    if valid_values:
        if default is None:
            errs.append(f"{path}.default: Required value: required when validValues is defined")
            return
        vals = [_qty(v, f"{path}.validValues[{i}]", errs) for i, v in enumerate(valid_values)]
        if any(v is None for v in vals):
            return
        nums = [v for v in vals if v is not None]
        if len(nums) > MAX_VALID_VALUES:
            errs.append(f"{path}.validValues: Too many")
        for i in range(len(nums) - 1):
            if nums[i] > nums[i + 1]:
                errs.append(f"{path}.validValues[{i + 1}]: values must be sorted in ascending order")
        if len(set(nums)) != len(nums):
            errs.append(f"{path}.validValues: Duplicate value")
        for i, v in enumerate(nums):
            if v > capacity:
                errs.append(f"{path}.validValues[{i}]: option is larger than capacity value")
        if default not in nums:
            errs.append(f"{path}.validValues: default value is not valid according to the requestPolicy")
    elif valid_range is not None:
        if default is None:
            errs.append(f"{path}.default: Required value: required when validRange is defined")
            return
        rp = f"{path}.validRange"
        if valid_range.get("min") is None:
            errs.append(f"{rp}.min: Required value")
            return
        lo = _qty(valid_range["min"], f"{rp}.min", errs)
        hi = _qty(valid_range["max"], f"{rp}.max", errs) if valid_range.get("max") is not None else None
        step = _qty(valid_range["step"], f"{rp}.step", errs) if valid_range.get("step") is not None else None
        if lo is None:
            return
        if lo > capacity:
            errs.append(f"{rp}.min: min is larger than capacity value")
        if default < lo:
            errs.append(f"{rp}.min: default is less than min")
        if hi is not None:
            if lo > hi:
                errs.append(f"{rp}.max: min is larger than max")
            if hi > capacity:
                errs.append(f"{rp}.max: max is larger than capacity value")
            if default > hi:
                errs.append(f"{rp}.max: default is more than max")
        if step is not None:
            if step <= 0:  # Value() of a zero step would divide by zero in the API server
                errs.append(f"{rp}.step: must be positive")
                return
            if lo + step > capacity:
                errs.append(f"{rp}.step: one step is larger than capacity value")
            # validateRequestPolicyRangeStep works on Value() (integers, rounded up).
            s, m = _ceil(step), _ceil(lo)
            for what, v in (("default", default), ("max", hi)):
                if v is not None and (_ceil(v) - m) % s != 0:
                    errs.append(f"{rp}.step: {what} is not a multiple of a given step from min")


def _ceil(v: Fraction) -> int:
    return -((-v.numerator) // v.denominator)


def _device(dev: Any, path: str, errs: list[str]) -> None:
    if not isinstance(dev, dict):
        errs.append(f"{path}: Invalid value: not an object")
        return
    if not _label(dev.get("name")):
        errs.append(f"{path}.name: Invalid value: {dev.get('name')!r}: a lowercase RFC 1123 label")
    attrs = dev.get("attributes") or {}
    caps = dev.get("capacity") or {}
    if len(attrs) + len(caps) > MAX_ATTRS_AND_CAPS:
        errs.append(f"{path}: the total number of attributes and capacities must not exceed {MAX_ATTRS_AND_CAPS}")
    for k, a in attrs.items():
        _qualified_name(k, f"{path}.attributes[{k}]", errs)
        _attribute(a, f"{path}.attributes[{k}]", errs)
    multi = dev.get("allowMultipleAllocations") is True
    for k, c in caps.items():
        cp = f"{path}.capacity[{k}]"
        _qualified_name(k, cp, errs)
        if not isinstance(c, dict) or "value" not in c:
            errs.append(f"{cp}.value: Required value")
            continue
        value = _qty(c["value"], f"{cp}.value", errs)
        if c.get("requestPolicy") is not None:
            if not multi:
                errs.append(f"{cp}.requestPolicy: Forbidden: allowMultipleAllocations must be true")
            elif value is not None:
                _policy(value, c["requestPolicy"], f"{cp}.requestPolicy", errs)
    for k in ("nodeName", "nodeSelector", "allNodes"):
        if dev.get(k) is not None:
            errs.append(f"{path}: `{k}` can only be set if `perDeviceNodeSelection` is set to true")


def _meta_name(obj: dict[str, Any], errs: list[str]) -> None:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name and not meta.get("generateName"):
        errs.append("metadata.name: Required value")
    elif name and not _subdomain(name):
        errs.append(f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain")
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        for k in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(k):
                errs.append(f"metadata.ownerReferences[{i}].{k}: Required value")


def validate_resource_slice(obj: dict[str, Any]) -> list[str]:
    errs: list[str] = []
    _meta_name(obj, errs)
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [*errs, "spec: Required value"]
    _driver_name(spec.get("driver"), "spec.driver", errs)
    pool = spec.get("pool") or {}
    # validateResourcePool + validatePoolName
    pname = pool.get("name")
    if not pname:
        errs.append("spec.pool.name: Required value")
    else:
        if len(pname) > POOL_NAME_MAX:
            errs.append("spec.pool.name: Too long")
        for part in pname.split("/"):
            if not _subdomain(part):
                errs.append(f"spec.pool.name: Invalid value: {part!r}: a lowercase RFC 1123 subdomain")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] <= 0:
        errs.append("spec.pool.resourceSliceCount: Invalid value: must be greater than zero")
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        errs.append("spec.pool.generation: Invalid value: must be greater than or equal to zero")
    # Exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection.
    chosen = []
    if spec.get("nodeName") is not None:
        if spec["nodeName"] == "":
            errs.append("spec.nodeName: Invalid value: must be either unset or set to a non-empty string")
        else:
            chosen.append("nodeName")
            if not _subdomain(spec["nodeName"]):
                errs.append("spec.nodeName: Invalid value: a lowercase RFC 1123 subdomain")
    if spec.get("nodeSelector") is not None:
        chosen.append("nodeSelector")
    for k in ("allNodes", "perDeviceNodeSelection"):
        if spec.get(k) is not None:
            if spec[k] is True:
                chosen.append(k)
            else:
                errs.append(f"spec.{k}: Invalid value: must be either unset or set to true")
    if len(chosen) != 1:
        errs.append("spec: exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required")
    devices = spec.get("devices") or []
    if spec.get("sharedCounters") is not None and spec.get("devices") is not None:
        errs.append("spec: only one of `sharedCounters` or `devices` is allowed")
    if len(devices) > MAX_DEVICES:
        errs.append(f"spec.devices: Too many: must have at most {MAX_DEVICES} items")
    names = [d.get("name") for d in devices if isinstance(d, dict)]
    for n in {n for n in names if names.count(n) > 1}:
        errs.append(f"spec.devices: Duplicate value: {n!r}")
    for i, d in enumerate(devices):
        _device(d, f"spec.devices[{i}]", errs)
    return errs


def is_extended_resource_name(name: str) -> bool:
    """v1helper.IsExtendedResourceName."""
    if "/" not in name or name.startswith("requests."):
        return False
    domain = name.split("/", 1)[0]
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        return False  # IsPrefixedNativeResource
    prefix, _, rest = ("requests." + name).partition("/")
    return _subdomain(prefix) and 0 < len(rest) <= 63 and bool(_QUALIFIED_NAME.fullmatch(rest))


def validate_device_class(obj: dict[str, Any]) -> list[str]:
    errs: list[str] = []
    _meta_name(obj, errs)
    spec = obj.get("spec") or {}
    selectors = spec.get("selectors") or []
    if len(selectors) > MAX_SELECTORS:
        errs.append("spec.selectors: Too many")
    for i, sel in enumerate(selectors):
        cel = (sel or {}).get("cel")
        if cel is None:
            errs.append(f"spec.selectors[{i}].cel: Required value")
        elif not cel.get("expression") or len(cel["expression"]) > CEL_MAX_LENGTH:
            errs.append(f"spec.selectors[{i}].cel.expression: Invalid value")
    ern = spec.get("extendedResourceName")
    if ern is not None and not is_extended_resource_name(ern):
        errs.append(f"spec.extendedResourceName: Invalid value: {ern!r}: must be a valid extended resource name")
    return errs


def validate(obj: dict[str, Any]) -> list[str]:
    kind = obj.get("kind")
    if obj.get("apiVersion") != "resource.k8s.io/v1":
        return [f"apiVersion: {obj.get('apiVersion')!r} is not resource.k8s.io/v1"]
    if kind == "ResourceSlice":
        return validate_resource_slice(obj)
    if kind == "DeviceClass":
        return validate_device_class(obj)
    return [f"kind: no model for {kind!r}"]
