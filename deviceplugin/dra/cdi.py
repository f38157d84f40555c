"""CDI (Container Device Interface) spec files for prepared claims.

kubelet hands the container runtime (containerd, CRI-O) the CDI device ids a DRA driver returns;
the runtime reads the matching spec files from its CDI directories (``/var/run/cdi`` by default) and
applies their container edits. One spec file per prepared claim, ``<dir>/kube-vgpu.io-vgpu_<claim
uid>.json``, kind :data:`CDI_KIND`:

* spec-level ``containerEdits`` (applied once whenever any device of the file is injected): the env
  contract of the claim (``NVIDIA_VISIBLE_DEVICES``, memory and SM limits, the shared cache path),
  and the mounts of its allocation directory: the shim, ``/etc/ld.so.preload``, the read-write cache
  directory and the read-only limits directory (:func:`deviceplugin.response.alloc_mounts`);
* one device per GPU of the claim, named ``<claim uid>-<device name>``, whose edits are that GPU's
  device nodes (``/dev/nvidia<minor>``) and the driver's control nodes (``/dev/nvidiactl``,
  ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``) that exist on the host.

Files are written atomically (temporary file, fsync, rename, fsync of the directory) with mode 0644.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..response import MountSpec
from ..shimcache import atomic_write

#: CDI vendor and class of our devices; the kind is ``<vendor>/<class>``
CDI_VENDOR = "kube-vgpu.io"
CDI_CLASS = "vgpu"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
#: CDI spec version written (0.5.0 added device nodes' hostPath; 0.6.0 is what current runtimes read)
CDI_VERSION = "0.6.0"
#: device nodes every GPU container needs besides its GPU's own, when present on the host
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
#: a Kubernetes UID as used in file and device names (refused otherwise: it becomes a path)
_UID = re.compile(r"^[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?$")


def check_uid(uid: str) -> str:
    """``uid`` when it is safe in a file name (lower-case letters, digits and ``-``, 1..64, no
    leading or trailing ``-``). Raises ValueError naming the value and what is allowed."""
    if not isinstance(uid, str) or not _UID.match(uid):
        raise ValueError(f"claim uid={uid!r} is not allowed; allowed: lower-case letters, digits and '-' "
                         f"(1..64 characters, a Kubernetes UID)")
    return uid


def spec_path(cdi_dir: str, claim_uid: str) -> str:
    """The spec file of claim ``claim_uid`` in ``cdi_dir``. Raises ValueError for an unsafe uid."""
    return os.path.join(cdi_dir, f"{CDI_VENDOR}-{CDI_CLASS}_{check_uid(claim_uid)}.json")


def device_name(claim_uid: str, device: str) -> str:
    """The CDI device name of ``device`` (e.g. ``gpu-0``) in claim ``claim_uid``."""
    return f"{claim_uid}-{device}"


def device_id(claim_uid: str, device: str) -> str:
    """The fully qualified CDI device id kubelet passes to the runtime: ``kube-vgpu.io/vgpu=<name>``."""
    return f"{CDI_KIND}={device_name(claim_uid, device)}"


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node: ``path`` in the container, ``host_path`` on the host (same when equal)."""

    path: str
    host_path: str


def device_nodes(dev_root: str, minor: int | None) -> list[DeviceNode]:
    """The nodes of the GPU with device minor ``minor`` (``/dev/nvidia<minor>``; none when None, as
    for simulated GPUs), then the control nodes that exist under ``dev_root`` (the host's ``/dev``;
    another root in tests). The GPU's own node is listed whether or not it exists (the runtime
    refuses a container whose device node is missing, which is right)."""
    out: list[DeviceNode] = []
    if minor is not None:
        out.append(DeviceNode(f"/dev/nvidia{minor}", os.path.join(dev_root, f"nvidia{minor}")))
    for n in CONTROL_NODES:
        host = os.path.join(dev_root, n)
        if os.path.exists(host):
            out.append(DeviceNode(f"/dev/{n}", host))
    return out


def _mount(m: MountSpec) -> dict[str, Any]:
    opts = ["ro" if m.read_only else "rw", "nosuid", "nodev", "bind"]
    return {"hostPath": m.host_path, "containerPath": m.container_path, "options": opts}


def _node(n: DeviceNode) -> dict[str, Any]:
    d: dict[str, Any] = {"path": n.path}
    if n.host_path != n.path:
        d["hostPath"] = n.host_path
    return d


def claim_spec(claim_uid: str, envs: Mapping[str, str], mounts: Sequence[MountSpec],
               devices: Sequence[tuple[str, Sequence[DeviceNode]]]) -> dict[str, Any]:
    """The CDI spec (JSON object) of one claim: ``envs`` and ``mounts`` for any container given one
    of its devices; ``devices``: (device name in the pool, its device nodes) per GPU."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [{"name": device_name(claim_uid, name),
                     "containerEdits": {"deviceNodes": [_node(n) for n in nodes]}}
                    for name, nodes in devices],
        "containerEdits": {
            "env": [f"{k}={v}" for k, v in sorted(envs.items())],
            "mounts": [_mount(m) for m in mounts],
        },
    }


def write_spec(cdi_dir: str, claim_uid: str, spec: Mapping[str, Any]) -> str:
    """Write ``spec`` as the claim's spec file (atomically, mode 0644). Returns its path.
    Raises OSError, or ValueError for an unsafe uid."""
    path = spec_path(cdi_dir, claim_uid)
    os.makedirs(cdi_dir, mode=0o755, exist_ok=True)
    atomic_write(path, json.dumps(spec, indent=1, sort_keys=True) + "\n", 0o644)
    return path


def remove_spec(cdi_dir: str, claim_uid: str) -> bool:
    """Remove the claim's spec file; True when one was removed. Raises OSError (other than absent),
    or ValueError for an unsafe uid."""
    try:
        os.unlink(spec_path(cdi_dir, claim_uid))
    except FileNotFoundError:
        return False
    return True
