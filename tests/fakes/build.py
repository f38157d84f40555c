"""Compile the fake CUDA driver, the fake NVML, the libvgpu shim and C test programs.

Used by pytest fixtures and by ``benchmarks/shim_bench.py``. Everything is built with gcc
and ``-Wall -Wextra -Werror``; ``asan=True`` builds AddressSanitizer + UndefinedBehaviorSanitizer
variants (any undefined behaviour aborts the process, so a test sees it as a crash).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIM_SRC = ROOT / "libvgpu" / "src"
FAKES_SRC = Path(__file__).resolve().parent
PROGS_SRC = ROOT / "tests" / "libvgpu" / "progs"

WARN = ["-Wall", "-Wextra", "-Werror"]
ASAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]


class BuildError(RuntimeError):
    """Raised when gcc fails; the message holds the compiler output."""


@dataclass(frozen=True)
class Built:
    """Paths of one build: the directory holding ``libcuda.so.1`` and ``libnvidia-ml.so.1``."""

    libdir: Path
    libcuda: Path
    libnvml: Path
    shim: Path
    asan: bool


def gcc() -> str:
    """Return the C compiler to use (``$CC`` or ``gcc``); raises BuildError if none is found."""
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise BuildError(f"C compiler {cc!r} not found")
    return cc


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")


def asan_runtime() -> str:
    """Return the path of gcc's libasan.so, to preload ahead of the shim (ASan must come first)."""
    out = subprocess.run([gcc(), "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return os.path.realpath(out)


def build_shim(out: Path, asan: bool = False, limits_path: Path | None = None) -> Path:
    """Compile libvgpu into ``out/libvgpu.so``; returns the path. Raises BuildError.

    limits_path: compile in this path for the container's limits file instead of the production
    ``/usr/local/vgpu/limits/vgpu.limits`` (the shim never takes that path from the environment).
    """
    out.mkdir(parents=True, exist_ok=True)
    dst = out / "libvgpu.so"
    srcs = sorted(str(p) for p in SHIM_SRC.glob("*.c"))
    cmd = [gcc(), "-O2", "-g", *WARN, "-fPIC", "-shared", "-fvisibility=hidden", f"-I{SHIM_SRC}"]
    if limits_path is not None:
        cmd.append(f'-DVGPU_LIMITS_PATH="{limits_path}"')
    cmd += ASAN if asan else []
    cmd += ["-o", str(dst), *srcs, "-Wl,-Bsymbolic", "-ldl", "-lpthread"]
    _run(cmd)
    return dst


def build_fakes(out: Path, asan: bool = False) -> tuple[Path, Path]:
    """Compile ``libcuda.so.1`` and ``libnvidia-ml.so.1`` fakes into ``out``. Raises BuildError."""
    out.mkdir(parents=True, exist_ok=True)
    flags = [gcc(), "-O2", "-g", *WARN, "-fPIC", "-shared", f"-I{SHIM_SRC}", f"-I{FAKES_SRC}"]
    flags += ASAN if asan else []
    cuda = out / "libcuda.so.1"
    nvml = out / "libnvidia-ml.so.1"
    _run([*flags, "-o", str(cuda), str(FAKES_SRC / "fakecuda.c"), "-Wl,-soname,libcuda.so.1", "-Wl,-Bsymbolic",
          "-lpthread"])
    _run([*flags, "-o", str(nvml), str(FAKES_SRC / "fakenvml.c"), "-Wl,-soname,libnvidia-ml.so.1", "-lpthread"])
    # link-time names for programs that link -lcuda / -lnvidia-ml directly
    for name, target in (("libcuda.so", cuda), ("libnvidia-ml.so", nvml)):
        link = out / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target.name)
    return cuda, nvml


def build_prog(src: Path, out: Path, libdir: Path, asan: bool = False, extra: list[str] | None = None) -> Path:
    """Compile a C test program linked directly against the fake ``libcuda`` in ``libdir``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [gcc(), "-O2", "-g", *WARN, f"-I{SHIM_SRC}", *(ASAN if asan else []), "-o", str(out), str(src),
           f"-L{libdir}", "-lcuda", "-ldl", "-lpthread", f"-Wl,-rpath,{libdir}", *(extra or [])]
    _run(cmd)
    return out


def build_all(out: Path, asan: bool = False) -> Built:
    """Build fakes and shim into ``out`` (fresh or reused). Raises BuildError."""
    cuda, nvml = build_fakes(out, asan=asan)
    shim = build_shim(out, asan=asan)
    return Built(libdir=out, libcuda=cuda, libnvml=nvml, shim=shim, asan=asan)


def shim_env(built: Built, base: dict[str, str] | None = None, preload: bool = True) -> dict[str, str]:
    """Environment that runs a program on the fakes, with the shim preloaded when ``preload``."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = f"{built.libdir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    if preload:
        pre = [str(built.shim)]
        if built.asan:
            pre.insert(0, asan_runtime())
            env.setdefault("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=0:exitcode=86")
            env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
        env["LD_PRELOAD"] = " ".join(pre)
    return env


if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    b = build_all(Path(sys.argv[1] if len(sys.argv) > 1 else "build/fakes"))
    print(b)
