"""End-to-end harness: a real control plane (etcd, kube-apiserver, kube-scheduler, optional
kube-controller-manager from ``KUBE_BIN_DIR``) or an existing cluster (``KUBECONFIG``), plus our
components as subprocesses with their real CLIs and a fake kubelet loop.

Facts used: ../shared/reference/control-plane.md. Everything binds to 127.0.0.1 on free ports.
Nothing here runs at import time; CI (no binaries) never gets past the skip in conftest.py.
"""

from __future__ import annotations

import base64
import datetime
import functools
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER_NAME = "kube-vgpu-scheduler"
TOKEN = "admin-token"
GPU_RESOURCES = ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage",
                 "nvidia.com/gpucores", "nvidia.com/priority")
#: Dynamic Resource Allocation (tests/e2e/test_e2e_dra.py), named although Kubernetes 1.36 turns them on by
#: default: resource.k8s.io/v1 (GA since 1.34); DRAConsumableCapacity (a GPU shared by many claims, each
#: consuming memory and cores), DRAPartitionableDevices, DRAExtendedResource (DeviceClass
#: extendedResourceName) and DRADeviceTaints (unhealthy GPUs), all beta in 1.36. Given to kube-apiserver,
#: kube-scheduler and kube-controller-manager.
DRA_FEATURE_GATES = "DRAConsumableCapacity=true,DRAPartitionableDevices=true,DRAExtendedResource=true,DRADeviceTaints=true"
DRA_RUNTIME_CONFIG = "resource.k8s.io/v1=true"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last_exc = e
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last_exc})"
                                                                                   if last_exc else ""))


def _https_ok(url: str, token: str | None = None) -> bool:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, context=ctx if url.startswith("https") else None, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


# ---------------------------------------------------------------- keys and certificates

def write_keys(d: Path) -> dict[str, Path]:
    """Service-account key pair and a self-signed apiserver serving cert (SAN IP:127.0.0.1)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    def pem_key(k: rsa.RSAPrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                               serialization.NoEncryption())

    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (d / "sa.key").write_bytes(pem_key(sa))
    (d / "sa.pub").write_bytes(sa.public_key().public_bytes(serialization.Encoding.PEM,
                                                            serialization.PublicFormat.SubjectPublicKeyInfo))
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"),
                x509.DNSName("kubernetes.default.svc")]), critical=False)
            .sign(key, hashes.SHA256()))
    (d / "apiserver.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "apiserver.key").write_bytes(pem_key(key))
    (d / "tokens.csv").write_text(f"{TOKEN},admin,admin-uid,system:masters\n")
    return {k: d / k for k in ("sa.key", "sa.pub", "apiserver.crt", "apiserver.key", "tokens.csv")}


def write_kubeconfig(path: Path, server: str, token: str, ca_data: str) -> Path:
    """A kubeconfig for ``server`` with a bearer ``token``; the server's certificate is verified
    against ``ca_data`` (base64 PEM, the kubeconfig's ``certificate-authority-data``)."""
    import yaml

    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority-data": ca_data}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "admin"}}],
    }))
    return path


# ---------------------------------------------------------------- processes

