"""kube-vgpu shared domain package.

Every component (webhook, scheduler extender, device plugin, kubectl plugin) imports its rules from
here: resource names, Kubernetes quantity parsing, pod request parsing, devices, allocations, the
versioned annotation codec, the config schema and the placement engine. Components never import
each other.
"""

__version__ = "0.1.0"
