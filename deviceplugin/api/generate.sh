#!/bin/sh
# Regenerate the Python gRPC stubs for the kubelet device plugin API (v1beta1, api.proto), the
# kubelet PodResources API (v1, podresources.proto), and for the DRA kubelet plugin
# (deviceplugin/dra/api): the DRA plugin API (dra.proto, service v1.DRAPlugin) and the plugin
# registration API (pluginregistration.proto).
#
# The generator is pinned: grpcio-tools 1.64.1 writes protobuf 5.26.1 gencode, which loads on every
# protobuf runtime from 5.26.1 to 7.x and grpcio >= 1.64.1 (pyproject.toml's floors; a newer
# generator would raise them and shut out older environments). It cannot share the project's
# virtualenv (it needs protobuf < 6), so give it one of its own:
#   python3 -m venv /tmp/protogen && /tmp/protogen/bin/pip install grpcio-tools==1.64.1
#   deviceplugin/api/generate.sh /tmp/protogen/bin/python
# Paths are given relative to the repository root so the generated modules import each other as
# `deviceplugin.api.api_pb2` / `deviceplugin.api.podresources_pb2` / `deviceplugin.dra.api.dra_pb2`.
set -eu
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${1:-${PYTHON:-python3}}"
WANT=1.64.1
HAVE="$("$PY" -c 'from importlib.metadata import version; print(version("grpcio-tools"))' 2>/dev/null || echo none)"
if [ "$HAVE" != "$WANT" ]; then
    echo "generate.sh: $PY has grpcio-tools $HAVE, the stubs are generated with $WANT (see the comment at the top)" >&2
    exit 1
fi
cd "$ROOT"
"$PY" -m grpc_tools.protoc -I . \
    --python_out=. --pyi_out=. --grpc_python_out=. \
    deviceplugin/api/api.proto deviceplugin/api/podresources.proto \
    deviceplugin/dra/api/dra.proto deviceplugin/dra/api/pluginregistration.proto