class Proc:
    """A subprocess with its output in a log file; stop() sends SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], logdir: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.log = logdir / f"{name}.log"
        self.p: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as f:
            self.p = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                      start_new_session=True)

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def check(self) -> None:
        if not self.alive():
            raise AssertionError(f"{self.name} exited; last log lines:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.p is None or self.p.poll() is not None:
            return
        self.p.send_signal(sig)
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(timeout=10)


def _alive_and_ok(proc: Proc, url: str) -> bool:
    """For ``wait_for``: raises (retried until the deadline, then reported with the log tail) while
    ``proc`` has exited; otherwise whether ``url`` answers."""
    proc.check()
    return _https_ok(url)


def kube_vgpu(*args: str) -> list[str]:
    return [sys.executable, "-m", "kube_vgpu_cli", *args]


class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager) from KUBE_BIN_DIR, or an existing KUBECONFIG."""

    def __init__(self, workdir: Path, controller_manager: bool = True) -> None:
        """``controller_manager``: start kube-controller-manager when KUBE_BIN_DIR has one (False:
        never; nothing then creates ``default`` ServiceAccounts or runs Deployments)."""
        self.dir = workdir
        self.want_controller_manager = controller_manager
        self.procs: list[Proc] = []
        self.kubeconfig: Path | None = None
        self.has_controller_manager = False
        self.bin_dir = Path(os.environ["KUBE_BIN_DIR"]) if os.environ.get("KUBE_BIN_DIR") else None

    def binary(self, name: str) -> str | None:
        if self.bin_dir is not None and (self.bin_dir / name).is_file():
            return str(self.bin_dir / name)
        return shutil.which(name)

    def start(self) -> None:
        if self.bin_dir is None:
            self.kubeconfig = Path(os.environ["KUBECONFIG"].split(os.pathsep)[0])
            self.has_controller_manager = True  # a real cluster runs one
            return
        etcd, apiserver = self.binary("etcd"), self.binary("kube-apiserver")
        if etcd is None or apiserver is None:
            raise FileNotFoundError(f"need etcd (PATH or KUBE_BIN_DIR) and kube-apiserver in {self.bin_dir}")
        keys = write_keys(self.dir)
        cport, pport, aport = free_port(), free_port(), free_port()
        self.procs.append(Proc("etcd", [
            etcd, "--name", "e2e", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{cport}", "--advertise-client-urls", f"http://127.0.0.1:{cport}",
            "--listen-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-cluster", f"e2e=http://127.0.0.1:{pport}"], self.dir))
        certdir = self.dir / "apiserver-certs"
        certdir.mkdir(exist_ok=True)
        self.procs.append(Proc("kube-apiserver", [
            apiserver, f"--etcd-servers=http://127.0.0.1:{cport}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={aport}", "--endpoint-reconciler-type=none",
            f"--cert-dir={certdir}", f"--tls-cert-file={keys['apiserver.crt']}",
            f"--tls-private-key-file={keys['apiserver.key']}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={keys['sa.pub']}",
            f"--service-account-signing-key-file={keys['sa.key']}", f"--token-auth-file={keys['tokens.csv']}",
            "--authorization-mode=RBAC", "--service-cluster-ip-range=10.96.0.0/24", "--allow-privileged=true",
            f"--feature-gates={DRA_FEATURE_GATES}", f"--runtime-config={DRA_RUNTIME_CONFIG}"],
            self.dir))
        server = f"https://127.0.0.1:{aport}"
        self.kubeconfig = write_kubeconfig(self.dir / "kubeconfig", server, TOKEN,
                                           base64.b64encode(keys["apiserver.crt"].read_bytes()).decode())

        def ready() -> bool:
            for p in self.procs:
                p.check()
            return _https_ok(f"{server}/readyz", TOKEN)
        wait_for(ready, 60, "kube-apiserver /readyz")
        kcm = self.binary("kube-controller-manager")
        if (self.want_controller_manager and kcm is not None and self.bin_dir is not None
                and (self.bin_dir / "kube-controller-manager").is_file()):
            self.procs.append(Proc("kube-controller-manager", [
                kcm, f"--kubeconfig={self.kubeconfig}", "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}", "--leader-elect=false",
                "--controllers=*,-node-lifecycle-controller", f"--service-account-private-key-file={keys['sa.key']}",
                f"--root-ca-file={keys['apiserver.crt']}", "--use-service-account-credentials=false",
                f"--feature-gates={DRA_FEATURE_GATES}"], self.dir))
            self.has_controller_manager = True

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(2000)}" for p in self.procs)


def create_gpu_nodes(core: Any, names: list[str], gpus: int, memory_mib: int, split: int,
                     uuid: Callable[[int, int], str]) -> None:
    """Fake GPU nodes as plain Node objects (gotcha 1 of control-plane.md: status kept, not-ready
    taint removed): ``gpus`` GPUs of ``memory_mib`` each, ``uuid(node index, gpu index)``, the vGPU
    inventory annotation written as the device plugin would, ``nvidia.com/gpu`` = gpus x split."""
    from kube_vgpu.codec import encode_inventory
    from kube_vgpu.model import GPUDevice, NodeInventory
    from kube_vgpu.resources import ANN_NODE_INVENTORY

    for n, name in enumerate(names):
        devs = tuple(GPUDevice(uuid=uuid(n, i), index=i, model="NVIDIA H200", memory_mib=memory_mib, split=split)
                     for i in range(gpus))
        alloc = {"cpu": "64", "memory": "512Gi", "pods": "250", "nvidia.com/gpu": str(gpus * split)}
        core.create_node({"metadata": {
            "name": name, "labels": {"kubernetes.io/hostname": name, "e2e.kube-vgpu.io/node": "true"},
            "annotations": {ANN_NODE_INVENTORY: encode_inventory(NodeInventory(devices=devs, heartbeat=time.time()))}},
            "status": {"capacity": alloc, "allocatable": alloc,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "message": "fake"}]}})
    def untainted(name: str) -> bool:
        return bool(core.patch_node(name, {"spec": {"taints": []}})) and not core.read_node(name).spec.taints

    for name in names:
        wait_for(functools.partial(untainted, name), 20, f"{name} without taints")


