"""Helpers for the libvgpu tests: build products, running scenarios under the shim, parsing output."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import build as fakebuild

PROGS = Path(__file__).resolve().parent / "progs"
_GPU_CHECK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
if str(_GPU_CHECK) not in sys.path:  # the GPU check's parser of the probes' key=value lines
    sys.path.insert(0, str(_GPU_CHECK))

from gpu_check import parse as parse  # noqa: E402  (re-exported: the tests import it from here)

MIB = 1024 * 1024
GIB = 1024 * MIB


@dataclass(frozen=True)
class Toolchain:
    """A built set: fakes + shim (``built``) and the scenario program ``prog``."""

    built: fakebuild.Built
    prog: Path
    tmp: Path

    def env(self, preload: bool = True, /, **extra: str) -> dict[str, str]:
        """Environment for a child process: fakes on the library path, shim preloaded."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "LIBVGPU_", "FAKE_"))}
        base.pop("LD_PRELOAD", None)
        env = fakebuild.shim_env(self.built, base, preload=preload)
        env.setdefault("LIBVGPU_LOG_LEVEL", "2")
        env.update(extra)
        return env


def make_toolchain(out: Path, asan: bool = False) -> Toolchain:
    """Build fakes, shim and scenario program into ``out`` (ASan variants when ``asan``)."""
    built = fakebuild.build_all(out, asan=asan)
    prog = fakebuild.build_prog(PROGS / "vgpu_test.c", out / "vgpu_test", out, asan=asan)
    return Toolchain(built=built, prog=prog, tmp=out)


_SHARED: dict[bool, Toolchain] = {}


def shared_toolchain(factory: pytest.TempPathFactory, asan: bool = False) -> Toolchain:
    """The fakes, shim and scenario program built once per test session for each variant (plain, or
    AddressSanitizer + UndefinedBehaviorSanitizer when ``asan``): every test package and red-team
    module runs on the same build, as every container of a node runs the same shim. Raises
    BuildError (a failed build is not kept: the next caller tries again)."""
    tc = _SHARED.get(asan)
    if tc is None:
        tc = _SHARED[asan] = make_toolchain(factory.mktemp("vgpu-asan" if asan else "vgpu"), asan=asan)
    return tc


def rc_usage(value: str) -> tuple[int, int]:
    """Split a ``<CUresult>:<usage bytes>`` value."""
    rc, used = value.split(":")
    return int(rc), int(used)


def run(tc: Toolchain, mode: str, scenario: str, *args: str, timeout: float = 60, check: bool = True,
        **env: str) -> subprocess.CompletedProcess[str]:
    """Run the scenario program under the shim; raises AssertionError on a non-zero exit if ``check``."""
    proc = subprocess.run([str(tc.prog), mode, scenario, *args], env=tc.env(**env), capture_output=True,
                          text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def run_python(tc: Toolchain, code: str, timeout: float = 60, preload: bool = True,
               **env: str) -> subprocess.CompletedProcess[str]:
    """Run Python ``code`` in a child interpreter, under the shim unless ``preload`` is False."""
    root = str(Path(__file__).resolve().parents[2])
    e = tc.env(preload, **env)
    e["PYTHONPATH"] = root
    proc = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def limits_path(tc: Toolchain) -> Path:
    """Where the ``tc_limits`` shim looks for the container's limits file."""
    return tc.tmp / "limits" / "vgpu.limits"


def preload_ns_command(tc: Toolchain, work: Path, argv: list[str]) -> list[str]:
    """A command that runs ``argv`` in a private mount namespace whose ``/etc/ld.so.preload`` names the
    shim (as the device plugin's read-only mount does in a container), leaving the host's /etc alone.
    Needs root (``unshare --mount``). /etc is overlaid (or, without overlayfs, a copy is bind-mounted)."""
    up, wk, copy = work / "etc-up", work / "etc-work", work / "etc-copy"
    for d in (up, wk):
        d.mkdir(parents=True, exist_ok=True)
    (up / "ld.so.preload").write_text(f"{tc.built.shim}\n")
    script = (
        f"mount -t overlay overlay -o lowerdir=/etc,upperdir={up},workdir={wk} /etc 2>/dev/null || "
        f"{{ mkdir -p {copy} && cp -a /etc/. {copy}/ && cp {up}/ld.so.preload {copy}/ && mount --bind {copy} /etc; }} "
        '|| exit 90; exec "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", *argv]


def program_fixtures(src: Path, stem: str) -> tuple[Any, Any, Any]:
    """The fixtures ``built``, ``built_asan`` and ``any_build`` of a test module driving the C
    program ``src`` over the fakes and the shim of :func:`shared_toolchain` (only the program is built
    per module): each a (toolchain, program) pair, optimised, with
    AddressSanitizer and UndefinedBehaviorSanitizer (skipped where the toolchain has no libasan; any
    finding fails the process), and both in turn. ``stem`` names the build directories. Assign them
    to module names of the same name: ``built, built_asan, any_build = program_fixtures(SRC, "x")``."""

    def build(factory: pytest.TempPathFactory, asan: bool) -> tuple[Toolchain, Path]:
        tc = shared_toolchain(factory, asan=asan)
        out = factory.mktemp(f"{stem}-asan" if asan else stem)
        return tc, fakebuild.build_prog(src, out / src.stem, tc.built.libdir, asan=asan)

    @pytest.fixture(scope="module")
    def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Toolchain, Path]:
        return build(tmp_path_factory, asan=False)

    @pytest.fixture(scope="module")
    def built_asan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Toolchain, Path]:
        try:
            fakebuild.asan_runtime()
            return build(tmp_path_factory, asan=True)
        except fakebuild.BuildError as exc:  # pragma: no cover - toolchains without libasan
            pytest.skip(f"AddressSanitizer unavailable: {exc}")

    @pytest.fixture(params=["plain", "asan"])
    def any_build(request: pytest.FixtureRequest) -> tuple[Toolchain, Path]:
        return request.getfixturevalue("built" if request.param == "plain" else "built_asan")

    return built, built_asan, any_build


def play_steps(build: tuple[Toolchain, Path], *argv: str, shim: bool = True,
               timeout: float = 120, **env_extra: str) -> tuple[dict[str, tuple[int, int, int]], dict[str, str]]:
    """Run a red-team program of :func:`program_fixtures` under a 1 GiB limit with contexts not
    charged (``shim``: preloaded or not; ``env_extra``: more variables, e.g. the fakes' knobs); it must
    exit 0. Returns each step's (rc, charged, peak), from the lines ``name=rc:charged:peak``, and every
    ``name=value`` line it printed."""
    tc, prog = build
    env = tc.env(shim, CUDA_DEVICE_MEMORY_LIMIT="1g", LIBVGPU_CONTEXT_COST="0", LIBVGPU_LOG_LEVEL="1", **env_extra)
    proc = subprocess.run([str(prog), *argv], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = parse(proc.stdout)
    steps = {}
    for k, v in out.items():
        if v.count(":") == 2:
            rc, used, peak = v.split(":")
            steps[k] = (int(rc), int(used), int(peak))
    return steps, out

