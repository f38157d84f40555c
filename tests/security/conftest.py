"""Fixtures shared by the libvgpu red-team modules (test_redteam_hostpid_probe.py and
test_redteam_ctxcost*.py), each of which defines ``any_build`` for its own C program."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.libvgpu.shim_helpers import Toolchain


@pytest.fixture
def node(any_build: tuple[Toolchain, Path], tmp_path: Path) -> Iterator[object]:
    """A one-GPU node (tests.security.test_redteam_hostpid_probe.Node) running the module's program,
    with the plain and with the sanitised build. Modules with a node of their own override it."""
    from tests.security.test_redteam_hostpid_probe import Node

    n = Node(any_build, tmp_path)
    yield n
    n.stop()
