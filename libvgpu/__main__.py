"""``python -m libvgpu``: print the path of the built shim (exit status 1 if it is not built)."""

from __future__ import annotations

import sys

from libvgpu import library_path


def main() -> int:
    """Print ``library_path()``; returns a process exit status."""
    try:
        print(library_path())
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
