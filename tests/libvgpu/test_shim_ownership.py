"""The shim's C files do not talk through shared writable globals: each piece of state is owned by one file.

- No object file of ``libvgpu/src`` defines a writable global (``.data``/``.bss``/TLS, external linkage):
  state is ``static`` in the file that owns it, and other files read it through a read-only view
  (``vgpu_cfg``, ``vgpu_cuda_ready``) or call the owner's functions (``vnvml_*``, ``limiter_init``). The one
  exception is the table of the real driver's entry points (``real_<name>``, generated from
  ``hooks_list.h``): defined in ``core.c`` and assigned there only.
- The read-only views really are read-only: a file that writes through them does not compile.

Each check is also run against a planted violation, so a checker that stopped seeing anything fails.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fakes import build as fakebuild

SRC = fakebuild.SHIM_SRC
FLAGS = ["-O2", *fakebuild.WARN, "-fPIC", "-fvisibility=hidden", f"-I{SRC}"]
#: the real driver's entry points: the one table of writable globals, owned by core.c
ABI_OWNER = "core.c"
ABI_PREFIX = "real_"
#: ``objdump -t`` line: value, 7 flag characters, section, size, [.hidden] name
SYMBOL = re.compile(r"^[0-9a-f]+ (?P<flags>.{7}) (?P<section>\S+)\s+[0-9a-f]+\s+(?:\.hidden\s+)?(?P<name>\S+)$")
#: sections written at run time (``.data.rel.ro``: read-only once relocated)
WRITABLE = re.compile(r"^(?!\.data\.rel\.ro)(\.data|\.bss|\.tdata|\.tbss|\*COM\*)(\.|$)")


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("gcc") is None or shutil.which("objdump") is None:
        pytest.skip("gcc and objdump (binutils) are needed")
    out = tmp_path_factory.mktemp("shim-objects")
    return {src.name: _compile(src, out / f"{src.stem}.o") for src in sorted(SRC.glob("*.c"))}


def _compile(src: Path, obj: Path) -> Path:
    proc = subprocess.run([fakebuild.gcc(), *FLAGS, "-c", str(src), "-o", str(obj)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return obj


def writable_globals(obj: Path) -> list[tuple[str, str]]:
    """(name, section) of every writable object with external linkage that ``obj`` defines."""
    text = subprocess.run(["objdump", "-t", str(obj)], capture_output=True, text=True, check=True).stdout
    found = []
    for line in text.splitlines():
        m = SYMBOL.match(line)
        if m and m["flags"][0] in "gu" and m["flags"][6] == "O" and WRITABLE.match(m["section"]):
            found.append((m["name"], m["section"]))
    return found


def ownership_violations(objs: dict[str, Path]) -> list[str]:
    """One message per writable global shared between files (the ABI table in its owner excepted)."""
    bad = []
    for file, obj in sorted(objs.items()):
        for name, section in writable_globals(obj):
            if file == ABI_OWNER and name.startswith(ABI_PREFIX):
                continue
            bad.append(f"libvgpu/src/{file} defines the writable global {name!r} ({section}) that other files can "
                       f"write: make it static in its owner and expose a const view or the owner's functions")
    return bad


def _code(text: str) -> str:
    """C source without comments and string literals."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def abi_writes_outside_owner(sources: dict[str, str]) -> list[str]:
    """``file:line`` of every assignment to a ``real_<name>`` pointer outside ``core.c``."""
    assign = re.compile(rf"\b{ABI_PREFIX}\w*\s*(?:\[[^\]]*\]\s*)?(?<![=!<>])=(?!=)")
    return [f"libvgpu/src/{file}:{text.count(chr(10), 0, m.start()) + 1} assigns {m.group(0).rstrip('= ')!r}"
            for file, text in sorted(sources.items()) if file != ABI_OWNER
            for m in assign.finditer(_code(text))]


def test_no_file_shares_writable_state(objects: dict[str, Path]) -> None:
    assert ownership_violations(objects) == []
    # the checker sees what it looks for: the ABI table in core.c is there (and allowed)
    assert any(name.startswith(ABI_PREFIX) for name, _ in writable_globals(objects[ABI_OWNER]))


def test_the_checker_reports_a_planted_shared_global(tmp_path: Path, objects: dict[str, Path]) -> None:
    src = tmp_path / "leak.c"
    src.write_text('#include "vgpu.h"\nint g_leaked_flag;\nstatic int g_private;\n'
                   "int leak_touch(void) { return ++g_private + g_leaked_flag; }\n")
    planted = {**objects, "leak.c": _compile(src, tmp_path / "leak.o")}
    bad = ownership_violations(planted)
    assert len(bad) == 1 and "leak.c" in bad[0] and "g_leaked_flag" in bad[0], bad


def test_only_core_assigns_the_real_entry_points() -> None:
    sources = {p.name: p.read_text() for p in SRC.glob("*.c")}
    assert abi_writes_outside_owner(sources) == []
    planted = {"memory.c": "/* real_cuInit = x; */\nvoid f(void) {\n    if (real_cuInit == 0) real_cuMemAlloc_v2 = 0;\n}\n"}
    assert abi_writes_outside_owner(planted) == ["libvgpu/src/memory.c:3 assigns 'real_cuMemAlloc_v2'"]


@pytest.mark.parametrize("write", ["vgpu_cfg->enabled = 0;", "vgpu_cfg->mem_limit[0] = 1;",
                                   "*vgpu_cuda_ready = 1;", "vgpu_cfg = 0;"])
def test_the_read_only_views_cannot_be_written(tmp_path: Path, write: str) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not available")
    src = tmp_path / "writer.c"
    src.write_text(f'#include "vgpu.h"\nvoid writer(void) {{ {write} }}\n')
    proc = subprocess.run([fakebuild.gcc(), *FLAGS, "-fsyntax-only", str(src)], capture_output=True, text=True)
    assert proc.returncode != 0 and re.search(r"read-only|assign", proc.stderr), (write, proc.stderr)
    # the same file compiles when it only reads
    src.write_text('#include "vgpu.h"\nint reader(void) { return vgpu_cfg->enabled + *vgpu_cuda_ready; }\n')
    proc = subprocess.run([fakebuild.gcc(), *FLAGS, "-fsyntax-only", str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