def create_namespace(core: Any, ns: str) -> None:
    """A namespace and its ``default`` ServiceAccount (nobody creates it without kube-controller-manager)."""
    from kubernetes import client

    core.create_namespace({"metadata": {"name": ns}})
    try:
        core.create_namespaced_service_account(ns, {"metadata": {"name": "default"}})
    except client.ApiException as e:
        if e.status != 409:
            raise


# ---------------------------------------------------------------- our components

def policy_yaml(node_policy: str = "binpack", gpu_policy: str = "spread") -> str:
    return ("apiVersion: kube-vgpu.io/v1\n"
            f"schedulerName: {SCHEDULER_NAME}\n"
            f"scheduling: {{nodePolicy: {node_policy}, gpuPolicy: {gpu_policy}, inventoryStaleSeconds: 3600}}\n"
            "devices: {splitCount: 10}\n")


def write_policy(path: Path, node_policy: str, gpu_policy: str = "spread") -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(policy_yaml(node_policy, gpu_policy))
    os.replace(tmp, path)  # like a ConfigMap volume update: atomic


def scheduler_config(kubeconfig: Path, extender_port: int, plain_profile: bool = False) -> str:
    """A KubeSchedulerConfiguration like charts/kube-vgpu/templates/scheduler-configmap.yaml.
    ``plain_profile``: also serve ``default-scheduler`` (plain pods: the extender is asked only
    about pods that name one of its managed resources)."""
    import yaml

    profiles = [{"schedulerName": SCHEDULER_NAME}] + ([{"schedulerName": "default-scheduler"}] if plain_profile else [])
    return yaml.safe_dump({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "leaderElection": {"leaderElect": False},
        "profiles": profiles,
        "extenders": [{
            "urlPrefix": f"http://127.0.0.1:{extender_port}", "filterVerb": "filter",
            "prioritizeVerb": "prioritize", "preemptVerb": "preempt", "bindVerb": "bind", "weight": 1,
            "enableHTTPS": False,
            "nodeCacheCapable": True, "ignorable": False, "httpTimeout": "30s",
            "managedResources": [{"name": r, "ignoredByScheduler": True} for r in GPU_RESOURCES],
        }],
    })


