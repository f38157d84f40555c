"""Where the plugin reads the cluster from: a recorded snapshot file or the live API.

A snapshot is JSON (or YAML) ``{"nodes": <NodeList or list>, "pods": <PodList or list>}``, e.g.
recorded with::

    jq -n --argjson n "$(kubectl get nodes -o json)" --argjson p "$(kubectl get pods -A -o json)" \\
        '{nodes: $n, pods: $p}' > snapshot.json

An optional top-level ``"time"`` (unix seconds) is the moment it was taken; inventory heartbeats
are aged against it (default: the newest heartbeat in the snapshot).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kube_vgpu.codec import decode_inventory
from kube_vgpu.errors import CodecError
from kube_vgpu.resources import ANN_NODE_INVENTORY

Obj = dict[str, Any]


class ClusterError(RuntimeError):
    """The cluster could not be read (bad snapshot, no kubeconfig, API error)."""


@dataclass
class Cluster:
    """Nodes and pods as plain ``core/v1`` JSON dicts; ``now``: reference time (unix s) for ages."""

    nodes: list[Obj]
    pods: list[Obj]
    now: float
    source: str = "live"
    warnings: list[str] = field(default_factory=list)


def _items(obj: Any, what: str) -> list[Obj]:
    if isinstance(obj, dict) and isinstance(obj.get("items"), list):
        obj = obj["items"]
    if not isinstance(obj, list) or not all(isinstance(x, dict) for x in obj):
        raise ClusterError(f"snapshot: {what!r} must be a {what[:-1].capitalize()}List or a list of objects")
    return obj


def newest_heartbeat(nodes: list[Obj]) -> float:
    """The newest inventory heartbeat among ``nodes`` (0 if none decodes)."""
    best = 0.0
    for n in nodes:
        text = ((n.get("metadata") or {}).get("annotations") or {}).get(ANN_NODE_INVENTORY)
        if not text:
            continue
        try:
            best = max(best, decode_inventory(text).heartbeat)
        except CodecError:
            continue
    return best


def load_snapshot(path: str | Path) -> Cluster:
    """Read a recorded snapshot. Raises ClusterError with the reason."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ClusterError(f"cannot read snapshot {p}: {e.strerror or e}") from e
    try:
        raw = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ClusterError(f"snapshot {p} is not JSON/YAML: {e}") from e
    if not isinstance(raw, dict) or "nodes" not in raw or "pods" not in raw:
        raise ClusterError(f'snapshot {p} must be an object {{"nodes": NodeList, "pods": PodList}}')
    nodes = _items(raw["nodes"], "nodes")
    pods = _items(raw["pods"], "pods")
    t = raw.get("time")
    now = float(t) if isinstance(t, int | float) and not isinstance(t, bool) else newest_heartbeat(nodes)
    return Cluster(nodes=nodes, pods=pods, now=now, source=str(p))


def load_live(kubeconfig: str | None = None, context: str | None = None) -> Cluster:
    """List nodes and pods with the official client (kubeconfig, else in-cluster). Read-only."""
    import time

    try:
        from kubernetes import client, config
    except ImportError as e:  # pragma: no cover - kubernetes is a dependency
        raise ClusterError("the 'kubernetes' package is required for live mode; use --snapshot") from e
    try:
        try:
            config.load_kube_config(config_file=kubeconfig, context=context)
        except config.ConfigException:
            if kubeconfig or context:
                raise
            config.load_incluster_config()
    except Exception as e:  # noqa: BLE001 - no kubeconfig, bad file, not in a cluster
        raise ClusterError(f"cannot load a kubeconfig ({e}); pass --kubeconfig or --snapshot") from e
    core = client.CoreV1Api()
    try:
        node_resp: Any = core.list_node(_preload_content=False)
        pod_resp: Any = core.list_pod_for_all_namespaces(_preload_content=False)
        nodes = json.loads(node_resp.data)
        pods = json.loads(pod_resp.data)
    except Exception as e:  # noqa: BLE001 - ApiException, connection errors
        status = getattr(e, "status", None)
        raise ClusterError(f"listing nodes/pods failed{f' (HTTP {status})' if status else ''}: "
                           f"{getattr(e, 'reason', None) or e}") from e
    return Cluster(nodes=_items(nodes, "nodes"), pods=_items(pods, "pods"), now=time.time(), source="live")
