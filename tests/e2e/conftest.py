"""Fixtures for the end-to-end suite. Without KUBE_BIN_DIR or KUBECONFIG every test here is skipped
at once (no process started, no network). The rest of the suite is unaffected: these fixtures only
apply under tests/e2e."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

SKIP_REASON = ("e2e needs a control plane: set KUBE_BIN_DIR (kube-apiserver, kube-scheduler[, "
               "kube-controller-manager]; etcd there or on PATH) or KUBECONFIG; see tests/e2e/README.md")
DP_NODE = "gpu-node-0"
NODES = [f"gpu-node-{i}" for i in range(4)]
GPUS_PER_NODE = 4
GPU_MEM = 16384
SPLIT = 10


def have_control_plane() -> bool:
    return bool(os.environ.get("KUBE_BIN_DIR") or os.environ.get("KUBECONFIG"))


@pytest.fixture(scope="session", autouse=True)
def _need_control_plane() -> None:
    if not have_control_plane():
        pytest.skip(SKIP_REASON)


def gpu_uuid(node: int, i: int) -> str:
    return f"GPU-{node:08d}-e2e0-4000-8000-{i:012d}"


@pytest.fixture(scope="session")
def e2e_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Control plane + our components + 4 fake GPU nodes + fake kubelet, in a fresh namespace."""
    if not have_control_plane():
        pytest.skip(SKIP_REASON)
    from kubernetes import client, config

    from .cluster import (
        SCHEDULER_NAME,
        Components,
        ControlPlane,
        KubeletLoop,
        create_gpu_nodes,
        create_namespace,
        wait_for,
        write_policy,
    )

    work = tmp_path_factory.mktemp("e2e")
    cp = ControlPlane(work)
    comps = Components(cp, work)
    sockdir = tempfile.mkdtemp(prefix="kve2e", dir="/tmp")
    fk: Any = None  # the fake kubelet (tests/deviceplugin/dp_helpers.FakeKubelet)
    loop: KubeletLoop | None = None
    api: Any = None
    ns = f"e2e-{uuid.uuid4().hex[:6]}"
    try:
        try:
            cp.start()
        except FileNotFoundError as e:
            pytest.skip(f"e2e: {e}")
        assert cp.kubeconfig is not None
        api = config.new_client_from_config(config_file=str(cp.kubeconfig))
        core, adm = client.CoreV1Api(api), client.AdmissionregistrationV1Api(api)
        write_policy(comps.policy, "binpack")

        create_namespace(core, ns)
        # fake GPU nodes, as plain Node objects (gotcha 1: keep status, drop the not-ready taint)
        create_gpu_nodes(core, NODES, GPUS_PER_NODE, GPU_MEM, SPLIT, gpu_uuid)

        # device plugin for gpu-node-0 against the fake NVML (same UUIDs as the inventory above)
        gpus, fk = comps.start_gpu_node(DP_NODE, sockdir, [gpu_uuid(0, i) for i in range(GPUS_PER_NODE)], GPU_MEM)

        comps.start_webhook()
        adm.create_mutating_webhook_configuration(comps.webhook_configuration(ns))
        comps.start_extender()
        comps.start_kube_scheduler()
        loop = KubeletLoop(core, ns, DP_NODE, fk, comps.signing_keys)
        loop.start()

        def webhook_live() -> bool:  # the API server has loaded the webhook configuration
            probe = {"metadata": {"name": "webhook-probe"}, "spec": {"containers": [{
                "name": "c", "image": "busybox", "resources": {"limits": {"nvidia.com/gpumem": "1000"}}}]}}
            return bool(core.create_namespaced_pod(ns, probe, dry_run="All").spec.scheduler_name == SCHEDULER_NAME)
        wait_for(webhook_live, 60, "the webhook configuration in effect")
        yield {"cp": cp, "comps": comps, "api": api, "core": core, "ns": ns, "kubelet": loop,
               "nvml": gpus, "work": work}
    finally:
        if loop is not None:
            loop.stop()
        if api is not None and cp.bin_dir is None:  # existing cluster: clean up what we made
            try:
                core = client.CoreV1Api(api)
                client.AdmissionregistrationV1Api(api).delete_mutating_webhook_configuration(f"kube-vgpu-e2e-{ns}")
                core.delete_namespace(ns)
                for name in NODES:
                    core.delete_node(name)
            except Exception:  # noqa: BLE001 - best effort
                pass
        comps.stop()
        if fk is not None:
            fk.stop()
        cp.stop()
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture
def env(e2e_env: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The session environment, with the namespace emptied before and after each test."""
    from .cluster import wait_for, write_policy

    core, ns = e2e_env["core"], e2e_env["ns"]

    def clean() -> None:
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        wait_for(lambda: not core.list_namespaced_pod(ns).items, 60, "namespace emptied")
        # every pod of the suite is gone: the extender must hold no booking (a leaked one would skew
        # the next test's placements and is a bug in itself)
        wait_for(lambda: e2e_env["comps"].extender_bookings() == 0, 60, "the extender to release every booking")

    clean()
    write_policy(e2e_env["comps"].policy, "binpack")
    try:
        yield e2e_env
    finally:
        clean()
