"""The decision cache is keyed on what the decision depends on, and nothing a cached answer
carries leaks from one pod to another."""

from __future__ import annotations

from kube_vgpu.placement import ClusterState, Code, Engine

from .helpers import gpus, pod, req


def _pod(name: str, cpu: str, mem: str, gpumem: int, cname: str = "main") -> dict[str, object]:
    p = pod(name, {"gpumem": gpumem})
    c = p["spec"]["containers"][0]  # type: ignore[index]
    c["name"] = cname
    c["resources"]["requests"] = {"cpu": cpu, "memory": mem}
    return p


def test_live_key_ignores_host_cpu_and_memory() -> None:
    """No node models host CPU or memory (the live extender): pods that differ only there share
    one cached decision, and get the same answer."""
    st = ClusterState()
    st.set_node("n1", gpus("n1", [16000]))
    e = Engine(st, "binpack")
    a = e.evaluate(req(_pod("a", "100m", "64Mi", 8000)))
    b = e.evaluate(req(_pod("b", "7", "30Gi", 8000)))
    assert a == b and a[0] == ["n1"]
    assert e.cached_shapes == 1
    e.evaluate(req(_pod("c", "100m", "64Mi", 8001)))  # another GPU request: another shape
    assert e.cached_shapes == 2


def test_replay_key_keeps_host_cpu_and_memory() -> None:
    """A node that models host CPU and memory makes them part of the key: a pod that asks for more
    CPU than is free is refused although an otherwise equal pod fitted a moment before."""
    st = ClusterState()
    st.set_node("n1", gpus("n1", [16000]), cpu_milli=2000, memory_mib=4096)
    e = Engine(st, "binpack")
    ok, _, _ = e.evaluate(req(_pod("a", "1", "1Gi", 8000)))
    assert ok == ["n1"]
    ok, failed, _ = e.evaluate(req(_pod("b", "3", "1Gi", 8000)))
    assert ok == [] and (failed["n1"].code, failed["n1"].need, failed["n1"].have) == (Code.HOST_CPU, 3000, 2000)
    ok, failed, _ = e.evaluate(req(_pod("c", "1", "5Gi", 8000)))
    assert ok == [] and failed["n1"].code is Code.HOST_MEMORY
    assert e.cached_shapes == 3
    st.remove_node("n1")  # the last host-modelling node gone: back to the GPU-only key
    st.set_node("n2", gpus("n2", [16000]))
    assert e.evaluate(req(_pod("d", "3", "5Gi", 8000)))[0] == ["n2"]


def test_a_failure_names_the_asking_pods_own_container() -> None:
    """Two tenants' pods with the same GPU request but different container names: each failure
    names the pod's own container, never the other tenant's (the name is part of the key)."""
    st = ClusterState()
    st.set_node("n1", gpus("n1", [1000]))
    e = Engine(st, "binpack")
    f1 = e.evaluate(req(_pod("a", "1", "1Gi", 5000, cname="secret-name")))[1]["n1"]
    f2 = e.evaluate(req(_pod("b", "1", "1Gi", 5000, cname="worker")))[1]["n1"]
    assert (f1.code, f1.container) == (Code.INSUFFICIENT_MEMORY, "secret-name")
    assert (f2.code, f2.container) == (Code.INSUFFICIENT_MEMORY, "worker")
