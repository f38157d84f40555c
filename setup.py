"""Build hook for the libvgpu LD_PRELOAD shim (all other metadata lives in pyproject.toml).

The shim is a plain shared library, not a Python extension: it is compiled from
``libvgpu/src/*.c`` with gcc (no CUDA toolkit) and placed at ``libvgpu/libvgpu.so`` inside the
package, so ``pip install -e .`` and wheel builds ship it. ``libvgpu.library_path()`` finds it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
SRC = HERE / "libvgpu" / "src"
CFLAGS = ["-O2", "-g", "-Wall", "-Wextra", "-Werror", "-fPIC", "-fvisibility=hidden"]
LDFLAGS = ["-shared", "-Wl,-Bsymbolic", "-ldl", "-lpthread"]


class BuildShim(build_ext):
    """Compiles the shim with gcc directly (the Python C-API flags are not wanted)."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext: Extension) -> None:
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "gcc")
        cmd = [cc, *CFLAGS, f"-I{SRC}", "-o", str(out), *ext.sources, *LDFLAGS]
        self.announce(" ".join(cmd), level=2)
        subprocess.run(cmd, check=True)


setup(
    ext_modules=[Extension("libvgpu.libvgpu", sources=sorted(str(p.relative_to(HERE)) for p in SRC.glob("*.c")))],
    cmdclass={"build_ext": BuildShim},
)
