"""The scheduler's JSON logs: the shared formatter of :mod:`kube_vgpu.jsonlog`."""

from kube_vgpu.jsonlog import JSONFormatter, StderrHandler, setup

__all__ = ["JSONFormatter", "StderrHandler", "setup"]
