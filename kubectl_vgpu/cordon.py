"""``kubectl vgpu cordon|uncordon NODE GPU``: mark one GPU of a node unschedulable (or not) by
editing the node's ``kube-vgpu.io/gpu-cordon`` annotation (kube_vgpu/cordon.py). Running pods
stay; new pods avoid the GPU. GPU: its NVML index, its uuid, or the start of its uuid that
``kubectl vgpu inspect`` shows (at least 8 characters, one GPU's only); it must be in the node's
inventory."""

from __future__ import annotations

import json
from typing import Any

from kube_vgpu.codec import decode_inventory
from kube_vgpu.cordon import edit
from kube_vgpu.errors import CodecError
from kube_vgpu.resources import ANN_GPU_CORDON, ANN_HAMI_DEVICE_CORDON, ANN_NODE_INVENTORY
from kube_vgpu.views import NodeView

from .cluster import ClusterError, core_api


def set_cordon(node: str, gpu: str, cordon: bool, kubeconfig: str | None = None,
               context: str | None = None) -> str:
    """Cordon (or uncordon) ``gpu`` on ``node``. Returns a one-line result. Raises ClusterError
    naming the node and GPU when the node or the GPU is unknown or the API refuses."""
    core = core_api(kubeconfig, context, hint="pass --kubeconfig or --context")
    try:
        resp: Any = core.read_node(node, _preload_content=False)
        obj = json.loads(resp.data)
    except Exception as e:  # noqa: BLE001 - ApiException, connection errors
        raise ClusterError(f"reading node {node} failed: {getattr(e, 'reason', None) or e}") from e
    ann = NodeView(obj).annotations
    text = ann.get(ANN_NODE_INVENTORY)
    try:
        devices = decode_inventory(text).devices if text else ()
    except CodecError as e:
        raise ClusterError(f"node {node}: inventory annotation invalid ({e})") from e
    match = [d for d in devices if gpu in (d.uuid, str(d.index))]
    if not match and len(gpu) >= len("GPU-") + 4:
        # the uuid as the inspect table shows it: its first characters
        match = [d for d in devices if d.uuid.startswith(gpu)]
    known = ", ".join(f"{d.index}={d.uuid}" for d in devices) or "none (no kube-vgpu inventory)"
    if not match:
        raise ClusterError(f"node {node} has no GPU {gpu!r}; its GPUs: {known}")
    if len(match) > 1:
        raise ClusterError(f"node {node}: GPU {gpu!r} starts {len(match)} GPUs' uuids; allowed: an index or "
                           f"a longer uuid; its GPUs: {known}")
    uuid = match[0].uuid
    cur = ann.get(ANN_GPU_CORDON)
    new = cur
    for token in (uuid, str(match[0].index)):
        new = edit(new, token, False)  # one spelling per GPU: the uuid
    if cordon:
        new = edit(new, uuid, True)
    hami = ann.get(ANN_HAMI_DEVICE_CORDON)
    if not cordon and hami and uuid in {t.strip() for t in str(hami).split(",")}:
        raise ClusterError(f"GPU {uuid} on node {node} is also cordoned by {ANN_HAMI_DEVICE_CORDON}; "
                           f"remove it there (kubectl annotate node {node} {ANN_HAMI_DEVICE_CORDON}=...)")
    if new != cur:
        patch = {"metadata": {"annotations": {ANN_GPU_CORDON: new or None}}}
        try:
            core.patch_node(node, patch)
        except Exception as e:  # noqa: BLE001
            raise ClusterError(f"patching node {node} failed: {getattr(e, 'reason', None) or e}") from e
    state = "cordoned" if cordon else "uncordoned"
    return f"node {node} GPU {match[0].index} ({uuid}) {state}{'' if new != cur else ' (no change)'}"
