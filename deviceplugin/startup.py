"""What both node components (``kube-vgpu device-plugin`` and ``kube-vgpu dra-plugin``) check and
load at start, the same way: the node name, the config file and the simulated GPUs of a trial.
Each problem is logged with the flag it concerns and ends the start with exit code 2."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kube_vgpu import jsonlog
from kube_vgpu.cliflags import PORT, add_kubeconfig_flag, add_level_flag
from kube_vgpu.config import Config, load_config
from kube_vgpu.errors import ConfigError

from .response import CACHE_HOST_DIR, SHIM_HOST_PATH
from .simgpu import SimulatedGPUs, SimulateSpecError
from .simgpu import from_flag as simulated_gpus

log = logging.getLogger("kube_vgpu.deviceplugin")


class StartError(Exception):
    """The start cannot go on; the reason is logged already. ``code``: the exit code."""

    def __init__(self, code: int = 2) -> None:
        super().__init__(code)
        self.code = code


@dataclass(frozen=True, slots=True)
class NodeStart:
    """The loaded config, and the simulated GPUs (None: ask NVML)."""

    config: Config
    gpus: SimulatedGPUs | None


def node_parser(prog: str, description: str, *, node_help: str, simulate_help: str) -> argparse.ArgumentParser:
    """A node component's parser, with the flags both node components read the same way:
    ``--config``, ``--log-level``, ``--node-name`` (env ``NODE_NAME``), ``--kubeconfig`` and
    ``--simulate-gpus`` (read by :func:`node_start`).

    node_help: what the node name is also used for; simulate_help: what the simulated GPUs replace."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", help="config file (kube-vgpu.io/v1); defaults when omitted")
    add_level_flag(p)
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""), help=node_help)
    add_kubeconfig_flag(p)
    p.add_argument("--simulate-gpus", metavar="COUNTxMIB[:MODEL],...", default="",
                   help=f"GPU-less trial: {simulate_help} (e.g. 4x24576). NOTHING IS ISOLATED; never for workloads")
    return p


def add_metrics_flags(p: argparse.ArgumentParser, *, port: int) -> None:
    """Declare where a node component serves /metrics, /livez and /readyz."""
    p.add_argument("--metrics-port", type=PORT,
                   default=port,
                   help=f"port of /metrics, /livez and /readyz (default {port}; 0: any)")
    p.add_argument("--metrics-bind-address", default="0.0.0.0", help="address to serve them on")


def add_shim_flags(p: argparse.ArgumentParser, *, cache_help: str) -> None:
    """Declare where the node components find the shim and keep the containers' shared files on the host:
    ``--shim-host-path`` (``ld.so.preload`` is kept next to it) and ``--cache-host-dir``."""
    p.add_argument("--shim-host-path", default=SHIM_HOST_PATH,
                   help="host path of libvgpu.so; ld.so.preload is kept next to it")
    p.add_argument("--cache-host-dir", default=CACHE_HOST_DIR, help=cache_help)


def node_start(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, NodeStart]:
    """Parse ``argv``, start JSON logging at ``--log-level``, then check and load ``args.node_name``,
    ``args.config`` and ``args.simulate_gpus``. Returns the parsed args and what they loaded.

    Raises StartError(2) after logging: no node name, a config that does not load or validate,
    a bad ``--simulate-gpus`` spec."""
    args = parser.parse_args(argv)
    jsonlog.setup(args.log_level)
    if not args.node_name:
        log.error("--node-name is required (or set env NODE_NAME)")
        raise StartError(2)
    try:
        cfg = load_config(args.config)
    except (ConfigError, OSError) as e:
        log.error("invalid config", extra={"key": getattr(e, "key", "(file)"), "error": str(e)})
        raise StartError(2) from None
    gpus = None
    if args.simulate_gpus:
        try:
            gpus = simulated_gpus(args.simulate_gpus, args.node_name)
        except SimulateSpecError as e:
            log.error("invalid --simulate-gpus", extra={"error": str(e)})
            raise StartError(2) from None
    return args, NodeStart(cfg, gpus)


def node_main(parser: Callable[[], argparse.ArgumentParser],
              serve: Callable[[argparse.Namespace, NodeStart], int]) -> Callable[[list[str] | None], int]:
    """A node command's ``main(argv)``: :func:`node_start` with ``parser()``, then ``serve(args,
    start)`` until it returns the exit code (the exit code of a :class:`StartError` when the start
    failed)."""

    def main(argv: list[str] | None = None) -> int:
        try:
            args, start = node_start(parser(), argv)
        except StartError as e:
            return e.code
        return serve(args, start)

    main.__doc__ = "Run until SIGTERM/SIGINT. Returns the exit code."
    return main


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set (the handlers are installed now, before anything starts)."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    return done


def serve_until_stopped(done: threading.Event, alive: Callable[[], bool], logger: logging.Logger) -> None:
    """Block until ``done`` is set or ``alive()`` turns false (checked every second, logged as an error
    on ``logger``); then log the shutdown. The caller stops its servers after it returns."""
    while not done.wait(1.0):
        if not alive():
            logger.error("a background thread died; exiting")
            break
    logger.info("shutting down")
