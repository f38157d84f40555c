"""What a container gets from Allocate: env and mounts (pure; converted to protobuf by the server).

Env names and units come from :mod:`kube_vgpu.envcontract` (the contract with the libvgpu shim,
documented in docs/env-contract.md). Host layout (paths on the node):

* the shim ``--shim-host-path`` (default ``/usr/local/vgpu/libvgpu.so``) is mounted read-only at
  ``envcontract.SHIM_CONTAINER_PATH``;
* ``ld.so.preload`` next to the shim (same directory) holds that container path and is mounted
  read-only at ``/etc/ld.so.preload`` (the dynamic loader then loads the shim into every process);
* ``<--cache-host-dir>/<pod uid>_<container>`` is created and mounted read-write at
  ``envcontract.CACHE_CONTAINER_DIR``; the shim's shared accounting file is
  ``<CACHE_CONTAINER_DIR>/vgpu.cache`` inside the container;
* ``<--cache-host-dir>/<pod uid>_<container>.limits/vgpu.limits`` holds the container's limits
  (:func:`kube_vgpu.envcontract.limits_file`, the same bookings as the env); the directory is mounted
  read-only at ``envcontract.LIMITS_CONTAINER_DIR``, so no process in the container can change it, and it
  is a sibling of the cache directory (never inside the read-write mount). The file is part of
  ``ContainerSpec.files``; :func:`deviceplugin.shimcache.write_host_files` writes it before Allocate
  answers. Its directory name has the ``<pod uid>_<container>`` form plus a suffix, so the cache
  directory cleanup removes it with the pod.

With ``CUDA_DISABLE_CONTROL`` set to ``true`` (any case) or ``1`` in the container's env (the values the
shim accepts, :func:`deviceplugin.podmatch.disables_control`) the container only gets
``NVIDIA_VISIBLE_DEVICES`` (no limits, no shim, no cache).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kube_vgpu import envcontract

from .podmatch import PendingContainer

#: file name of the shared accounting file inside the per-container cache dir
CACHE_FILE = "vgpu.cache"
#: file name of the preload file on the host, in the shim's directory
PRELOAD_FILE = "ld.so.preload"


@dataclass(frozen=True, slots=True)
class MountSpec:
    """One bind mount: container path, host path, read-only flag."""

    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True, slots=True)
class HostFile:
    """A file the device plugin writes on the host before answering: path, text, mode."""

    host_path: str
    contents: str
    mode: int = 0o444


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """The answer for one container: env (name -> value) and mounts, in kubelet's terms; ``files``
    must exist on the host before kubelet starts the container (a read-only mount's source)."""

    envs: dict[str, str]
    mounts: tuple[MountSpec, ...]
    files: tuple[HostFile, ...] = ()


def preload_host_path(shim_host_path: str) -> str:
    """Host path of the ``ld.so.preload`` file that goes with the shim at ``shim_host_path``."""
    return os.path.join(os.path.dirname(shim_host_path) or ".", PRELOAD_FILE)


def preload_contents() -> str:
    """Contents of the preload file: the shim's path inside the container, one line."""
    return envcontract.SHIM_CONTAINER_PATH + "\n"


def cache_dir_name(pod_uid: str, container: str) -> str:
    """Per-container directory name under ``--cache-host-dir``: ``<pod uid>_<container>``."""
    return f"{pod_uid}_{container}"


def limits_dir_name(pod_uid: str, container: str) -> str:
    """Per-container limits directory name under ``--cache-host-dir``: ``<pod uid>_<container>.limits``
    (container names are DNS labels, without dots, so it never equals a cache directory name)."""
    return f"{cache_dir_name(pod_uid, container)}.limits"


def container_spec(pc: PendingContainer, *, shim_host_path: str, cache_host_dir: str,
                   core_policy: str = "default") -> ContainerSpec:
    """Env, mounts and the limits file for the pending container ``pc`` (visible devices in booking
    order). core_policy: the admin's SM-limit policy (``envcontract.CORE_POLICIES``).

    Raises ValueError (from :func:`kube_vgpu.envcontract.limits_file`) for a booking it cannot write."""
    if pc.disable_control:
        return ContainerSpec(envs={envcontract.VISIBLE_DEVICES: ",".join(d.uuid for d in pc.devices),
                                   envcontract.DISABLE_CONTROL: "true"}, mounts=())
    cache_in_ctr = f"{envcontract.CACHE_CONTAINER_DIR}/{CACHE_FILE}"
    envs = envcontract.container_env(pc.devices, cache_in_ctr, pc.priority)
    limits_dir = os.path.join(cache_host_dir, limits_dir_name(pc.uid, pc.container))
    limits = HostFile(os.path.join(limits_dir, envcontract.LIMITS_FILE_NAME),
                      envcontract.limits_file(pc.devices, cache_in_ctr, priority=pc.priority, core_policy=core_policy))
    mounts = (
        MountSpec(envcontract.SHIM_CONTAINER_PATH, shim_host_path, True),
        MountSpec(envcontract.PRELOAD_CONTAINER_PATH, preload_host_path(shim_host_path), True),
        MountSpec(envcontract.CACHE_CONTAINER_DIR,
                  os.path.join(cache_host_dir, cache_dir_name(pc.uid, pc.container)), False),
        MountSpec(envcontract.LIMITS_CONTAINER_DIR, limits_dir, True),
    )
    return ContainerSpec(envs=envs, mounts=mounts, files=(limits,))


def unlimited_devices(spec: ContainerSpec) -> list[str]:
    """Visible GPUs of ``spec`` the shim would not limit: no ``CUDA_DEVICE_MEMORY_LIMIT_<i>``, or one
    that is not a positive ``<MiB>m`` (the shim reads 0 as no limit). Empty for an opted-out container
    (``CUDA_DISABLE_CONTROL``), which is unlimited by choice. The last check before kubelet gets an answer."""
    if envcontract.DISABLE_CONTROL in spec.envs:
        return []
    out = []
    visible = [u for u in spec.envs.get(envcontract.VISIBLE_DEVICES, "").split(",") if u]
    for i, uuid in enumerate(visible):
        raw = spec.envs.get(f"{envcontract.MEMORY_LIMIT_PREFIX}{i}", "")
        try:
            ok = raw.endswith("m") and int(raw[:-1]) > 0
        except ValueError:
            ok = False
        if not ok:
            out.append(uuid)
    return out
