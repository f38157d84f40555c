"""The command-line flags several commands share, declared once (a light module: importing it
loads neither the Kubernetes client nor the engine)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

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


def number_type(allowed: str, *, minimum: float | None = None, above: float | None = None,
                maximum: float | None = None, integer: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number (an integer with ``integer``) that is ``>= minimum``,
    ``> above`` and ``<= maximum`` where given. A bad value is refused with ``'<value>' is not
    allowed; allowed: <allowed>``, argparse naming the flag (exit 2). Raises argparse.ArgumentTypeError."""

    def parse(text: str) -> float:
        try:
            v = float(int(text, 10)) if integer else float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or (minimum is not None and v < minimum) or (above is not None and v <= above) \
                or (maximum is not None and v > maximum):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: {allowed}")
        return int(v) if integer else v

    parse.__name__ = "number"  # argparse names the type in some errors
    return parse


#: argparse ``type`` of every port flag: an integer 0..65535 (0: the system picks a free port)
PORT = number_type("a port 0..65535", minimum=0, maximum=65535, integer=True)
