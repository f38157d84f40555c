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

# Selection constraints (pod annotations; HAMi keys).
ANN_USE_GPUTYPE = "nvidia.com/use-gputype"
ANN_NOUSE_GPUTYPE = "nvidia.com/nouse-gputype"
ANN_USE_GPUUUID = "nvidia.com/use-gpuuuid"
ANN_NOUSE_GPUUUID = "nvidia.com/nouse-gpuuuid"

# Per-pod policy overrides (HAMi keys accepted, ours preferred).
ANN_NODE_POLICY = "kube-vgpu.io/node-scheduler-policy"
ANN_GPU_POLICY = "kube-vgpu.io/gpu-scheduler-policy"
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
LABEL_NODE = "kube-vgpu.io/node"  #: label on bound pods: node name (lets a node agent list its pods)

BIND_ALLOCATING = "allocating"
BIND_SUCCESS = "success"
BIND_FAILED = "failed"

# Opt-out label for the webhook (on pod or namespace), like HAMi's hami.io/webhook=ignore.
LABEL_WEBHOOK = "kube-vgpu.io/webhook"
LABEL_WEBHOOK_IGNORE = "ignore"


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
