"""What a container gets: env, mounts and files, at Allocate and at PreStartContainer (pure; converted
to protobuf by the server).

Env names and units come from :mod:`kube_vgpu.envcontract` (the contract with the libvgpu shim,
documented in docs/env-contract.md). kubelet's ``Allocate`` names only device IDs, so its answer
(:func:`allocate_spec`) carries nothing that depends on which pod the container belongs to:

* ``NVIDIA_VISIBLE_DEVICES``: the GPUs behind the device IDs (no limit variables: limits are only ever
  written once the pod is identified, never from a guess);
* the shim ``--shim-host-path`` (default ``/usr/local/vgpu/libvgpu.so``) mounted read-only at
  ``envcontract.SHIM_CONTAINER_PATH``;
* ``ld.so.preload`` next to the shim (same directory), holding that container path, mounted
  read-only at ``envcontract.PRELOAD_CONTAINER_PATH`` (the dynamic loader then loads the shim into
  every process);
* ``<--cache-host-dir>/<key>`` created and mounted read-write at ``envcontract.CACHE_CONTAINER_DIR``
  (the shim's shared accounting file is ``vgpu.cache`` there), where ``<key>`` is
  :func:`alloc_key` of the device IDs (``alloc-`` + 16 hex digits of their SHA-256);
* ``<--cache-host-dir>/<key>.limits`` mounted read-only at ``envcontract.LIMITS_CONTAINER_DIR``,
  holding at Allocate only the fail-closed placeholder (:func:`kube_vgpu.envcontract.pending_limits_file`).

kubelet then records which container holds the IDs and calls ``PreStartContainer``; the plugin
identifies the pod through kubelet's PodResources API and writes the real limits file
(:func:`prestart_files`: :func:`kube_vgpu.envcontract.limits_file` of the pod's booking) plus an
``owner`` file (pod uid and container name, for the metrics and the cleanup) into the same
read-only directory. The key depends only on the device IDs, so a restarted container (PreStart
again) finds the same directories.

A container whose spec opts out (``CUDA_DISABLE_CONTROL`` ``true`` in any case, or ``1``:
:func:`deviceplugin.podmatch.disables_control`) gets a limits file with ``disable_control=true``.

:func:`container_spec` is the whole answer for a container known in advance (env, mounts and the
limits file under ``<pod uid>_<container>`` names); it is kept for tools and tests that need the
env form of a booking.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kube_vgpu import envcontract

from .podmatch import PendingContainer, slot_uuid

#: default host path of libvgpu.so (``--shim-host-path``; the chart installs it there)
SHIM_HOST_PATH = envcontract.SHIM_HOST_PATH
#: default host directory of the per-container cache directories (``--cache-host-dir``)
CACHE_HOST_DIR = envcontract.CACHE_HOST_DIR
#: file name of the shared accounting file inside the per-container cache dir
CACHE_FILE = "vgpu.cache"
#: file name of the preload file on the host, in the shim's directory
PRELOAD_FILE = "ld.so.preload"
#: prefix of the per-allocation directory names under ``--cache-host-dir``
ALLOC_PREFIX = "alloc-"
#: suffix of the read-only limits directory next to a cache directory
LIMITS_SUFFIX = ".limits"
#: file in the limits directory naming the pod uid and container the allocation was identified as
OWNER_FILE = "owner"


@dataclass(frozen=True, slots=True)
class MountSpec:
    """One bind mount of a container: ``container_path`` where it appears in the container,
    ``host_path`` what it shows from the host, ``read_only`` whether the container may write there
    (the shim, the preload file and the limits directory are read-only; the cache directory is not)."""

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


def alloc_key(device_ids: Sequence[str]) -> str:
    """The directory name of one kubelet allocation: ``alloc-`` + the first 16 hex digits of the
    SHA-256 of the sorted device IDs joined by newlines (order-independent, stable across restarts)."""
    text = "\n".join(sorted(device_ids))
    return ALLOC_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:16]


def allocation_uuids(device_ids: Sequence[str]) -> list[str]:
    """The GPU uuids behind ``device_ids`` (``<uuid>::<k>``), once each, in sorted ID order."""
    out: list[str] = []
    for i in sorted(device_ids):
        u = slot_uuid(i)
        if u not in out:
            out.append(u)
    return out


def limits_dir(cache_host_dir: str, key: str) -> str:
    """``<cache_host_dir>/<key>.limits``: the read-only limits directory of allocation ``key``."""
    return os.path.join(cache_host_dir, key + LIMITS_SUFFIX)


def alloc_dirs(cache_host_dir: str, key: str) -> tuple[str, str]:
    """The host directories of allocation ``key``: its cache directory and its limits directory."""
    return os.path.join(cache_host_dir, key), limits_dir(cache_host_dir, key)


def alloc_mounts(key: str, *, shim_host_path: str, cache_host_dir: str) -> tuple[MountSpec, ...]:
    """The mounts of the allocation directory ``key`` (a name under ``cache_host_dir``): the shim and
    the preload file (read-only), ``<cache_host_dir>/<key>`` read-write at
    ``envcontract.CACHE_CONTAINER_DIR`` and ``<cache_host_dir>/<key>.limits`` read-only at
    ``envcontract.LIMITS_CONTAINER_DIR``. The device plugin's keys are :func:`alloc_key`; the DRA
    plugin's are per claim (``deviceplugin.dra``)."""
    return shim_mounts(shim_host_path, *alloc_dirs(cache_host_dir, key))


