"""The shim's configuration names (libvgpu/src/config.h, one place) agree with their writer,
kube_vgpu/envcontract.py: every variable and limits-file key the device plugin writes is one the shim
reads, every key the shim reads is one the plugin writes, with the same values and format version.

The shim lists its tables through ``vgpu_config_names()``; the writer's side comes from running
``envcontract.container_env`` / ``limits_file`` / ``pending_limits_file`` with every option set.
"""

from __future__ import annotations

import re

from kube_vgpu import envcontract
from kube_vgpu.model import DeviceBooking
from tests.libvgpu.shim_helpers import Toolchain, run_python

DEVICES = [DeviceBooking("GPU-00000000-0000-4000-8000-000000000000", 1000, 30),
           DeviceBooking("GPU-00000000-0000-4000-8000-000000000001", 2000, 50)]


def _shim_names(tc: Toolchain) -> dict[str, list[str]]:
    code = (f"import ctypes; f = ctypes.CDLL({str(tc.built.shim)!r}).vgpu_config_names; "
            "f.restype = ctypes.c_char_p; print(f().decode())")
    text = run_python(tc, code, preload=False).stdout.strip()
    return {k: [x for x in v.split(",") if x] for k, v in (part.split("=", 1) for part in text.split(";"))}


def _indexed(name: str) -> str:
    return re.sub(r"_\d+$", "", name)


def test_env_names_match_the_contract(tc: Toolchain) -> None:
    env = set(_shim_names(tc)["env"])
    for name in (envcontract.VISIBLE_DEVICES, envcontract.SM_LIMIT, envcontract.SHARED_CACHE,
                 envcontract.DISABLE_CONTROL, envcontract.LOG_LEVEL, envcontract.TASK_PRIORITY,
                 envcontract.MEMORY_LIMIT_PREFIX, envcontract.SM_LIMIT_PREFIX):
        assert name in env, name
    # everything the plugin writes is read: per-device names by their prefix
    written = set(envcontract.container_env(DEVICES, "/c/vgpu.cache", priority=1))
    written |= set(envcontract.container_env(DEVICES[:1], "/c/vgpu.cache"))
    for name in written:
        assert name in env or re.sub(r"\d+$", "", name) in env, name


def test_limits_file_keys_match_the_contract(tc: Toolchain) -> None:
    names = _shim_names(tc)
    text = envcontract.limits_file(DEVICES, priority=0, core_policy="disable", disable_control=True,
                                   core_sharing="work_conserving", graph_memory="peak")
    text += envcontract.pending_limits_file()
    written = {_indexed(line.split("=", 1)[0]) for line in text.splitlines() if line and not line.startswith("#")}
    assert written == set(names["keys"])  # both ways: no key one side does not know
    assert names["core_policy"] == list(envcontract.CORE_POLICIES)
    assert names["core_sharing"] == list(envcontract.CORE_SHARING)
    assert names["graph_memory"] == list(envcontract.GRAPH_MEMORY_BOUNDS)
    assert names["version"] == [str(envcontract.LIMITS_FILE_VERSION)]
    assert names["limits_path"] == [envcontract.LIMITS_CONTAINER_PATH]
