"""The command-line flags several commands share, declared once (a light module: importing it
loads neither the Kubernetes client nor the engine)."""

from __future__ import annotations

import argparse

from .jsonlog import LEVELS


def add_level_flag(p: argparse.ArgumentParser) -> None:
    """Declare ``--log-level`` (one of :data:`kube_vgpu.jsonlog.LEVELS`, default info), read by
    :func:`kube_vgpu.jsonlog.setup`."""
    p.add_argument("--log-level", default="info", choices=LEVELS, help="log level (default info)")


def add_kubeconfig_flag(p: argparse.ArgumentParser, *, in_cluster_first: bool = True) -> None:
    """Declare ``--kubeconfig FILE``, read by :func:`kube_vgpu.kubeapi.load_api_client`; its help
    states the same order: a component's, or with ``in_cluster_first=False`` a command-line tool's."""
    where = ("in-cluster, then $KUBECONFIG or ~/.kube/config" if in_cluster_first
             else "$KUBECONFIG or ~/.kube/config, then in-cluster")
    p.add_argument("--kubeconfig", metavar="FILE", help=f"kubeconfig file (default: {where})")
