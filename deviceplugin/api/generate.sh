#!/bin/sh
# Regenerate the Python gRPC stubs for the kubelet device plugin API (v1beta1, api.proto), the
# kubelet PodResources API (v1, podresources.proto), and for the DRA kubelet plugin
# (deviceplugin/dra/api): the DRA plugin API (dra.proto, service v1.DRAPlugin) and the plugin
# registration API (pluginregistration.proto). Needs grpcio-tools (`pip install grpcio-tools`,
# part of the `dev` extra). Run from anywhere:
#   deviceplugin/api/generate.sh [python]   (default: .venv/bin/python when present, else python3)
# Paths are given relative to the repository root so the generated modules import each other as
# `deviceplugin.api.api_pb2` / `deviceplugin.api.podresources_pb2` / `deviceplugin.dra.api.dra_pb2`.
set -eu
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
# the project's virtualenv by default: its grpcio-tools is the version the committed stubs (and
# pyproject's protobuf floor) were generated with; another protoc writes different gencode
if [ -x "$ROOT/.venv/bin/python" ]; then DEFAULT_PY="$ROOT/.venv/bin/python"; else DEFAULT_PY=python3; fi
PY="${1:-${PYTHON:-$DEFAULT_PY}}"
cd "$ROOT"
"$PY" -m grpc_tools.protoc -I . \
    --python_out=. --pyi_out=. --grpc_python_out=. \
    deviceplugin/api/api.proto deviceplugin/api/podresources.proto \
    deviceplugin/dra/api/dra.proto deviceplugin/dra/api/pluginregistration.proto
