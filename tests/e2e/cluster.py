"""End-to-end harness: a real control plane (etcd, kube-apiserver, kube-scheduler, optional
kube-controller-manager from ``KUBE_BIN_DIR``) or an existing cluster (``KUBECONFIG``), plus our
components as subprocesses with their real CLIs and a fake kubelet loop.

Facts used: ../shared/reference/control-plane.md. Everything binds to 127.0.0.1 on free ports.
Nothing here runs at import time; CI (no binaries) never gets past the skip in conftest.py.
"""

from __future__ import annotations

import base64
import datetime
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


def write_kubeconfig(path: Path, server: str, token: str) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
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


def kube_vgpu(*args: str) -> list[str]:
    return [sys.executable, "-m", "kube_vgpu.cli", *args]


class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager) from KUBE_BIN_DIR, or an existing KUBECONFIG."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
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
            "--authorization-mode=RBAC", "--service-cluster-ip-range=10.96.0.0/24", "--allow-privileged=true"],
            self.dir))
        server = f"https://127.0.0.1:{aport}"
        self.kubeconfig = write_kubeconfig(self.dir / "kubeconfig", server, TOKEN)

        def ready() -> bool:
            for p in self.procs:
                p.check()
            return _https_ok(f"{server}/readyz", TOKEN)
        wait_for(ready, 60, "kube-apiserver /readyz")
        kcm = self.binary("kube-controller-manager")
        if kcm is not None and self.bin_dir is not None and (self.bin_dir / "kube-controller-manager").is_file():
            self.procs.append(Proc("kube-controller-manager", [
                kcm, f"--kubeconfig={self.kubeconfig}", "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}", "--leader-elect=false",
                "--controllers=*,-node-lifecycle-controller", f"--service-account-private-key-file={keys['sa.key']}",
                f"--root-ca-file={keys['apiserver.crt']}", "--use-service-account-credentials=false"], self.dir))
            self.has_controller_manager = True

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(2000)}" for p in self.procs)


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


