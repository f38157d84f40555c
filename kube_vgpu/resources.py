"""Resource names and annotation keys.

Resource names default to HAMi's so HAMi pod specs run unchanged; they are configurable through
:class:`kube_vgpu.config.ResourceNames`. Annotation keys of our own allocation protocol live under
``kube-vgpu.io/``; the selection annotations accept HAMi's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

# Defaults, identical to HAMi's (`nvidia.com/...`).
DEFAULT_GPU = "nvidia.com/gpu"  #: physical GPUs per container (count)
DEFAULT_GPUMEM = "nvidia.com/gpumem"  #: MiB of device memory per GPU
DEFAULT_GPUMEM_PERCENTAGE = "nvidia.com/gpumem-percentage"  #: percent (1-100) of each GPU's memory
DEFAULT_GPUCORES = "nvidia.com/gpucores"  #: percent (0-100) of one GPU's compute
DEFAULT_PRIORITY = "nvidia.com/priority"  #: task priority, 0 (high) or 1 (low)

DEFAULT_SCHEDULER_NAME = "kube-vgpu-scheduler"

#: MIG devices advertised per profile (config ``devices.migStrategy: mixed``) are the extended
#: resource ``<domain of the gpu name>/mig-<profile>``, as NVIDIA's device plugin names them
MIG_RESOURCE_PREFIX = "mig-"


def mig_resource(gpu_name: str, profile: str) -> str:
    """The resource name of MIG devices of ``profile`` (``1g.10gb``) when the GPU resource is
    ``gpu_name``: ``nvidia.com/gpu`` -> ``nvidia.com/mig-1g.10gb``."""
    domain, sep, _ = gpu_name.rpartition("/")
    return f"{domain}{sep}{MIG_RESOURCE_PREFIX}{profile}"


def is_mig_resource(name: str, gpu_name: str) -> bool:
    """True if ``name`` is a per-profile MIG resource (:func:`mig_resource`) beside ``gpu_name``."""
    return name.startswith(mig_resource(gpu_name, "")) and len(name) > len(mig_resource(gpu_name, ""))

# Selection constraints (pod annotations; HAMi keys).
ANN_USE_GPUTYPE = "nvidia.com/use-gputype"
ANN_NOUSE_GPUTYPE = "nvidia.com/nouse-gputype"
ANN_USE_GPUUUID = "nvidia.com/use-gpuuuid"
ANN_NOUSE_GPUUUID = "nvidia.com/nouse-gpuuuid"

# Per-pod policy overrides (HAMi keys accepted, ours preferred).
ANN_NODE_POLICY = "kube-vgpu.io/node-scheduler-policy"
ANN_GPU_POLICY = "kube-vgpu.io/gpu-scheduler-policy"
#: on Pod (tenant): the interconnect a multi-GPU container's GPUs must share (nvlink, pcie-switch,
#: host-bridge, numa; kube_vgpu.topology.LINK_CLASSES)
ANN_GPU_LINK = "kube-vgpu.io/gpu-link"
HAMI_ANN_NODE_POLICY = "hami.io/node-scheduler-policy"
HAMI_ANN_GPU_POLICY = "hami.io/gpu-scheduler-policy"

# Our protocol (versioned JSON, see kube_vgpu.codec).
ANN_NODE_INVENTORY = "kube-vgpu.io/node-inventory"  #: on Node, written by the device plugin
ANN_ALLOCATION = "kube-vgpu.io/allocation"  #: on Pod, written by the scheduler at bind
ANN_BIND_PHASE = "kube-vgpu.io/bind-phase"  #: on Pod: allocating | success | failed
ANN_BIND_TIME = "kube-vgpu.io/bind-time"  #: on Pod: unix seconds
#: on Pod, written by the device plugin: comma-separated names of the containers it answered
#: Allocate for (init and app container names are unique within a pod)
ANN_ALLOCATED_CONTAINERS = "kube-vgpu.io/allocated-containers"
ANN_GPU_CORDON = "kube-vgpu.io/gpu-cordon"  #: on Node (admin): cordoned GPUs, uuids or indexes, comma-separated
ANN_HAMI_DEVICE_CORDON = "hami.io/device-cordon"  #: on Node (admin): HAMi's form of the same (uuids)
LABEL_NODE = "kube-vgpu.io/node"  #: reserved pod label (older versions wrote the node name); system-owned

#: on Pod, written by the scheduler with the allocation: ``v1:<key id>:<base64url HMAC-SHA256>`` over
#: pod uid, node, bind time and the allocation annotation's exact bytes (see kube_vgpu.signing)
ANN_ALLOCATION_SIGNATURE = "kube-vgpu.io/allocation-signature"
#: on Pod, written by the device plugin with bind-phase / allocated-containers: same form, over pod
#: uid, the allocation signature, the bind phase and the allocated-containers value
ANN_PROGRESS_SIGNATURE = "kube-vgpu.io/progress-signature"

#: Every pod annotation and label under this prefix belongs to the vGPU system (only its service
#: accounts write them; a tenant can neither create a pod with them nor change them), except the
#: tenant-facing keys in TENANT_KEYS. The chart's ValidatingAdmissionPolicy and the webhook apply
#: this one rule.
SYSTEM_PREFIX = "kube-vgpu.io/"

BIND_ALLOCATING = "allocating"
BIND_SUCCESS = "success"
BIND_FAILED = "failed"

# Opt-out label for the webhook, like HAMi's hami.io/webhook=ignore. Honoured on the namespace
# only (the chart's webhook namespaceSelector): a tenant-set pod label never opts out.
LABEL_WEBHOOK = "kube-vgpu.io/webhook"
LABEL_WEBHOOK_IGNORE = "ignore"

#: keys under SYSTEM_PREFIX that tenants may set on their pods (per-pod placement policy)
TENANT_KEYS = frozenset({ANN_NODE_POLICY, ANN_GPU_POLICY, ANN_GPU_LINK})


def system_owned(key: str) -> bool:
    """True if a pod annotation or label ``key`` is written only by the vGPU system."""
    return key.startswith(SYSTEM_PREFIX) and key not in TENANT_KEYS


@dataclass(frozen=True, slots=True)
class ResourceNames:
    """The extended-resource names this installation answers to (config ``resourceNames``)."""

    gpu: str = DEFAULT_GPU
    gpumem: str = DEFAULT_GPUMEM
    gpumem_percentage: str = DEFAULT_GPUMEM_PERCENTAGE
    gpucores: str = DEFAULT_GPUCORES
    priority: str = DEFAULT_PRIORITY

    def all(self) -> tuple[str, ...]:
        """All names, gpu first."""
        return (self.gpu, self.gpumem, self.gpumem_percentage, self.gpucores, self.priority)

    def share_names(self) -> tuple[str, str, str]:
        """The names that make a container a vGPU (shared) request: gpumem, gpumem-percentage, gpucores."""
        return (self.gpumem, self.gpumem_percentage, self.gpucores)
