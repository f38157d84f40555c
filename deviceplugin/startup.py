"""What both node components (``kube-vgpu device-plugin`` and ``kube-vgpu dra-plugin``) check and
load at start, the same way: the node name, the config file and the simulated GPUs of a trial.
Each problem is logged with the flag it concerns and ends the start with exit code 2."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from kube_vgpu.config import Config, load_config
from kube_vgpu.errors import ConfigError

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


def node_start(args: argparse.Namespace) -> NodeStart:
    """``args.node_name``, ``args.config`` and ``args.simulate_gpus`` checked and loaded.

    Raises StartError(2) after logging: no node name, a config that does not load or validate,
    a bad ``--simulate-gpus`` spec."""
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
    return NodeStart(cfg, gpus)