def scheduler_config(kubeconfig: Path, extender_port: int) -> str:
    """A KubeSchedulerConfiguration like charts/kube-vgpu/templates/scheduler-configmap.yaml."""
    import yaml

    return yaml.safe_dump({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": SCHEDULER_NAME}],
        "extenders": [{
            "urlPrefix": f"http://127.0.0.1:{extender_port}", "filterVerb": "filter",
            "prioritizeVerb": "prioritize", "bindVerb": "bind", "weight": 1, "enableHTTPS": False,
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
        wait_for(lambda: self.procs["webhook"].check() or _https_ok(f"https://127.0.0.1:{self.webhook_port}/readyz"),
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

    def start_extender(self) -> None:
        assert self.cp.kubeconfig is not None
        self.procs["extender"] = Proc("extender", kube_vgpu(
            "scheduler", "--config", str(self.policy), "--bind-address", "127.0.0.1", "--port",
            str(self.extender_port), "--kubeconfig", str(self.cp.kubeconfig), "--log-level", "info",
            "--signing-keys-dir", str(self.signing_keys),
            "--leader-elect=false"), self.dir)  # one replica, restarted with SIGKILL: no Lease to wait out
        wait_for(lambda: self.procs["extender"].check() or _https_ok(f"http://127.0.0.1:{self.extender_port}/readyz"),
                 60, "extender /readyz")

    def restart_extender(self) -> None:
        self.procs.pop("extender").stop(signal.SIGKILL)
        self.start_extender()

    def start_kube_scheduler(self) -> None:
        binary = self.cp.binary("kube-scheduler")
        if binary is None:
            raise FileNotFoundError("kube-scheduler not in KUBE_BIN_DIR or PATH")
        assert self.cp.kubeconfig is not None
        cfg = self.dir / "kube-scheduler.yaml"
        cfg.write_text(scheduler_config(self.cp.kubeconfig, self.extender_port))
        self.procs["kube-scheduler"] = Proc("kube-scheduler", [
            binary, f"--config={cfg}", "--bind-address=127.0.0.1", f"--secure-port={free_port()}"], self.dir)

    def start_device_plugin(self, node: str, fake_nvml_dir: Path, nvml_config: Path, sockdir: str) -> None:
        assert self.cp.kubeconfig is not None
        env = {**os.environ, "LD_LIBRARY_PATH": str(fake_nvml_dir), "FAKE_NVML_CONFIG": str(nvml_config),
               "NODE_NAME": node}
        self.procs["device-plugin"] = Proc("device-plugin", kube_vgpu(
            "device-plugin", "--config", str(self.policy), "--kubeconfig", str(self.cp.kubeconfig),
            "--node-name", node, "--device-plugin-dir", sockdir,
            "--shim-host-path", str(self.dir / "vgpu" / "libvgpu.so"), "--cache-host-dir",
            str(self.dir / "containers"), "--metrics-port", str(free_port()), "--metrics-bind-address", "127.0.0.1",
            "--heartbeat-seconds", "5", "--signing-keys-dir", str(self.signing_keys)), self.dir, env=env)

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{p.tail(3000)}" for n, p in self.procs.items())


# ---------------------------------------------------------------- fake kubelet

class KubeletLoop:
    """Plays the kubelet for every fake node: bound pods on the device-plugin node get Allocate over
    gRPC (device IDs ``<uuid>::<slot>`` for the GPUs in the pod's allocation annotation), and the env
    of each container is recorded; then every bound pod is marked Running through the status
    subresource. Pods being deleted are force-deleted (grace 0) and their slots freed."""

    def __init__(self, core: Any, namespace: str, dp_node: str, stub_fn: Callable[[], Any]) -> None:
        self.core, self.ns, self.dp_node, self.stub_fn = core, namespace, dp_node, stub_fn
        self.envs: dict[str, dict[str, dict[str, str]]] = {}  # pod name -> container -> env
        self.errors: list[str] = []
        self._slots: dict[str, set[int]] = {}  # uuid -> slots in use
        self._held: dict[str, list[tuple[str, int]]] = {}  # pod uid -> slots
        self._done: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-kubelet")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - keep playing the kubelet
                self.errors.append(repr(e))
            self._stop.wait(0.3)

    def _free(self, uid: str) -> None:
        for uuid, k in self._held.pop(uid, []):
            self._slots.get(uuid, set()).discard(k)

    def sync(self) -> None:
        from deviceplugin.api import api_pb2
        from kube_vgpu.codec import decode_allocation
        from kube_vgpu.resources import ANN_ALLOCATION

        pods = self.core.list_namespaced_pod(self.ns).items
        live = {p.metadata.uid for p in pods}
        for uid in list(self._held):
            if uid not in live:
                self._free(uid)
        for p in pods:
            uid, name = p.metadata.uid, p.metadata.name
            if p.metadata.deletion_timestamp is not None:
                self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=0)
                self._free(uid)
                continue
            if not p.spec.node_name or uid in self._done:
                continue
            ann = p.metadata.annotations or {}
            if p.spec.node_name == self.dp_node and ANN_ALLOCATION in ann:
                alloc = decode_allocation(ann[ANN_ALLOCATION])
                stub = self.stub_fn()
                envs: dict[str, dict[str, str]] = {}
                for c in alloc.containers:
                    ids = []
                    for b in c.devices:
                        used = self._slots.setdefault(b.uuid, set())
                        k = next(i for i in range(1000) if i not in used)
                        used.add(k)
                        self._held.setdefault(uid, []).append((b.uuid, k))
                        ids.append(f"{b.uuid}::{k}")
                    resp = stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                        api_pb2.ContainerAllocateRequest(devices_ids=ids)]), timeout=10)
                    envs[c.name] = dict(resp.container_responses[0].envs)
                self.envs[name] = envs
            self.core.patch_namespaced_pod_status(name, self.ns, {"status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": c.name, "ready": True, "restartCount": 0, "image": c.image,
                                       "imageID": "", "state": {"running": {}}} for c in p.spec.containers]}})
            self._done.add(uid)


def dump(obj: Any) -> str:
    return json.dumps(obj, default=str, indent=1)[:4000]
