"""libvgpu: the LD_PRELOAD shim that enforces GPU memory and SM limits inside a container.

The C sources live in ``libvgpu/src``; setuptools compiles them into ``libvgpu/libvgpu.so``
(see ``setup.py``). The device plugin mounts that file into containers and preloads it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["library_path", "source_dir", "LIBRARY_NAME"]

LIBRARY_NAME = "libvgpu.so"


def source_dir() -> Path:
    """Return the directory holding the shim's C sources (``*.c``, ``*.h``)."""
    return Path(__file__).resolve().parent / "src"


def library_path() -> Path:
    """Return the absolute path of the built shim ``libvgpu.so``.

    Raises:
        FileNotFoundError: the package was installed without building the shim
            (run ``pip install -e .`` or ``python setup.py build_ext --inplace``).
    """
    path = Path(__file__).resolve().parent / LIBRARY_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is not built; run `pip install -e .` or `python setup.py build_ext --inplace`"
        )
    return path
