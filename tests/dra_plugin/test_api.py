"""The committed DRA gRPC modules are what grpcio-tools generates from the committed .proto files
(dra_plugin/api/gen.sh), and the wire details the kubelet relies on hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dra_plugin.api import dra_pb2, pluginregistration_pb2

ROOT = Path(__file__).resolve().parents[2]
API = "dra_plugin/api"


@pytest.mark.parametrize("proto", ["dra.proto", "pluginregistration.proto"])
def test_generated_modules_are_up_to_date(proto: str, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={tmp_path}"]
    argv += [f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"{API}/{proto}"]
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, timeout=120)
    stem = proto.removesuffix(".proto")
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
        got = (tmp_path / API / f"{stem}{suffix}").read_bytes()
        assert got == (ROOT / API / f"{stem}{suffix}").read_bytes(), f"{stem}{suffix}: run {API}/gen.sh"


def test_wire_names_and_presence() -> None:
    # The method paths the kubelet calls and the plugin watcher's service.
    assert dra_pb2.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert dra_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    reg = pluginregistration_pb2.DESCRIPTOR.services_by_name["Registration"]
    assert reg.full_name == "pluginregistration.Registration"
    assert {m.name for m in reg.methods} == {"GetInfo", "NotifyRegistrationStatus"}
    # share_id is `optional`: an unset share and an empty one differ on the wire.
    d = dra_pb2.Device(pool_name="p", device_name="gpu-0")
    assert not d.HasField("share_id")
    d.share_id = ""
    assert d.HasField("share_id") and dra_pb2.Device.FromString(d.SerializeToString()).HasField("share_id")
