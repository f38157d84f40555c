"""``kubectl vgpu cordon|uncordon NODE GPU`` against the fake kube-apiserver (real HTTP, the
official client, a kubeconfig), and ``kubectl vgpu inspect`` marking the cordoned GPU."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kube_vgpu.codec import encode_inventory
from kube_vgpu.model import GPUDevice, NodeInventory
from kube_vgpu.resources import ANN_GPU_CORDON, ANN_HAMI_DEVICE_CORDON, ANN_NODE_INVENTORY
from kubectl_vgpu.main import main
from tests.fakeapi import FakeKubeAPI

U = ["GPU-aaaaaaaa-0000-4000-8000-000000000000", "GPU-bbbbbbbb-0000-4000-8000-000000000001"]


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Iterator[tuple[FakeKubeAPI, str]]:
    api = FakeKubeAPI()
    api.start()
    inv = NodeInventory(tuple(GPUDevice(u, i, "NVIDIA A10", 24576) for i, u in enumerate(U)), heartbeat=1.0)
    api.create_object("nodes", {"metadata": {"name": "n1", "annotations": {ANN_NODE_INVENTORY: encode_inventory(inv)}}})
    try:
        yield api, api.kubeconfig(tmp_path / "kubeconfig")
    finally:
        api.stop()


def annotations(api: FakeKubeAPI) -> dict[str, str]:
    node = api.get_object("nodes", "n1")
    assert node is not None
    return node["metadata"].get("annotations") or {}


def test_cordon_by_index_and_uuid_then_uncordon(kubeconfig: tuple[FakeKubeAPI, str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    api, kc = kubeconfig
    assert main(["cordon", "n1", "1", "--kubeconfig", kc]) == 0
    assert f"node n1 GPU 1 ({U[1]}) cordoned" in capsys.readouterr().out
    assert annotations(api)[ANN_GPU_CORDON] == U[1]  # stored by uuid, whatever was typed
    assert main(["cordon", "n1", U[0], "--kubeconfig", kc]) == 0
    assert annotations(api)[ANN_GPU_CORDON] == f"{U[1]},{U[0]}"
    assert main(["cordon", "n1", U[0], "--kubeconfig", kc]) == 0
    assert "(no change)" in capsys.readouterr().out.splitlines()[-1]
    # inspect marks both
    assert main(["inspect", "--kubeconfig", kc, "-o", "json"]) == 0
    gpus = json.loads(capsys.readouterr().out)["nodes"][0]["gpus"]
    assert [g["cordoned"] for g in gpus] == [True, True]
    assert main(["uncordon", "n1", "0", "--kubeconfig", kc]) == 0
    assert main(["uncordon", "n1", U[1], "--kubeconfig", kc]) == 0
    assert ANN_GPU_CORDON not in annotations(api)
    capsys.readouterr()
    assert main(["inspect", "--kubeconfig", kc]) == 0
    assert "! cordoned" not in capsys.readouterr().out


def test_unknown_gpu_or_node_is_refused_naming_them(kubeconfig: tuple[FakeKubeAPI, str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    api, kc = kubeconfig
    assert main(["cordon", "n1", "7", "--kubeconfig", kc]) == 1
    err = capsys.readouterr().err
    assert "node n1 has no GPU '7'; its GPUs: 0=" in err and U[1] in err
    assert main(["cordon", "nope", "0", "--kubeconfig", kc]) == 1
    assert "reading node nope failed" in capsys.readouterr().err
    assert ANN_GPU_CORDON not in annotations(api)


def test_uncordon_says_when_hami_still_cordons(kubeconfig: tuple[FakeKubeAPI, str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    api, kc = kubeconfig
    api.patch_object("nodes", "n1", {"metadata": {"annotations": {ANN_HAMI_DEVICE_CORDON: U[0]}}})
    assert main(["inspect", "--kubeconfig", kc]) == 0
    assert "! cordoned: not offered to new pods" in capsys.readouterr().out
    assert main(["uncordon", "n1", "0", "--kubeconfig", kc]) == 1
    assert ANN_HAMI_DEVICE_CORDON in capsys.readouterr().err


def test_cordon_by_the_uuid_inspect_shows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The inspect table shows a uuid's first 12 characters (GPU-aaaaaaaa); cordon took only the full
    uuid, so the one a user copied from the table was refused. A start shared by two GPUs is refused."""
    twins = ["GPU-abcd1111-0000-4000-8000-000000000000", "GPU-abcd2222-0000-4000-8000-000000000001"]
    api = FakeKubeAPI()
    api.start()
    try:
        inv = NodeInventory(tuple(GPUDevice(u, i, "NVIDIA A10", 24576) for i, u in enumerate(twins)), heartbeat=1.0)
        api.create_object("nodes", {"metadata": {"name": "n1",
                                                 "annotations": {ANN_NODE_INVENTORY: encode_inventory(inv)}}})
        kc = api.kubeconfig(tmp_path / "kubeconfig")
        assert main(["cordon", "n1", "GPU-abcd2222", "--kubeconfig", kc]) == 0
        assert f"node n1 GPU 1 ({twins[1]}) cordoned" in capsys.readouterr().out
        node = api.get_object("nodes", "n1")
        assert node is not None and node["metadata"]["annotations"][ANN_GPU_CORDON] == twins[1]
        assert main(["cordon", "n1", "GPU-abcd", "--kubeconfig", kc]) == 1
        assert "GPU 'GPU-abcd' starts 2 GPUs' uuids; allowed: an index or a longer uuid" in capsys.readouterr().err
        assert main(["cordon", "n1", "GPU-", "--kubeconfig", kc]) == 1  # too short to be a uuid's start
        assert "node n1 has no GPU 'GPU-'" in capsys.readouterr().err
        assert main(["uncordon", "n1", "GPU-abcd2222", "--kubeconfig", kc]) == 0
        node = api.get_object("nodes", "n1")
        assert node is not None and ANN_GPU_CORDON not in (node["metadata"].get("annotations") or {})
    finally:
        api.stop()
