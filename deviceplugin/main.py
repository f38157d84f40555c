"""``kube-vgpu device-plugin``: command line (flags from docs/CONTRACTS.md) and process lifecycle.

Exit codes: 0 after SIGTERM/SIGINT, 1 when NVML or the Kubernetes client cannot be set up,
2 for usage or config errors.
"""

from __future__ import annotations

import argparse
import logging
import threading

from kube_vgpu.cliflags import number_type
from kube_vgpu.signing import KeyDir, SigningKeyError

from . import startup
from .metrics import HealthServer
from .nvml import NVMLError
from .server import DevicePlugin, Options

log = logging.getLogger("kube_vgpu.deviceplugin")


def parser() -> argparse.ArgumentParser:
    p = startup.node_parser("kube-vgpu device-plugin", "kubelet device plugin: vGPU slots, node inventory, Allocate",
                            node_help="this node's name (default: env NODE_NAME)",
                            simulate_help="advertise these simulated GPUs instead of asking NVML")
    p.add_argument("--device-plugin-dir", default="/var/lib/kubelet/device-plugins",
                   help="kubelet's device plugin directory (holds kubelet.sock)")
    startup.add_shim_flags(p, cache_help="host directory for per-container shared cache directories")
    startup.add_metrics_flags(p, port=9394)
    p.add_argument("--heartbeat-seconds", type=number_type("a number of seconds > 0", above=0), default=30.0,
                   help="node inventory write interval (seconds)")
    p.add_argument("--pending-stale-seconds", type=number_type("a number of seconds >= 0 (0: never)", minimum=0),
                   default=300.0,
                   help="a pod still waiting for Allocate this long after it was bound stops being the "
                        "target of GetPreferredAllocation while newer pods wait (0: never)")
    p.add_argument("--pod-resources-socket", default="/var/lib/kubelet/pod-resources/kubelet.sock",
                   help="kubelet's PodResources API socket: names the pod and container holding the device IDs "
                        "of a PreStartContainer call")
    p.add_argument("--signing-keys-dir", required=True,
                   help="directory of the allocation signing keys (the scheduler's): 'active' and 'key.<kid>' "
                        "files; only pods whose allocation record verifies are served; reloaded when it changes")
    return p


def _serve(args: argparse.Namespace, start: startup.NodeStart) -> int:
    """Serve the device plugin until SIGTERM/SIGINT. Returns the exit code."""
    cfg, gpus = start.config, start.gpus
    try:
        keys = KeyDir(args.signing_keys_dir)
    except SigningKeyError as e:
        log.error("signing keys unusable (--signing-keys-dir)", extra={"error": str(e)})
        return 2
    try:
        from .kube import ApiKubeClient

        kube = ApiKubeClient(args.kubeconfig)
    except Exception as e:  # noqa: BLE001 - kubernetes.config raises several types
        log.error("kubernetes client unusable", extra={"error": str(e)})
        return 1
    opts = Options(node_name=args.node_name, device_plugin_dir=args.device_plugin_dir,
                   shim_host_path=args.shim_host_path, cache_host_dir=args.cache_host_dir,
                   heartbeat_seconds=args.heartbeat_seconds, pending_stale_seconds=args.pending_stale_seconds,
                   pod_resources_socket=args.pod_resources_socket)
    plugin = DevicePlugin(cfg, opts, kube, nvml=gpus, keys=keys)
    done = startup.stop_on_signals()
    try:
        plugin.start()
    except NVMLError as e:
        log.error("NVML unusable", extra={"error": str(e)})
        plugin.stop()
        return 1
    http = HealthServer(plugin, args.metrics_bind_address, args.metrics_port)
    http.start()
    log.info("device plugin up", extra={"node": args.node_name,
                                       "metrics": f"{args.metrics_bind_address}:{http.port}"})
    startup.serve_until_stopped(done, plugin.alive, log)
    # side by side: the HTTP server's poll (0.5 s) overlaps the plugin's gRPC grace and thread joins
    http_stop = threading.Thread(target=http.stop, name="deviceplugin-http-stop")
    http_stop.start()
    plugin.stop()
    http_stop.join()
    return 0


#: the command: ``main(argv)`` runs until SIGTERM/SIGINT and returns the exit code
main = startup.node_main(parser, _serve)
