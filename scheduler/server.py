"""``kube-vgpu scheduler``: command line of the extender service (flags per docs/CONTRACTS.md)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import ssl
import sys
import uuid
from collections.abc import Sequence

from aiohttp import web

from kube_vgpu.cliflags import PORT, add_kubeconfig_flag, add_level_flag, number_type
from kube_vgpu.config import load_config
from kube_vgpu.errors import ConfigError
from kube_vgpu.eventloop import loop_name, new_event_loop
from kube_vgpu.scrape import BoundedListener
from kube_vgpu.signing import KeyDir, SigningKeyError

from . import jsonlog
from .drascore import parse_device_classes
from .kube import KubeAPI, load_api_client
from .service import Options, SchedulerService

log = logging.getLogger("kube_vgpu.scheduler")


#: default --lease-name per --leader-elect-mode (own must never write kube-scheduler's Lease)
DEFAULT_LEASE = {"own": "kube-vgpu-extender", "follow": "kube-vgpu-scheduler"}


def _bool_flag(value: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no; any case) for a boolean flag given a value.
    Raises argparse.ArgumentTypeError naming the value and what is allowed."""
    v = value.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not a boolean; allowed: true or false")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kube-vgpu scheduler``."""
    p = argparse.ArgumentParser(prog="kube-vgpu scheduler",
                                description="kube-scheduler HTTP extender: filter, prioritize and bind vGPU pods")
    p.add_argument("--config", help="policy config file (kube-vgpu.io/v1); reloaded live when it changes")
    add_level_flag(p)
    p.add_argument("--bind-address", default="127.0.0.1",
                   help="address of the extender API (filter, prioritize, bind). It has no authentication: keep "
                        "it on loopback, where kube-scheduler in the same pod calls it (default 127.0.0.1)")
    p.add_argument("--port", type=PORT, default=8888,
                   help="port of the extender API, which kube-scheduler calls (default %(default)s)")
    p.add_argument("--metrics-bind-address", default="0.0.0.0",
                   help="address of the --metrics-port listener")
    p.add_argument("--metrics-port", type=PORT, default=0,
                   help="serve /metrics, /livez, /readyz (and nothing else) on this port; 0: /metrics is "
                        "served on --port with the extender API")
    p.add_argument("--tls-cert-file", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key-file", help="private key of --tls-cert-file (PEM)")
    add_kubeconfig_flag(p)
    p.add_argument("--leader-elect", type=_bool_flag, nargs="?", const=True, default=True, metavar="true|false",
                   help="only the leader binds (default true; see --leader-elect-mode). A single replica may turn it "
                        "off with --leader-elect=false; two replicas that both bind can overcommit GPUs")
    p.add_argument("--leader-elect-mode", choices=["follow", "own"], default="own",
                   help="own (default): compete for our own Lease --lease-name; follow: lead while the kube-scheduler "
                        "in this pod holds its Lease --lease-name (the sidecar deployment)")
    p.add_argument("--lease-name", default=None,
                   help=f"default: {DEFAULT_LEASE['own']} with --leader-elect-mode=own, {DEFAULT_LEASE['follow']} "
                        "(kube-scheduler's) with follow")
    p.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE") or "kube-system",
                   help="namespace of the Lease (default: $POD_NAMESPACE, else kube-system)")
    p.add_argument("--resync-seconds", type=number_type("a number of seconds > 0", above=0), default=300.0,
                   help="full relist period of nodes and pods (default %(default)s)")
    p.add_argument("--signing-keys-dir", required=True,
                   help="directory of the allocation signing keys: 'active' (the key id that signs) and one "
                        "'key.<kid>' file per key (>= 32 random bytes); reloaded when its files change")
    p.add_argument("--filter-best-node", type=_bool_flag, nargs="?", const=True, default=True, metavar="true|false",
                   help="true (default): /filter answers only the node the policy ranks first (as HAMi does), so "
                        "kube-scheduler skips scoring and never calls /prioritize (one round trip less per pod); "
                        "false: every feasible node, scored by /prioritize together with kube-scheduler's own "
                        "scores (preferred node affinity, topology spreading)")
    p.add_argument("--dra-scoring", type=_bool_flag, nargs="?", const=True, default=False, metavar="true|false",
                   help="serve /dra-prioritize: watch ResourceSlices and ResourceClaims and rank the nodes of pods "
                        "whose DRA claims ask --dra-device-class with the node policy (default false)")
    p.add_argument("--dra-device-class", action="append", default=[], metavar="NAME[=MODEL]",
                   help="a DeviceClass of kube-vgpu's DRA driver (repeatable; MODEL: the GPU model it selects); "
                        "default: vgpu.kube-vgpu.io, any model")
    return p


