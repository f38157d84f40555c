"""``kube-vgpu dra-plugin``: the node side of the DRA driver (docs/dra-node.md).

Publishes the node's GPUs as ResourceSlices (:class:`deviceplugin.dra_publish.SlicePublisher`),
registers with kubelet as a DRA plugin and serves NodePrepareResources / NodeUnprepareResources
(:mod:`deviceplugin.dra.grpcserver`, :mod:`deviceplugin.dra.plugin`).

Exit codes: 0 after SIGTERM/SIGINT, 1 when NVML, the Kubernetes client or the checkpoint cannot be
set up, 2 for usage or config errors.
"""

from __future__ import annotations

import argparse
import logging

from kube_vgpu.dra import DRIVER_NAME

from .. import startup
from ..metrics import HealthServer
from ..nvml import NVMLError
from . import health
from .checkpoint import CheckpointError
from .grpcserver import Server
from .plugin import DRAPlugin, Options

log = logging.getLogger("kube_vgpu.deviceplugin.dra")


def parser() -> argparse.ArgumentParser:
    p = startup.node_parser("kube-vgpu dra-plugin", "kubelet DRA plugin: ResourceSlices, NodePrepareResources, CDI specs",
                            node_help="this node's name, also the ResourceSlice pool name (default: env NODE_NAME)",
                            simulate_help="publish these simulated GPUs instead of asking NVML")
    p.add_argument("--plugin-dir", default=f"/var/lib/kubelet/plugins/{DRIVER_NAME}",
                   help="directory of the plugin's service socket (dra.sock) and, by default, its checkpoint")
    p.add_argument("--registry-dir", default="/var/lib/kubelet/plugins_registry",
                   help="kubelet's plugin registration directory")
    p.add_argument("--cdi-dir", default="/var/run/cdi", help="where CDI spec files are written (the runtime's CDI dir)")
    p.add_argument("--state-dir", default="", help="directory of checkpoint.json (default: --plugin-dir)")
    startup.add_shim_flags(p, cache_help="host directory for the claims' allocation directories (dra-<claim uid>)")
    p.add_argument("--dev-root", default="/dev", help="the host's /dev as this process sees it (device nodes)")
    p.add_argument("--device-taints", choices=["auto", "true", "false"], default="auto",
                   help="unhealthy GPUs: taint them (true), leave them out of the slice (false), or taint and fall "
                        "back to leaving out when the API server drops taints (auto)")
    startup.add_metrics_flags(p, port=9395)
    return p


def _serve(args: argparse.Namespace, start: startup.NodeStart) -> int:
    """Serve the DRA plugin until SIGTERM/SIGINT. Returns the exit code."""
    cfg, gpus = start.config, start.gpus
    try:
        from deviceplugin.dra_publish import SlicePublisher
        from kube_vgpu.kubeapi import load_api_client

        from .kube import ApiClaimClient

        api = load_api_client(args.kubeconfig)
        taints = {"auto": None, "true": True, "false": False}[args.device_taints]
        publisher = SlicePublisher(api, args.node_name, device_taints=taints)  # driver version: set at start
        claims = ApiClaimClient(api)
    except Exception as e:  # noqa: BLE001 - kubernetes.config raises several types
        log.error("kubernetes client unusable", extra={"error": str(e)})
        return 1
    opts = Options(node_name=args.node_name, plugin_dir=args.plugin_dir, registry_dir=args.registry_dir,
                   cdi_dir=args.cdi_dir, state_dir=args.state_dir, shim_host_path=args.shim_host_path,
                   cache_host_dir=args.cache_host_dir, dev_root=args.dev_root)
    plugin = DRAPlugin(cfg, opts, claims, nvml=gpus, publisher=publisher)
    done = startup.stop_on_signals()
    try:
        plugin.start()
    except CheckpointError as e:
        log.error("checkpoint unusable: inspect it, and remove it only once no claim prepared here is in use",
                  extra={"error": str(e)})
        return 1
    except NVMLError as e:
        log.error("NVML unusable", extra={"error": str(e)})
        plugin.stop()
        return 1
    server = Server(plugin)
    server.start()
    http = HealthServer(plugin, args.metrics_bind_address, args.metrics_port, registry=health.registry(plugin))
    http.start()
    log.info("DRA plugin up", extra={"node": args.node_name, "socket": server.service_socket,
                                     "metrics": f"{args.metrics_bind_address}:{http.port}"})
    startup.serve_until_stopped(done, lambda: plugin.alive() and server.alive(), log)
    http.stop()
    server.stop()
    plugin.stop()
    return 0


#: the command: ``main(argv)`` runs until SIGTERM/SIGINT and returns the exit code
main = startup.node_main(parser, _serve)
