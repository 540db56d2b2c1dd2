#!/usr/bin/env bash
# Regenerate the committed gRPC/protobuf modules of the DRA plugin from the .proto files here.
# Usage: dra_plugin/api/gen.sh [python]   (default: .venv/bin/python; needs grpcio-tools)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
py="${1:-$root/.venv/bin/python}"
cd "$root"
"$py" -m grpc_tools.protoc -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  dra_plugin/api/dra.proto dra_plugin/api/pluginregistration.proto dra_plugin/api/health.proto
