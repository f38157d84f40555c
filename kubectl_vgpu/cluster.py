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

from kube_vgpu import podshape
from kube_vgpu.codec import decode_inventory
from kube_vgpu.errors import CodecError, ShapeError, json_type, yaml_problem
from kube_vgpu.resources import ANN_NODE_INVENTORY
from kube_vgpu.views import NodeView

Obj = dict[str, Any]


class ClusterError(RuntimeError):
    """The cluster could not be read (bad snapshot, no kubeconfig, API error)."""


@dataclass
class Cluster:
    """Nodes and pods as plain ``core/v1`` JSON dicts; ``now``: reference time (unix s) for ages.

    Objects whose fields read by the plugin have the wrong JSON type (see :func:`object_problem`)
    are dropped on construction, each with a line in ``warnings``: one corrupt object never stops
    the report.
    """

    nodes: list[Obj]
    pods: list[Obj]
    now: float
    source: str = "live"
    warnings: list[str] = field(default_factory=list)
    #: ResourceQuota objects (``kubectl vgpu quota``; a snapshot may leave them out)
    quotas: list[Obj] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nodes = self._keep(self.nodes, "node")
        self.pods = self._keep(self.pods, "pod")

    def _keep(self, items: list[Any], kind: str) -> list[Obj]:
        out = []
        for i, o in enumerate(items):
            why = object_problem(o, kind)
            if why is None:
                out.append(o)
            else:
                self.warnings.append(f"{kind} {_describe(o, kind, i)}: {why}; skipped")
        return out


def _describe(o: Any, kind: str, i: int) -> str:
    """``ns/name`` (pods) or ``name`` (nodes) when readable, else ``#<position>``."""
    m = o.get("metadata") if isinstance(o, dict) else None
    if isinstance(m, dict) and isinstance(m.get("name"), str) and m["name"]:
        ns = m.get("namespace")
        if kind == "pod":
            return f"{ns if isinstance(ns, str) and ns else 'default'}/{m['name']}"
        return str(m["name"])
    return f"#{i}"


def object_problem(o: Any, kind: str) -> str | None:
    """Why a node/pod JSON object is unusable, or None: it is not an object, has no ``metadata``
    object with a non-empty string ``name``, or a field has the wrong JSON type
    (:func:`kube_vgpu.podshape.check_pod` / :func:`~kube_vgpu.podshape.check_node`: the project's one
    shape check, whose message names the field path, the value's type and what is allowed).
    """
    if not isinstance(o, dict):
        return f"not an object (got {json_type(o)})"
    try:
        m = o.get("metadata")
        if not isinstance(m, dict):
            raise ShapeError("metadata", m, "an object")
        if not isinstance(m.get("name"), str) or not m["name"]:
            raise ShapeError("metadata.name", m.get("name"), "a non-empty string")
        (podshape.check_pod if kind == "pod" else podshape.check_node)(o)
    except ShapeError as e:
        return str(e)
    return None


def _items(obj: Any, what: str) -> list[Any]:
    """The items of a list object or a plain list; single items are checked by :class:`Cluster`."""
    if isinstance(obj, dict) and isinstance(obj.get("items"), list):
        obj = obj["items"]
    if not isinstance(obj, list):
        raise ClusterError(f"snapshot: {what!r} must be a {what[:-1].capitalize()}List or a list of objects")
    return obj


def newest_heartbeat(nodes: list[Obj]) -> float:
    """The newest inventory heartbeat among ``nodes`` (0 if none decodes)."""
    best = 0.0
    for n in nodes:
        if object_problem(n, "node"):
            continue
        text = NodeView(n).annotations.get(ANN_NODE_INVENTORY)
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
    except json.JSONDecodeError as e:
        raise ClusterError(f"snapshot {p} is not JSON/YAML: {e}") from e
    except yaml.YAMLError as e:
        raise ClusterError(f"snapshot {p} is not JSON/YAML: {yaml_problem(e)}") from e
    if not isinstance(raw, dict) or "nodes" not in raw or "pods" not in raw:
        raise ClusterError(f'snapshot {p} must be an object {{"nodes": NodeList, "pods": PodList}}')
    nodes = _items(raw["nodes"], "nodes")
    pods = _items(raw["pods"], "pods")
    quotas = _items(raw["resourcequotas"], "resourcequotas") if "resourcequotas" in raw else []
    t = raw.get("time")
    now = float(t) if isinstance(t, int | float) and not isinstance(t, bool) else newest_heartbeat(nodes)
    return Cluster(nodes=nodes, pods=pods, now=now, source=str(p),
                   quotas=[q for q in quotas if isinstance(q, dict)])


