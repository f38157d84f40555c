"""The placement policy registry: every node and GPU policy, declared once.

Each node policy declares its name (the value of ``scheduling.nodePolicy`` and of the
``kube-vgpu.io/node-scheduler-policy`` pod annotation), its scorer (a class in
:mod:`kube_vgpu.placement.policies`, built by :func:`kube_vgpu.placement.policies.make_policy`),
what it needs (``needs_shapes``: the target workload's task shapes, which the extender refreshes
from its bookings) and a one-line description. Everything else reads this table: config
validation (:mod:`kube_vgpu.config`), pod annotation validation (:mod:`kube_vgpu.podspec`), the
chart's ``values.schema.json`` and the config reference (``charts/tools/gen_schema.py``), the
trace replay's policy list, the extender's shape refresh and ``kubectl vgpu what-if``.

This module imports nothing heavy (no numpy, no placement engine), so the webhook and the device
plugin can validate a config without loading the engine. Adding a policy: write its scorer class,
add one entry to :data:`NODE_POLICY_SPECS`, run ``python charts/tools/gen_schema.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class GpuPolicySpec:
    """A GPU policy: how GPUs are ordered inside a node (``scheduling.gpuPolicy``).

    name: the config / annotation value, also the ordering's name in
    :func:`kube_vgpu.placement.fit.gpu_order`; doc: one line for the docs and the chart schema.
    """

    name: str
    doc: str


GPU_BINPACK = GpuPolicySpec("binpack", "most used GPU first")
GPU_SPREAD = GpuPolicySpec("spread", "least used GPU first")

#: every GPU policy, in documentation order
GPU_POLICY_SPECS: tuple[GpuPolicySpec, ...] = (GPU_BINPACK, GPU_SPREAD)


@dataclass(frozen=True, slots=True)
class NodePolicySpec:
    """A node policy (``scheduling.nodePolicy``).

    name: the config / annotation value. scorer: the class name in
    :mod:`kube_vgpu.placement.policies` (a ``Policy`` subclass), or ``module.Class`` for a class in
    another module of :mod:`kube_vgpu.placement`. options: extra keyword arguments
    for the scorer. needs_shapes: the scorer needs the target workload's task shapes (FGD's M).
    uses_gpu_policy: the scorer orders GPUs by ``scheduling.gpuPolicy`` (otherwise it orders them
    itself and the GPU policy is ignored). replay_gpu_policy: the GPU policy ``kube-vgpu replay``
    pairs it with. artifact_label: the FGD artifact's name for the same policy (``--against``).
    doc: one line for the docs and the chart schema.
    """

    name: str
    scorer: str
    doc: str
    needs_shapes: bool = False
    uses_gpu_policy: bool = False
    replay_gpu_policy: str = GPU_SPREAD.name
    artifact_label: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)


#: every node policy; the first is the default. Order = documentation and error-message order.
NODE_POLICY_SPECS: tuple[NodePolicySpec, ...] = (
    NodePolicySpec("binpack", "Binpack", "HAMi's usage score: the most used node first",
                   uses_gpu_policy=True, replay_gpu_policy=GPU_BINPACK.name),
    NodePolicySpec("spread", "Spread", "HAMi's usage score: the least used node first", uses_gpu_policy=True),
    NodePolicySpec("fgd", "FGD", "fragmentation gradient descent (ATC'23), the artifact's tie-break",
                   needs_shapes=True, artifact_label="06-FGD", options={"tie_break": "index"}),
    NodePolicySpec("fgd-bestfit", "FGD", "FGD with BestFit breaking its ties (recommended for FGD)",
                   needs_shapes=True, options={"tie_break": "bestfit"}),
    NodePolicySpec("bestfit", "BestFit", "the FGD artifact's BestFit: least leftover CPU and GPU",
                   artifact_label="05-BestFit"),
    NodePolicySpec("dotprod", "DotProd", "the FGD artifact's DotProd: free and requested vectors' dot product",
                   artifact_label="02-DotProd"),
)

#: the replay's models of kube-scheduler's own placement on the DRA path (docs/dra-placement.md):
#: ``kube-vgpu replay --policy`` only, never values of ``scheduling.nodePolicy`` or of the pod
#: annotation (the extender does not run them). Scorers live in
#: :mod:`kube_vgpu.placement.draalloc` (``module.Class``); ``nodes_to_score`` is kube-scheduler's
#: ``percentageOfNodesToScore`` (0 = adaptive, the default scheduler's; 100 = kube-vgpu's chart).
#: They order GPUs themselves (the replay's GPU policy is ignored).
DRA_MODEL_SPECS: tuple[NodePolicySpec, ...] = (
    NodePolicySpec("dra-allocator", "draalloc.DraAllocator",
                   "kube-scheduler's DRA allocator: GPU-blind node scores, devices first fit in the slice's order",
                   options={"nodes_to_score": 0}),
    NodePolicySpec("dra-bestfit-order", "draalloc.DraAllocator",
                   "dra-allocator with the driver republishing its devices least free first (first fit = best fit)",
                   options={"nodes_to_score": 0, "device_order": "bestfit"}),
    NodePolicySpec("dra-prefer-in-use", "draalloc.DraAllocator",
                   "dra-allocator with claims asking in-use GPUs first (firstAvailable) and DynamicResources scoring it",
                   options={"nodes_to_score": 0, "prefer_in_use": True}),
    NodePolicySpec("dra-mostallocated", "draalloc.DraAllocator",
                   "dra-allocator with kube-scheduler's NodeResourcesFit set to MostAllocated (packs CPU/memory)",
                   options={"nodes_to_score": 0, "fit_strategy": "MostAllocated"}),
    NodePolicySpec("dra-extender-fgd", "draalloc.DraExtenderFGD",
                   "kube-vgpu's extender picks the node (FGD of the allocator's choice), the allocator first fit",
                   needs_shapes=True, options={"tie_break": "bestfit"}),
    NodePolicySpec("dra-extender-fgd-unaware", "draalloc.DraExtenderFGD",
                   "dra-extender-fgd with the extender scoring FGD's own GPU choice, not the allocator's",
                   needs_shapes=True, options={"tie_break": "bestfit", "predict": False}),
)

NODE_POLICIES: tuple[str, ...] = tuple(s.name for s in NODE_POLICY_SPECS)
GPU_POLICIES: tuple[str, ...] = tuple(s.name for s in GPU_POLICY_SPECS)
#: the replay-only DRA-path models' names
DRA_MODELS: tuple[str, ...] = tuple(s.name for s in DRA_MODEL_SPECS)
_BY_NAME = {s.name: s for s in NODE_POLICY_SPECS + DRA_MODEL_SPECS}

#: HAMi's GPU policy values (pod annotation ``hami.io/gpu-scheduler-policy``) served by one of ours
#: (HAMI-ALIAS): ``topology-aware`` and ``numa`` by ``spread``, HAMi's default order (a container
#: of 2 or more GPUs always gets the best-connected set: :mod:`kube_vgpu.topology`). HAMi's comma
#: chains (``binpack,numa``) are served by their first ``binpack`` / ``spread``. ``mutex`` (idle
#: GPUs only) is not: a GPU of one's own is asked with ``nvidia.com/gpucores: 100``.
HAMI_GPU_POLICY_ALIASES = {"topology-aware": GPU_SPREAD.name, "numa": GPU_SPREAD.name}
#: what a refused HAMi GPU policy value is told (HAMI-ALIAS)
HAMI_GPU_POLICIES_ALLOWED = (f"one of {', '.join(GPU_POLICIES + tuple(HAMI_GPU_POLICY_ALIASES))} or a comma "
                             "chain of them (for an idle GPU of one's own, mutex, ask nvidia.com/gpucores: 100)")


def hami_gpu_policy(value: str) -> str | None:
    """The GPU policy serving HAMi's ``hami.io/gpu-scheduler-policy`` value (HAMI-ALIAS), or None
    when kube-vgpu does not serve it (``mutex``, unknown names)."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts or any(p not in GPU_POLICIES and p not in HAMI_GPU_POLICY_ALIASES for p in parts):
        return None
    ours = [p for p in parts if p in GPU_POLICIES]
    return ours[0] if ours else HAMI_GPU_POLICY_ALIASES[parts[0]]


