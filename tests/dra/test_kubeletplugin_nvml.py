"""The DRA plugin on the real NVML path (pynvml over the fake libnvidia-ml.so.1 of tests/fakes): GPUs
discovered as the device plugin does, the GPU's device minor in the CDI spec, health changes
republished through the slice publisher."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from deviceplugin.dra.api import dra_pb2
from deviceplugin.dra.kube import ApiClaimClient
from deviceplugin.dra.plugin import DRAPlugin
from kube_vgpu.config import Config
from kube_vgpu.model import GPUDevice
from tests.dra.dra_node_helpers import NS, Node, make_root, remove_root, result
from tests.fakeapi import FakeKubeAPI


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fakes.build import BuildError, build_fakes

    try:
        _, nvml = build_fakes(tmp_path_factory.mktemp("fakes"))
    except (BuildError, OSError) as e:
        pytest.skip(f"cannot build the fake NVML: {e}")
    ctypes.CDLL(str(nvml), mode=ctypes.RTLD_GLOBAL)  # pynvml's CDLL("libnvidia-ml.so.1") finds it
    return nvml


class Recorder:
    """A slice publisher that remembers what it was asked to publish."""

    def __init__(self) -> None:
        self.driver_version = ""
        self.calls: list[tuple[GPUDevice, ...]] = []
        self.cond = threading.Condition()

    def publish(self, devices: Sequence[GPUDevice]) -> int:
        with self.cond:
            self.calls.append(tuple(devices))
            self.cond.notify_all()
            return len(self.calls)

    def wait(self, pred, timeout: float = 20.0) -> tuple[GPUDevice, ...]:  # type: ignore[no-untyped-def]
        with self.cond:
            assert self.cond.wait_for(lambda: bool(self.calls) and pred(self.calls[-1]), timeout), self.calls
            return self.calls[-1]


@pytest.fixture
def setup(fake_nvml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Node, Path]]:
    conf = tmp_path / "nvml.conf"
    conf.write_text("driver=550.54.15 cuda=12040\ngpu index=0 minor=5 memory_mib=81920\n"
                    "gpu index=1 minor=7 memory_mib=81920\n")
    events = tmp_path / "nvml.events"
    events.write_text("")
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(conf))
    monkeypatch.setenv("FAKE_NVML_EVENTS", str(events))
    api = FakeKubeAPI(auto_create_namespaces=True)
    api.start()
    root = make_root()
    try:
        yield Node(api=api, root=root), conf
    finally:
        api.stop()
        remove_root(root)


def test_nvml_gpus_minors_and_health(setup: tuple[Node, Path]) -> None:
    n, conf = setup
    pub = Recorder()
    plugin = DRAPlugin(Config(), n.opts, ApiClaimClient(n.api.api_client()), publisher=pub)  # NVML, NVML minors
    plugin.start()
    try:
        first = pub.wait(lambda d: len(d) == 2)
        assert [(d.index, d.memory_mib, d.healthy) for d in first] == [(0, 81920, True), (1, 81920, True)]
        assert pub.driver_version == "550.54.15"
        c = n.claim("c1", [result("gpu-1", "3000Mi", "30")])
        uid = c["metadata"]["uid"]
        resp = plugin.prepare(dra_pb2.NodePrepareResourcesRequest(claims=[dra_pb2.Claim(namespace=NS, uid=uid,
                                                                                          name="c1")]))
        assert resp.claims[uid].error == ""
        spec = n.cdi_spec(uid)
        assert spec is not None
        assert spec["devices"][0]["containerEdits"]["deviceNodes"][0] == {
            "path": "/dev/nvidia7", "hostPath": f"{n.root}/dev/nvidia7"}
        lim = n.limits(uid)
        assert lim is not None and lim["uuid_0"] == first[1].uuid
        # GPU 0 lost: republished unhealthy (the publisher taints it)
        conf.write_text("driver=550.54.15 cuda=12040\ngpu index=0 minor=5 memory_mib=81920 fail=1\n"
                        "gpu index=1 minor=7 memory_mib=81920\n")
        t = time.time_ns() + 1_000_000  # the fake reloads on an mtime change: make sure it moves
        os.utime(conf, ns=(t, t))
        after = pub.wait(lambda d: len(d) == 2 and not d[0].healthy)
        assert after[1].healthy
    finally:
        plugin.stop()