def core_api(kubeconfig: str | None = None, context: str | None = None,
             hint: str = "pass --kubeconfig or --snapshot") -> Any:
    """A CoreV1Api from the kubeconfig (else in-cluster). Raises ClusterError when none loads,
    naming the kubeconfig, why it did not load, and ``hint`` (what the user may pass instead)."""
    from kubernetes import client

    from kube_vgpu.kubeapi import load_api_client

    try:
        api = load_api_client(kubeconfig, context=context, in_cluster_first=False)
    except Exception as e:  # noqa: BLE001 - no kubeconfig, bad file, not in a cluster
        if kubeconfig or context:
            raise ClusterError(f"cannot load kubeconfig {kubeconfig or _default_kubeconfig()}"
                               f"{f' (context {context})' if context else ''}: {_why(e)}; "
                               f"{hint}") from e
        # load_api_client tries the in-cluster account only after the file failed with a
        # ConfigException (missing, incomplete); its error (e) then hides why the file did not load.
        from kubernetes.config import ConfigException

        path = _default_kubeconfig()
        try:
            load_api_client(path, in_cluster_first=False)
            file_err: Exception = e
        except Exception as fe:  # noqa: BLE001 - missing or invalid file
            file_err = fe
        cluster = f"; not in a cluster either ({e})" if isinstance(file_err, ConfigException) else ""
        raise ClusterError(f"cannot load kubeconfig {path}: {_why(file_err)}{cluster}; "
                           f"{hint}") from e
    return client.CoreV1Api(api)


def _why(err: Exception) -> str:
    """An error's text on one line (a kubeconfig that is not YAML: where and what)."""
    return f"not valid YAML: {yaml_problem(err)}" if isinstance(err, yaml.YAMLError) else str(err)


def _default_kubeconfig() -> str:
    """The kubeconfig kubectl reads: $KUBECONFIG (a list separated by ':' is merged), else
    ~/.kube/config."""
    import os

    return os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")


def load_live(kubeconfig: str | None = None, context: str | None = None) -> Cluster:
    """List nodes and pods with the official client (kubeconfig, else in-cluster). Read-only."""
    import time

    core = core_api(kubeconfig, context)
    try:
        node_resp: Any = core.list_node(_preload_content=False)
        pod_resp: Any = core.list_pod_for_all_namespaces(_preload_content=False)
        nodes = json.loads(node_resp.data)
        pods = json.loads(pod_resp.data)
    except Exception as e:  # noqa: BLE001 - ApiException, connection errors
        status = getattr(e, "status", None)
        raise ClusterError(f"listing nodes/pods failed{f' (HTTP {status})' if status else ''}: "
                           f"{getattr(e, 'reason', None) or e}") from e
    warnings: list[str] = []
    quotas: list[Any] = []
    try:
        quota_resp: Any = core.list_resource_quota_for_all_namespaces(_preload_content=False)
        quotas = _items(json.loads(quota_resp.data), "resourcequotas")
    except Exception as e:  # noqa: BLE001 - e.g. not allowed to list quotas: report without them
        warnings.append(f"resourcequotas not listed ({getattr(e, 'status', None) or e}); GPU quotas not shown")
    return Cluster(nodes=_items(nodes, "nodes"), pods=_items(pods, "pods"), now=time.time(), source="live",
                   warnings=warnings, quotas=[q for q in quotas if isinstance(q, dict)])