def node_policy(name: str) -> NodePolicySpec:
    """The spec of node policy or DRA-path model ``name``. Raises ValueError naming the value and
    the allowed node policies."""
    spec = _BY_NAME.get(name)
    if spec is None:
        raise ValueError(f"unknown node policy {name!r}; allowed: {', '.join(NODE_POLICIES)}")
    return spec


def needs_shapes(name: str) -> bool:
    """Whether node policy ``name`` needs the workload's task shapes (False for an unknown name)."""
    spec = _BY_NAME.get(name)
    return spec is not None and spec.needs_shapes


def replay_policies() -> dict[str, tuple[str, str]]:
    """the trace replay's policy names -> (node policy, GPU policy): each node policy with its
    replay GPU policy, and ``<node>-gpu<gpu>`` for the other GPU policies of the node policies
    that use one (e.g. ``binpack-gpuspread``), and the DRA-path models (:data:`DRA_MODEL_SPECS`)."""
    out: dict[str, tuple[str, str]] = {}
    for s in NODE_POLICY_SPECS + DRA_MODEL_SPECS:
        out[s.name] = (s.name, s.replay_gpu_policy)
    for s in NODE_POLICY_SPECS:
        if s.uses_gpu_policy:
            for g in GPU_POLICIES:
                if g != s.replay_gpu_policy:
                    out[f"{s.name}-gpu{g}"] = (s.name, g)
    return out


__all__ = ["DRA_MODELS", "DRA_MODEL_SPECS", "GPU_POLICIES", "GPU_POLICY_SPECS", "GpuPolicySpec", "NODE_POLICIES",
           "NODE_POLICY_SPECS", "NodePolicySpec", "needs_shapes", "node_policy", "replay_policies"]
