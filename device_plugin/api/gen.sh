#!/usr/bin/env bash
# Regenerate the committed gRPC/protobuf modules from the .proto files here.
# Usage: device_plugin/api/gen.sh [python]   (default: .venv/bin/python; needs grpcio-tools)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
py="${1:-$root/.venv/bin/python}"
cd "$root"
"$py" -m grpc_tools.protoc -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  device_plugin/api/deviceplugin.proto device_plugin/api/podresources.proto