def shim_mounts(shim_host_path: str, cache_dir: str, limits_dir: str) -> tuple[MountSpec, ...]:
    """The four mounts every shimmed container gets: the shim and the preload file (read-only), the
    host's ``cache_dir`` read-write at ``envcontract.CACHE_CONTAINER_DIR`` and its ``limits_dir``
    read-only at ``envcontract.LIMITS_CONTAINER_DIR``."""
    return (
        MountSpec(envcontract.SHIM_CONTAINER_PATH, shim_host_path, True),
        MountSpec(envcontract.PRELOAD_CONTAINER_PATH, preload_host_path(shim_host_path), True),
        MountSpec(envcontract.CACHE_CONTAINER_DIR, cache_dir, False),
        MountSpec(envcontract.LIMITS_CONTAINER_DIR, limits_dir, True),
    )


def allocate_spec(device_ids: Sequence[str], *, shim_host_path: str, cache_host_dir: str) -> ContainerSpec:
    """The ``Allocate`` answer for one container request: the GPUs behind ``device_ids``, the shim,
    preload and cache mounts, and the read-only limits directory holding the fail-closed placeholder
    (its file is in ``files``). Nothing in it depends on which pod the container belongs to."""
    key = alloc_key(device_ids)
    mounts = alloc_mounts(key, shim_host_path=shim_host_path, cache_host_dir=cache_host_dir)
    files = (HostFile(os.path.join(limits_dir(cache_host_dir, key), envcontract.LIMITS_FILE_NAME),
                      envcontract.pending_limits_file()),)
    return ContainerSpec(envs={envcontract.VISIBLE_DEVICES: ",".join(allocation_uuids(device_ids))},
                         mounts=mounts, files=files)


def prestart_files(pc: PendingContainer, device_ids: Sequence[str], *, cache_host_dir: str,
                   core_policy: str = "default", core_sharing: str = "strict",
                   graph_memory: str = "sum") -> tuple[HostFile, ...]:
    """The files ``PreStartContainer`` writes for the identified container ``pc`` holding
    ``device_ids``: its limits file (the booking in booking order; ``disable_control=true`` for an
    opted-out container) and the owner file (``<pod uid> <container>``), both in the allocation's
    read-only limits directory. core_policy / core_sharing: the admin's SM-limit policy
    (``envcontract.CORE_POLICIES`` / ``envcontract.CORE_SHARING``); graph_memory: the admin's bound on a
    CUDA graph's launch (``envcontract.GRAPH_MEMORY_BOUNDS``).

    Raises ValueError (from :func:`kube_vgpu.envcontract.limits_file`, naming the field) for a booking
    that cannot be written (0 MiB, cores outside 0..100, ...)."""
    limits = limits_dir(cache_host_dir, alloc_key(device_ids))
    text = envcontract.limits_file(pc.devices, envcontract.CACHE_CONTAINER_PATH, priority=pc.priority,
                                   core_policy=core_policy, disable_control=pc.disable_control,
                                   core_sharing=core_sharing, graph_memory=graph_memory)
    return (HostFile(os.path.join(limits, envcontract.LIMITS_FILE_NAME), text),
            HostFile(os.path.join(limits, OWNER_FILE), f"{pc.uid} {pc.container}\n"))


def read_owner(cache_host_dir: str, key: str) -> tuple[str, str] | None:
    """(pod uid, container) from the owner file of allocation ``key``, or None (absent, unreadable
    or malformed)."""
    try:
        with open(os.path.join(limits_dir(cache_host_dir, key), OWNER_FILE)) as f:
            parts = f.read(512).split()
    except OSError:
        return None
    return (parts[0], parts[1]) if len(parts) == 2 else None


def container_spec(pc: PendingContainer, *, shim_host_path: str, cache_host_dir: str,
                   core_policy: str = "default", core_sharing: str = "strict",
                   graph_memory: str = "sum") -> ContainerSpec:
    """Env, mounts and the limits file for the pending container ``pc`` (visible devices in booking
    order). core_policy / core_sharing: the admin's SM-limit policy (``envcontract.CORE_POLICIES`` /
    ``envcontract.CORE_SHARING``); graph_memory: the admin's bound on a CUDA graph's launch
    (``envcontract.GRAPH_MEMORY_BOUNDS``).

    Raises ValueError (from :func:`kube_vgpu.envcontract.limits_file`) for a booking it cannot write."""
    if pc.disable_control:
        return ContainerSpec(envs={envcontract.VISIBLE_DEVICES: ",".join(d.uuid for d in pc.devices),
                                   envcontract.DISABLE_CONTROL: "true"}, mounts=())
    cache_in_ctr = f"{envcontract.CACHE_CONTAINER_DIR}/{CACHE_FILE}"
    envs = envcontract.container_env(pc.devices, cache_in_ctr, pc.priority)
    limits_dir = os.path.join(cache_host_dir, limits_dir_name(pc.uid, pc.container))
    limits = HostFile(os.path.join(limits_dir, envcontract.LIMITS_FILE_NAME),
                      envcontract.limits_file(pc.devices, cache_in_ctr, priority=pc.priority, core_policy=core_policy,
                                              core_sharing=core_sharing, graph_memory=graph_memory))
    mounts = shim_mounts(shim_host_path, os.path.join(cache_host_dir, cache_dir_name(pc.uid, pc.container)),
                         limits_dir)
    return ContainerSpec(envs=envs, mounts=mounts, files=(limits,))
