"""Typed fit failures: why a pod does not fit a node, as a code and the numbers behind it.

The fit rules (:mod:`kube_vgpu.placement.fit`), the node availability rules of the cluster cache
and the request parser's refusals all end in a :class:`FitFailure`; nothing on the fit path writes
prose. Text is made in one place, :mod:`kube_vgpu.placement.render`, for kube-scheduler, the
extender's debug log, ``kubectl vgpu`` and the simulator.

Like kube-scheduler's ``framework.Status`` (``Unschedulable`` vs ``UnschedulableAndUnresolvable``)
every code says whether evicting pods from the node could make room (:attr:`FitFailure.resolvable`):
the extender reports resolvable failures in ``FailedNodes`` and the others in
``FailedAndUnresolvableNodes``, so kube-scheduler's preemption skips nodes where it cannot help.

A failure never names a GPU by uuid (``gpu`` is an index on the node): two nodes in the same state
give equal failures, so the engine shares them between nodes and kube-scheduler can group them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Code(StrEnum):
    """Why a pod does not fit a node. The value is the metrics label
    (``kube_vgpu_scheduler_filter_rejections_total{reason}``)."""

    INSUFFICIENT_MEMORY = "insufficient_memory"  #: need: MiB per GPU; have: largest free MiB
    INSUFFICIENT_CORES = "insufficient_cores"  #: need: cores % per GPU; have: most free %
    NO_FREE_SLOT = "no_free_slot"  #: every usable GPU has all its vGPU slots taken
    TOO_FEW_GPUS = "too_few_gpus"  #: need: GPUs per container; have: GPUs on the node
    TOO_FEW_QUALIFY = "too_few_qualify"  #: need: GPUs; have: GPUs with room for one share
    EXCLUSIVE_BUSY = "exclusive_busy"  #: need: idle GPUs (exclusive request); have: GPUs in use
    COMPUTE_FULL = "compute_full"  #: have: GPUs whose compute an exclusive holder books fully
    GPU_UNHEALTHY = "gpu_unhealthy"  #: no usable GPU: all unhealthy (or excluded)
    TYPE_EXCLUDED = "type_excluded"  #: no usable GPU: model excluded (use-/nouse-gputype, gpu spec)
    UUID_EXCLUDED = "uuid_excluded"  #: no usable GPU: uuid excluded (use-/nouse-gpuuuid)
    HOST_CPU = "host_cpu"  #: need / have: host millicores (simulation only)
    HOST_MEMORY = "host_memory"  #: need / have: host MiB (simulation only)
    NO_INVENTORY = "no_inventory"  #: the node has no vGPU inventory (no device plugin)
    STALE_INVENTORY = "stale_inventory"  #: need: the staleness limit in seconds
    BAD_INVENTORY = "bad_inventory"  #: detail: the decoder's error
    NO_ALLOCATABLE = "no_allocatable"  #: detail: the GPU resource name whose allocatable is 0
    INVALID_REQUEST = "invalid_request"  #: detail: the request parser's error (same on every node)
    ALREADY_BOUND = "already_bound"  #: detail: the node the pod is bound to (bind only)
    #: need: asked, have: used (MiB or percent units); detail: namespace, ResourceQuota, key and
    #: the numbers (kube_vgpu/quota.py); the same on every node with GPUs of the same size
    QUOTA_EXCEEDED = "quota_exceeded"
    #: need / have: interconnect ranks (kube_vgpu.topology): the pod's required link class, the best
    #: the node's free GPUs reach; the node has such a set, busy now (``link_absent``: it has none)
    LINK_UNAVAILABLE = "link_unavailable"
    LINK_ABSENT = "link_absent"  #: need / have: as LINK_UNAVAILABLE; no set of the node reaches it
    #: only dynamic-MIG GPUs could serve the container and no allowed MIG profile holds it: need:
    #: the request (MiB), have: the largest allowed profile's MiB; detail: the profile table
    MIG_NO_PROFILE = "mig_no_profile"
    #: only dynamic-MIG GPUs could serve the container and none has a free placement for a profile
    #: that holds it: need: the request (MiB), have: how many such GPUs; detail: the smallest
    #: allowed profile that holds it
    MIG_NO_PLACEMENT = "mig_no_placement"


#: codes where evicting pods from the node could make room (kube-scheduler's ``Unschedulable``);
#: every other code is ``UnschedulableAndUnresolvable``
RESOLVABLE = frozenset({Code.INSUFFICIENT_MEMORY, Code.INSUFFICIENT_CORES, Code.NO_FREE_SLOT,
                        Code.TOO_FEW_QUALIFY, Code.EXCLUSIVE_BUSY, Code.COMPUTE_FULL, Code.HOST_CPU,
                        Code.HOST_MEMORY, Code.LINK_UNAVAILABLE, Code.MIG_NO_PLACEMENT})


@dataclass(frozen=True, slots=True)
class FitFailure:
    """Why a pod does not fit one node.

    code: the reason; container / init: the container that does not fit ("" for node-level
    failures); count, mem_mib, mem_percent, cores: that container's request (GPUs, MiB per GPU or
    percent of each GPU's memory, percent of compute); need / have: the numbers behind the code (units
    per :class:`Code`: MiB, percent, GPUs, millicores, seconds); gpu: index on the node of the GPU
    ``have`` was measured on (-1: none); detail: a fixed text the code needs (the GPU resource name,
    a decoder's or parser's error), never per-GPU.
    """

    code: Code
    container: str = ""
    init: bool = False
    count: int = 0
    mem_mib: int = 0
    mem_percent: int = 0
    cores: int = 0
    need: int = 0
    have: int = 0
    gpu: int = -1
    detail: str = ""

    @property
    def resolvable(self) -> bool:
        """True if preemption on the node could help (kube-scheduler's ``Unschedulable``)."""
        return self.code in RESOLVABLE

    def __str__(self) -> str:
        from .render import detail

        return detail(self)


#: the failure of a node the extender has no inventory for (unknown name, no device plugin)
NO_INVENTORY = FitFailure(Code.NO_INVENTORY)
