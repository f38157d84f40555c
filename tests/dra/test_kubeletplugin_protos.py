"""The DRA plugin's protos (deviceplugin/dra/api) are wire-identical to kubelet's.

The schemas are reconstructed (names, numbers and types as upstream, comments our own). This test
compiles upstream's api.proto files, when a Kubernetes source tree is at hand
(``KUBERNETES_SRC``, default /work/gobuild/src/kubernetes), and compares every message field and
service method with ours; without one it checks the gRPC method paths kubelet calls.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from deviceplugin.dra.api import dra_pb2, pluginregistration_pb2

K8S = Path(os.environ.get("KUBERNETES_SRC", "/work/gobuild/src/kubernetes"))
UPSTREAM = {
    "dra": (K8S / "staging/src/k8s.io/kubelet/pkg/apis/dra/v1/api.proto", dra_pb2),
    "pluginregistration": (K8S / "staging/src/k8s.io/kubelet/pkg/apis/pluginregistration/v1/api.proto",
                           pluginregistration_pb2),
}


def _shape(fd: descriptor_pb2.FileDescriptorProto) -> dict:
    def msg(m: descriptor_pb2.DescriptorProto, prefix: str) -> dict:
        out = {f"{prefix}{m.name}": sorted((f.name, f.number, f.type, f.label, f.type_name.rsplit(".", 1)[-1],
                                            f.proto3_optional) for f in m.field)}
        for n in m.nested_type:
            out.update(msg(n, f"{prefix}{m.name}."))
        return out
    shape: dict = {"package": fd.package}
    for m in fd.message_type:
        shape.update(msg(m, ""))
    for s in fd.service:
        shape[f"service {s.name}"] = sorted((x.name, x.input_type.rsplit(".", 1)[-1], x.output_type.rsplit(".", 1)[-1],
                                             x.client_streaming, x.server_streaming) for x in s.method)
    return shape


def test_grpc_method_paths_are_kubelets() -> None:
    assert dra_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert pluginregistration_pb2.DESCRIPTOR.services_by_name["Registration"].full_name == \
        "pluginregistration.Registration"
    assert [m.name for m in dra_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].methods] == [
        "NodePrepareResources", "NodeUnprepareResources"]


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_schema_matches_upstream(name: str) -> None:
    path, ours = UPSTREAM[name]
    if not path.exists():
        pytest.skip(f"no Kubernetes source at {path} (set KUBERNETES_SRC)")
    grpc_tools = pytest.importorskip("grpc_tools.protoc")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "set.pb")
        rc = grpc_tools.main(["protoc", f"-I{path.parent}", f"--descriptor_set_out={out}", path.name])
        assert rc == 0
        fds = descriptor_pb2.FileDescriptorSet.FromString(Path(out).read_bytes())
    upstream = _shape(fds.file[0])
    mine = descriptor_pb2.FileDescriptorProto()
    ours.DESCRIPTOR.CopyToProto(mine)
    assert _shape(mine) == upstream
