#!/usr/bin/env bash
# Regenerate the committed gRPC/protobuf modules of the DRA plugin from the .proto files here.
# Usage: device_plugin/dra/api/gen.sh [python]   (default: .venv/bin/python; needs grpcio-tools)
set -euo pipefail
root="$(cd "$(dirname "$0")/../../.." && pwd)"
py="${1:-$root/.venv/bin/python}"
cd "$root"
"$py" -m grpc_tools.protoc -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  device_plugin/dra/api/dra.proto device_plugin/dra/api/pluginregistration.proto device_plugin/dra/api/health.proto