class MetricsListenError(OSError):
    """The --metrics-port listener could not be started."""

    def __init__(self, address: str, port: int):
        super().__init__(f"cannot listen on {address}:{port}")
        self.address = address
        self.port = port


def add_metrics_listener(app: web.Application, svc: SchedulerService, address: str, port: int) -> None:
    """Serve :meth:`SchedulerService.metrics_app` (/metrics, /livez, /readyz only) on ``address:port``
    for as long as ``app`` runs: started after the service on startup, stopped on cleanup. The port
    is reachable from the pod network: connections are bounded (:class:`kube_vgpu.scrape.BoundedListener`)."""
    metrics = svc.metrics_app()
    runner = web.AppRunner(metrics, access_log=None)
    listener = BoundedListener(runner)
    metrics.middlewares.append(listener.middleware())

    async def start(_app: web.Application) -> None:
        await runner.setup()
        try:
            await listener.start(address, port)
        except OSError as e:  # the main app's cleanup (stop below) releases the runner
            raise MetricsListenError(address, port) from e

    async def stop(_app: web.Application) -> None:
        await listener.close()
        if runner.server is not None:
            await runner.cleanup()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)


def options_from_args(args: argparse.Namespace) -> Options:
    """The service Options the parsed flags ask for (identity: ``$POD_NAME`` or the hostname plus a
    random suffix; the Lease name per mode unless ``--lease-name`` is given)."""
    identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    return Options(config_path=args.config, leader_elect=args.leader_elect, leader_mode=args.leader_elect_mode,
                   hostname=socket.gethostname(), lease_name=args.lease_name or DEFAULT_LEASE[args.leader_elect_mode],
                   lease_namespace=args.lease_namespace, identity=identity, resync_seconds=args.resync_seconds,
                   freeze_gc=True, filter_best_node=args.filter_best_node, dra_scoring=args.dra_scoring,
                   dra_classes=parse_device_classes(args.dra_device_class))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the service until SIGINT/SIGTERM. Returns 2 on a bad config or flags, 1 on API setup
    errors, a TLS file that cannot be loaded, or an address it cannot listen on (in use)."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    jsonlog.setup(args.log_level)
    try:
        cfg = load_config(args.config)
        keys = KeyDir(args.signing_keys_dir)
    except SigningKeyError as e:
        log.error("cannot load the signing keys (--signing-keys-dir)", extra={"key": e.path, "error": str(e)})
        return 2
    except (ConfigError, OSError) as e:
        log.error("cannot load config", extra={"key": getattr(e, "key", "(file)"), "error": str(e)})
        return 2
    if args.metrics_port and args.metrics_port == args.port:
        log.error("--metrics-port must differ from --port", extra={"port": args.port})
        return 2
    try:
        parse_device_classes(args.dra_device_class)
    except ValueError as e:
        log.error("invalid --dra-device-class", extra={"error": str(e)})
        return 2
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        log.error("--tls-cert-file and --tls-key-file go together")
        return 2
    try:
        api = KubeAPI(load_api_client(args.kubeconfig))
    except Exception as e:  # noqa: BLE001 - no kubeconfig, bad file
        log.error("cannot configure the Kubernetes client", extra={"error": str(e)})
        return 1
    opts = options_from_args(args)

    async def make_app() -> web.Application:
        svc = SchedulerService(cfg, api, opts, keys=keys)
        app = svc.app(serve_metrics=not args.metrics_port)
        if args.metrics_port:
            add_metrics_listener(app, svc, args.metrics_bind_address, args.metrics_port)
        return app

    ctx = None
    if args.tls_cert_file:
        try:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(args.tls_cert_file, args.tls_key_file)
        except OSError as e:  # includes ssl.SSLError: missing, unreadable or mismatched files
            log.error("cannot load the TLS certificate", extra={"error": str(e)})
            return 1
    loop = new_event_loop()
    log.info("starting", extra={"policy": f"{cfg.scheduling.node_policy}/{cfg.scheduling.gpu_policy}",
                                "event_loop": loop_name(loop)})
    try:
        web.run_app(make_app(), host=args.bind_address, port=args.port, ssl_context=ctx, print=None,
                    access_log=None, handle_signals=True, loop=loop)
    except MetricsListenError as e:
        log.error(f"cannot listen on {e.address}:{e.port} (--metrics-port)",
                  extra={"address": e.address, "port": e.port, "error": str(e.__cause__ or e)})
        return 1
    except OSError as e:  # address in use, no permission for the port, no such address
        log.error(f"cannot listen on {args.bind_address}:{args.port}",
                  extra={"address": args.bind_address, "port": args.port, "error": str(e)})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