class Components:
    """Webhook, extender, kube-scheduler and device plugin as subprocesses."""

    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        self.cp = cp
        self.dir = workdir
        self.policy = workdir / "policy.yaml"
        self.procs: dict[str, Proc] = {}
        self.webhook_port = free_port()
        self.extender_port = free_port()
        self.ca_pem = b""
        self.signing_keys = self._signing_keys(workdir / "signing-keys")

    @staticmethod
    def _signing_keys(d: Path) -> Path:
        """A signing key directory (``active`` + one ``key.<kid>``) shared by the extender and the
        device plugin, as the chart's Secret is."""
        d.mkdir(parents=True, exist_ok=True)
        (d / "key.e2e").write_bytes(os.urandom(32))
        (d / "active").write_text("e2e\n")
        return d

    def start_webhook(self) -> None:
        out = self.dir / "webhook-certs"
        subprocess.run(kube_vgpu("certs", "--service", "kube-vgpu-webhook", "--out-dir", str(out),
                                 "--ip", "127.0.0.1"), check=True, capture_output=True, timeout=60)
        self.ca_pem = (out / "ca.crt").read_bytes()
        self.procs["webhook"] = Proc("webhook", kube_vgpu(
            "webhook", "--config", str(self.policy), "--bind-address", "127.0.0.1", "--port",
            str(self.webhook_port), "--tls-cert-file", str(out / "tls.crt"), "--tls-key-file", str(out / "tls.key")),
            self.dir)
        wait_for(lambda: _alive_and_ok(self.procs["webhook"], f"https://127.0.0.1:{self.webhook_port}/readyz"),
                 30, "webhook /readyz")

    def webhook_configuration(self, namespace: str) -> dict[str, Any]:
        return {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": f"kube-vgpu-e2e-{namespace}"},
            "webhooks": [{
                "name": "vgpu.kube-vgpu.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                "failurePolicy": "Fail", "timeoutSeconds": 10,
                "clientConfig": {"url": f"https://127.0.0.1:{self.webhook_port}/mutate",
                                 "caBundle": base64.b64encode(self.ca_pem).decode()},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                           "resources": ["pods"]}],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            }],
        }

    def start_extender(self, *extra: str) -> None:
        """Start the extender (``extra``: more flags, e.g. ``--filter-best-node``)."""
        assert self.cp.kubeconfig is not None
        self.procs["extender"] = Proc("extender", kube_vgpu(
            "scheduler", "--config", str(self.policy), "--bind-address", "127.0.0.1", "--port",
            str(self.extender_port), "--kubeconfig", str(self.cp.kubeconfig), "--log-level", "info",
            "--signing-keys-dir", str(self.signing_keys),
            "--leader-elect=false", *extra), self.dir)  # one replica, restarted with SIGKILL: no Lease to wait out
        wait_for(lambda: _alive_and_ok(self.procs["extender"], f"http://127.0.0.1:{self.extender_port}/readyz"),
                 60, "extender /readyz")

    def extender_bookings(self) -> int:
        """The extender's ``kube_vgpu_scheduler_bookings`` gauge (pods holding GPUs; refreshed every
        second), from its /metrics on --port."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.extender_port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("kube_vgpu_scheduler_bookings "):
                    return int(float(line.split()[1]))
        raise AssertionError("no kube_vgpu_scheduler_bookings in the extender's /metrics")

    def restart_extender(self) -> None:
        self.procs.pop("extender").stop(signal.SIGKILL)
        self.start_extender()

    def start_kube_scheduler(self, plain_profile: bool = False) -> None:
        """kube-scheduler with the vGPU profile (and ``default-scheduler`` when ``plain_profile``),
        calling our extender; returns once its /readyz answers."""
        binary = self.cp.binary("kube-scheduler")
        if binary is None:
            raise FileNotFoundError("kube-scheduler not in KUBE_BIN_DIR or PATH")
        assert self.cp.kubeconfig is not None
        cfg = self.dir / "kube-scheduler.yaml"
        cfg.write_text(scheduler_config(self.cp.kubeconfig, self.extender_port, plain_profile))
        port = free_port()
        self.procs["kube-scheduler"] = Proc("kube-scheduler", [
            binary, f"--config={cfg}", "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--feature-gates={DRA_FEATURE_GATES}"], self.dir)
        wait_for(lambda: _alive_and_ok(self.procs["kube-scheduler"], f"https://127.0.0.1:{port}/readyz"),
                 60, "kube-scheduler /readyz")

    def start_device_plugin(self, node: str, fake_nvml_dir: Path, nvml_config: Path, sockdir: str,
                            pod_resources_socket: str) -> None:
        """``kube-vgpu device-plugin`` for ``node`` against the fake NVML, registering with the fake
        kubelet in ``sockdir`` and reading its PodResources API at ``pod_resources_socket``."""
        assert self.cp.kubeconfig is not None
        env = {**os.environ, "LD_LIBRARY_PATH": str(fake_nvml_dir), "FAKE_NVML_CONFIG": str(nvml_config),
               "NODE_NAME": node}
        self.procs["device-plugin"] = Proc("device-plugin", kube_vgpu(
            "device-plugin", "--config", str(self.policy), "--kubeconfig", str(self.cp.kubeconfig),
            "--node-name", node, "--device-plugin-dir", sockdir,
            "--shim-host-path", str(self.dir / "vgpu" / "libvgpu.so"), "--cache-host-dir",
            str(self.dir / "containers"), "--metrics-port", str(free_port()), "--metrics-bind-address", "127.0.0.1",
            "--heartbeat-seconds", "5", "--signing-keys-dir", str(self.signing_keys),
            "--pod-resources-socket", pod_resources_socket), self.dir, env=env)

    def start_gpu_node(self, node: str, sockdir: str, uuids: list[str], memory_mib: int) -> tuple[Any, Any]:
        """The device plugin of ``node`` (:meth:`start_device_plugin`) against a fake NVML holding one
        NVIDIA H200 of ``memory_mib`` MiB per uuid of ``uuids``, registered with a fake kubelet in
        ``sockdir``; returns ``(FakeGPUs, FakeKubelet)`` of tests/deviceplugin/dp_helpers once the
        plugin has registered (the caller stops the kubelet after :meth:`stop`; when this raises it
        has stopped it)."""
        dp_tests = str(ROOT / "tests" / "deviceplugin")
        if dp_tests not in sys.path:
            sys.path.insert(0, dp_tests)
        from dp_helpers import FakeGPUs, FakeKubelet, build_fake_nvml

        lib = build_fake_nvml(self.dir / "fakenvml")
        gpus = FakeGPUs(self.dir)
        gpus.set([{"uuid": u, "name": "NVIDIA H200", "memory_mib": memory_mib, "numa": 0} for u in uuids])
        fk = FakeKubelet(sockdir)
        fk.start()
        try:
            self.start_device_plugin(node, lib.parent, gpus.config, sockdir, fk.podresources_socket)
            fk.wait(lambda k: k.updates > 0, timeout=60, what="device plugin registration")
        except BaseException:
            fk.stop()
            raise
        return gpus, fk

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{p.tail(3000)}" for n, p in self.procs.items())


# ---------------------------------------------------------------- fake kubelet

class KubeletLoop:
    """Plays the kubelet for every fake node, and the device plugin's part on nodes that run none.

    * A bound pod with an allocation record on the device-plugin node (``dp_node``) is admitted
      through ``kubelet`` (a :class:`tests/deviceplugin/dp_helpers.FakeKubelet`: GetPreferredAllocation,
      Allocate, then PreStartContainer per container, with kubelet's PodResources API served from what
      it allocated); the :class:`Admitted` containers are kept in :attr:`admitted`. A container whose
      PreStartContainer failed is started again on the next pass (kubelet's restart), up to
      ``max_starts`` times.
    * A bound pod with a record on any other node gets what that node's device plugin would write
      once every GPU container started: ``allocated-containers`` (all of them, in start order),
      ``bind-phase: success`` and the progress signature, signed with the shared key directory
      ``signing_keys`` (the chart's Secret). Without it the extender sees such pods ``allocating``.
    * Every bound pod whose containers started is marked Running through the status subresource.
    * Pods being deleted are force-deleted (grace 0) and forgotten by the fake kubelet.

    Like kubelet, which admits pods in the order its pod watch shows them bound (the order the
    Bindings were committed), pods are handled in the order a watch of the namespace first shows
    them with a node (:attr:`arrival`); a bound pod the watch has not shown yet waits for the next pass.
    """

    def __init__(self, core: Any, namespace: str, dp_node: str, kubelet: Any, signing_keys: Path,
                 max_starts: int = 50) -> None:
        self.core, self.ns, self.dp_node, self.kubelet = core, namespace, dp_node, kubelet
        self.signing_keys = signing_keys
        self.max_starts = max_starts
        self.admitted: dict[str, dict[str, Any]] = {}  # pod name -> container -> Admitted
        self.stand_in: set[str] = set()  # pods whose progress this loop signed (no device plugin there)
        self.errors: list[str] = []
        self._starts: dict[str, int] = {}
        self._done: set[str] = set()
        self.arrival: dict[str, int] = {}  # pod uid -> order in which the watch first showed it bound
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-kubelet")
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="fake-kubelet-watch")

    def start(self) -> None:
        self._watcher.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._watcher.join(timeout=30)

    def _saw(self, p: Any) -> None:
        if p.spec.node_name and p.metadata.uid not in self.arrival:
            self.arrival[p.metadata.uid] = len(self.arrival)

    def _watch(self) -> None:
        """Number pods in the order they are first seen bound (list, then watch; again on errors)."""
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                pods = self.core.list_namespaced_pod(self.ns)
                for p in pods.items:  # bound before this (re)list: their order is unknown, name order
                    self._saw(p)
                w = watch.Watch()
                for ev in w.stream(self.core.list_namespaced_pod, self.ns,
                                   resource_version=pods.metadata.resource_version, timeout_seconds=5):
                    self._saw(ev["object"])
                    if self._stop.is_set():
                        w.stop()
            except Exception as e:  # noqa: BLE001 - relist and watch again
                self.errors.append(f"watch: {e!r}")
                self._stop.wait(0.5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - keep playing the kubelet
                self.errors.append(repr(e))
            self._stop.wait(0.2)

    def _gpu_count(self, p: Any, container: str) -> int:
        for c in list(p.spec.init_containers or []) + list(p.spec.containers or []):
            if c.name == container:
                lim = (c.resources.limits or {}) if c.resources else {}
                return int(lim.get("nvidia.com/gpu", "1"))
        raise KeyError(f"{p.metadata.name}: no container {container}")

    def _admit(self, p: Any, alloc: Any) -> bool:
        """Admit (or restart the failed containers of) a pod on the device-plugin node. True when
        every GPU container started."""
        name = p.metadata.name
        got = self.admitted.get(name)
        if got is None:
            got = {a.container: a for a in self.kubelet.admit(
                name, [(c.name, self._gpu_count(p, c.name)) for c in alloc.containers], namespace=self.ns)}
            self.admitted[name] = got
        else:
            for c, a in got.items():
                if not a.started:
                    got[c] = self.kubelet.start_container(name, c, namespace=self.ns)
        if all(a.started for a in got.values()):
            return True
        n = self._starts[name] = self._starts.get(name, 0) + 1
        if n >= self.max_starts:
            self.errors.append(f"{name}: containers never started: "
                               f"{ {c: a.error for c, a in got.items() if not a.started} }")
            self._done.add(p.metadata.uid)
        return False

    def _sign_progress(self, p: Any, alloc: Any) -> None:
        from kube_vgpu.resources import (
            ANN_ALLOCATED_CONTAINERS,
            ANN_ALLOCATION_SIGNATURE,
            ANN_BIND_PHASE,
            ANN_PROGRESS_SIGNATURE,
            BIND_SUCCESS,
        )
        from kube_vgpu.signing import load_key_dir, sign_progress

        ann = p.metadata.annotations or {}
        text = ",".join(c.name for c in alloc.containers)
        sig = sign_progress(load_key_dir(self.signing_keys), p.metadata.uid, ann.get(ANN_ALLOCATION_SIGNATURE, ""),
                            BIND_SUCCESS, text)
        self.core.patch_namespaced_pod(p.metadata.name, self.ns, {"metadata": {"annotations": {
            ANN_ALLOCATED_CONTAINERS: text, ANN_BIND_PHASE: BIND_SUCCESS, ANN_PROGRESS_SIGNATURE: sig}}})
        self.stand_in.add(p.metadata.name)

    def sync(self) -> None:
        from kube_vgpu.codec import decode_allocation
        from kube_vgpu.resources import ANN_ALLOCATION

        pods = self.core.list_namespaced_pod(self.ns).items
        pods.sort(key=lambda p: self.arrival.get(p.metadata.uid, len(self.arrival)))
        live = {p.metadata.name for p in pods}
        for name in [n for n in self.admitted if n not in live]:
            self.kubelet.remove(name, namespace=self.ns)
            del self.admitted[name]
        for p in pods:
            uid, name = p.metadata.uid, p.metadata.name
            if p.metadata.deletion_timestamp is not None:
                self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=0)
                if self.admitted.pop(name, None) is not None:
                    self.kubelet.remove(name, namespace=self.ns)
                continue
            if not p.spec.node_name or uid in self._done:
                continue
            if uid not in self.arrival:  # kubelet has not seen it bound yet
                continue
            ann = p.metadata.annotations or {}
            if ANN_ALLOCATION in ann:
                alloc = decode_allocation(ann[ANN_ALLOCATION])
                if p.spec.node_name == self.dp_node:
                    if not self._admit(p, alloc):
                        continue
                else:
                    self._sign_progress(p, alloc)
            self.core.patch_namespaced_pod_status(name, self.ns, {"status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": c.name, "ready": True, "restartCount": 0, "image": c.image,
                                       "imageID": "", "state": {"running": {}}} for c in p.spec.containers]}})
            self._done.add(uid)


def dump(obj: Any) -> str:
    return json.dumps(obj, default=str, indent=1)[:4000]


def helm_binary() -> str:
    """Path of a helm binary (``scripts/get_helm.py``); skips the calling test when none can be had."""
    import pytest

    try:
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "get_helm.py")], capture_output=True, text=True,
                             timeout=120).stdout.strip()
    except subprocess.TimeoutExpired:
        out = ""
    if not out:
        pytest.skip("helm unavailable (scripts/get_helm.py failed)")
    return out
