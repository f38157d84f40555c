"""The shim's shared accounting region, read from Python: see :mod:`kube_vgpu.shimregion` (the
shared package holds the one reader, so the device plugin needs nothing from this package)."""

from kube_vgpu.shimregion import *  # noqa: F403
from kube_vgpu.shimregion import __all__  # noqa: F401
