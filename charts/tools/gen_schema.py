# ruff: noqa: E701, E702, E731, E741
"""Regenerate charts/kube-vgpu/values.schema.json (run from anywhere; commit the result).

The chart tests check the output: bad values fail with a schema message, every values key is in the schema."""
import json
import os

CHART = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'kube-vgpu')
def obj(props, req=None, desc=None, extra=False):
    d = {"type": "object", "additionalProperties": extra, "properties": props}
    if req: d["required"] = req
    if desc: d["description"] = desc
    return d
def s(desc, **kw): return {"type": "string", "description": desc, **kw}
def i(desc, **kw): return {"type": "integer", "description": desc, **kw}
def n(desc, **kw): return {"type": "number", "description": desc, **kw}
def b(desc): return {"type": "boolean", "description": desc}
def anyobj(desc): return {"type": "object", "description": desc}
def arr(desc, items=None):
    d = {"type": "array", "description": desc}
    if items: d["items"] = items
    return d
DUR = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"}
def dur(desc): return {**DUR, "description": desc + " (a Go duration such as 10s, 1m30s)"}
RESNAME = {"type": "string", "pattern": r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", "minLength": 1, "maxLength": 253}
DNS = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", "maxLength": 253}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
LEVEL = {"type": "string", "enum": ["debug", "info", "warning", "error"]}
RES = {"type": "object", "description": "Container resources (requests/limits).",
       "additionalProperties": False,
       "properties": {"requests": {"type": "object"}, "limits": {"type": "object"}, "claims": {"type": "array"}}}
EXPR = {"type": "object", "required": ["key", "operator"], "additionalProperties": False,
        "properties": {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": {"type": "string"}}}}
# A dedicated host directory: absolute, not "/", no trailing slash, no empty, "." or ".." component,
# and not a system directory itself (the chart mounts it read-write and replaces files in it).
SYSTEM_DIRS = ["/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/opt", "/proc", "/root",
               "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/usr/bin", "/usr/lib", "/usr/lib64",
               "/usr/local", "/usr/local/bin", "/usr/local/lib", "/usr/sbin", "/var", "/var/lib",
               "/var/lib/kubelet", "/var/run"]
def HOSTDIR(desc): return {
    "type": "string", "pattern": r"^(/[^/]+)+$", "minLength": 2,
    "not": {"anyOf": [{"pattern": r"(^|/)\.{1,2}(/|$)"}, {"enum": SYSTEM_DIRS}]},
    "description": desc + ": an absolute path of a dedicated directory (not /, no trailing slash)."}
STRLIST = {"type": "array", "items": {"type": "string"}}
PCT = lambda d, lo: {"type": "integer", "minimum": lo, "maximum": 100, "description": d}
SCALE = lambda d: {"type": "number", "exclusiveMinimum": 0, "maximum": 100, "description": d}

config = obj({
    # default-scheduler would make this second kube-scheduler race the control plane's for every pod
    # (the templates also fail with a longer message).
    "schedulerName": {**DNS, "minLength": 1, "not": {"const": "default-scheduler"},
                      "description": "Name of the secondary scheduler (not default-scheduler)."},
    "resourceNames": obj({k: {**RESNAME, "description": f"Extended resource name for {k}."}
                          for k in ["gpu", "gpumem", "gpumemPercentage", "gpucores", "priority"]},
                         desc="Extended-resource names (distinct)."),
    "defaults": obj({
        "gpuCount": i("GPUs per container when only gpumem/gpucores are given.", minimum=1, maximum=128),
        "memoryMiB": i("MiB when no memory is requested (0 = use memoryPercentage).", minimum=0),
        "memoryPercentage": PCT("Percent of GPU memory when no memory is requested.", 1),
        "cores": PCT("Percent of compute when gpucores is not given.", 0),
        "bareGpuExclusive": b("A bare nvidia.com/gpu takes whole cards."),
    }),
    "scheduling": obj({
        "nodePolicy": {"enum": ["binpack", "spread", "fgd", "bestfit", "dotprod"], "description": "Node policy."},
        "gpuPolicy": {"enum": ["binpack", "spread"], "description": "GPU policy inside a node."},
        "inventoryStaleSeconds": n("Inventory heartbeat age after which a node is not a candidate.", exclusiveMinimum=0),
        "bindHandoverSeconds": n("Deprecated, no effect (binds no longer wait for the device plugin).", minimum=0, maximum=3600),
        "adoptUnsignedBefore": {"type": "string", "pattern": r"^$|^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?([Zz]|[+-][0-9]{2}:[0-9]{2})$",
                                "description": "Book and sign unsigned allocation records of bound pods created before this RFC 3339 time (upgrade; empty = off)."},
    }),
    "devices": obj({
        "splitCount": i("vGPU slots per GPU.", minimum=1, maximum=1024),
        "memoryScaling": SCALE("Factor on NVML memory."),
        "coreScaling": SCALE("Factor on 100 percent of compute."),
    }),
    "nodes": arr("Per-node overrides.", obj({
        "name": {"type": "string", "minLength": 1, "description": "Node name."},
        "splitCount": {"type": ["integer", "null"], "minimum": 1, "maximum": 1024},
        "memoryScaling": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 100},
        "coreScaling": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 100},
        "excludeGPUs": {"type": "array", "items": {"type": ["string", "integer"]}},
    }, req=["name"])),
    "webhook": obj({
        "forceOverwriteDefaultScheduler": b("Route default-scheduler pods to ours."),
        "mutateBareGpu": b("Treat a bare nvidia.com/gpu as a vGPU request."),
        "privileged": {"enum": ["deny", "allow"], "description": "Privileged vGPU containers."},
        "allowUserVisibleDevices": b("Allow containers to set NVIDIA_VISIBLE_DEVICES."),
        "nonGpuVisibleDevicesNone": b("NVIDIA_VISIBLE_DEVICES=none for non-GPU containers."),
        "shmSizeLimit": {"type": "string", "pattern": r"^$|^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$",
                         "description": "sizeLimit of an injected /dev/shm (quantity, or empty)."},
        "foreignSchedulers": {"enum": ["leave", "deny"], "description": "Pods of other schedulers."},
        "systemUsers": {"type": "array", "items": {"type": "string", "minLength": 1},
                        "description": "User names allowed to change system-owned kube-vgpu.io/ pod keys."},
        "allowDisableControlNamespaces": {"type": "array", "items": {**DNS, "maxLength": 63},
                                          "description": "Namespaces whose GPU containers may set CUDA_DISABLE_CONTROL."},
        "allowedRuntimeClasses": {"type": "array", "items": {**DNS, "minLength": 1},
                                  "description": "runtimeClassName values a vGPU pod may name."},
        "allowEnvFrom": b("Allow envFrom without a safe prefix in GPU containers."),
        "protectedHostPaths": {"type": "array", "items": {"type": "string", "pattern": r"^/[^*]*\*?$"},
                               "description": "Extra host paths vGPU pods may not mount (absolute; trailing * = prefix)."},
    }),
}, desc="The policy file (kube-vgpu.io/v1 domain config).")

IMAGE = obj({"repository": {"type": "string", "minLength": 1}, "tag": {"type": "string"},
             "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}})
PDB = obj({"enabled": b("Create the PDB when replicas > 1."),
           "minAvailable": {"type": ["integer", "string"], "description": "minAvailable (count or percent)."}})
POD_COMMON = {"nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
              "tolerations": {"type": "array", "items": {"type": "object"}},
              "affinity": {"type": "object"}, "podAnnotations": {"type": "object", "additionalProperties": {"type": "string"}}}

schema = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "kube-vgpu chart values",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "global": {"type": "object", "description": "Helm global values (accepted, unused)."},
        "nameOverride": {"type": "string"},
        "fullnameOverride": {"type": "string", "maxLength": 40},
        "commonLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "imagePullSecrets": {"type": "array", "items": {"type": "string"}},
        "image": IMAGE,
        "logLevel": {**LEVEL, "description": "Log level of every component."},
        "config": config,
        "scheduler": obj({
            "enabled": b("Deploy the scheduler."),
            "replicas": i("Replicas.", minimum=1, maximum=9),
            "leaderElection": obj({
                "enabled": {"enum": ["auto", True, False], "description": "auto, true or false."},
                "leaseDuration": dur("Lease duration"), "renewDeadline": dur("Renew deadline"),
                "retryPeriod": dur("Retry period")}),
            "kubeScheduler": obj({
                "image": IMAGE,
                "verbosity": i("klog -v.", minimum=0, maximum=10),
                "percentageOfNodesToScore": i("percentageOfNodesToScore.", minimum=0, maximum=100),
                "extraArgs": STRLIST, "resources": RES}),
            "extender": obj({
                "port": PORT,
                "bindAddress": {"type": "string", "minLength": 1,
                                "description": "Bind address of the extender API; kube-scheduler calls 127.0.0.1, "
                                               "so 127.0.0.1 (default) or a wildcard."},
                "metricsPort": {**PORT, "description": "Port of /metrics, /livez, /readyz (the only port the "
                                                       "Service publishes)."},
                "metricsBindAddress": {"type": "string", "minLength": 1,
                                       "description": "Bind address of the observability listener."},
                "httpTimeout": dur("Extender call timeout"),
                "weight": i("Extender weight.", minimum=1, maximum=100),
                "resyncSeconds": i("Full resync period.", minimum=1),
                "leaderElect": {"enum": ["auto", True, False]},
                "ownServiceAccount": b("Run the extender as its own ServiceAccount (<fullname>-extender)."),
                "extraArgs": STRLIST, "resources": RES}),
            "pdb": PDB,
            "priorityClassName": {"type": "string"},
            **POD_COMMON,
        }),
        "webhook": obj({
            "enabled": b("Deploy the webhook."),
            "replicas": i("Replicas.", minimum=1, maximum=20),
            "port": PORT,
            "failurePolicy": {"enum": ["Ignore", "Fail"], "description": "Ignore or Fail."},
            "timeoutSeconds": i("Webhook timeout in seconds (at most 5).", minimum=1, maximum=5),
            "reinvocationPolicy": {"enum": ["IfNeeded", "Never"]},
            "excludeNamespaces": {"type": "array", "items": DNS},
            "namespaceSelectorExpressions": {"type": "array", "items": EXPR},
            "maxBodyBytes": i("Request body limit.", minimum=1024),
            "limits": obj({
                "maxConnections": i("Open connections (TLS handshakes included).", minimum=1, maximum=100000),
                "tlsHandshakeTimeoutSeconds": n("Accept to finished TLS handshake.", exclusiveMinimum=0),
                "idleTimeoutSeconds": n("Handshake to a request's first byte.", exclusiveMinimum=0),
                "headerTimeoutSeconds": n("First byte to complete headers.", exclusiveMinimum=0),
                "bodyTimeoutSeconds": n("Complete headers to complete body.", exclusiveMinimum=0),
                "keepAliveTimeoutSeconds": n("Idle keep-alive connection lifetime.", exclusiveMinimum=0),
            }, desc="Connection limits of the HTTPS listener."),
            "networkPolicy": obj({
                "enabled": b("Create the webhook's NetworkPolicy."),
                "from": {"type": "array", "items": {"type": "object"},
                         "description": "NetworkPolicyPeers allowed to reach the webhook port (empty = any)."},
            }),
            "tlsSecretName": {"type": "string"},
            "certs": obj({
                "mode": {"enum": ["job", "certManager"], "description": "job or certManager."},
                "days": i("Validity in days.", minimum=1),
                "renewBeforeDays": i("Renew when fewer days are left.", minimum=0),
                "certManager": obj({
                    "issuerRef": obj({"name": {"type": "string", "minLength": 1},
                                      "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                                      "group": {"type": "string"}}),
                    "duration": dur("Certificate duration"), "renewBefore": dur("Renew before expiry")}),
            }),
            "resources": RES, "priorityClassName": {"type": "string"},
            "pdb": PDB, **POD_COMMON,
        }),
        "devicePlugin": obj({
            "enabled": b("Deploy the device plugin."),
            "priorityClassName": {"type": "string"},
            "runtimeClassName": {"type": "string"},
            "pluginDir": HOSTDIR("kubelet's device-plugin directory"),
            "podResourcesDir": HOSTDIR("kubelet's PodResources directory (mounted read-only)"),
            "shimHostDir": HOSTDIR("Host directory of the shim (mounted read-write)"),
            "shimImagePath": {"type": "string", "pattern": "^/.*\\.so$"},
            "cacheHostDir": HOSTDIR("Host directory of the shared accounting files (mounted read-write)"),
            "metricsPort": PORT,
            "heartbeatSeconds": i("Heartbeat period.", minimum=1),
            "extraArgs": STRLIST,
            "securityContext": {"type": "object"},
            "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
            "resources": RES,
            "maxUnavailable": {"type": ["integer", "string"]},
            **POD_COMMON,
        }),
        "admissionPolicies": obj({
            "enabled": {"enum": ["auto", True, False], "description": "auto (Kubernetes >= 1.30), true or false."},
            "devicePluginNodeRestriction": b("Hold the device plugin to its own Node and the pods bound to it."),
        }),
        "signingKeys": obj({
            "rotateAfterDays": i("Stage a new key when the active one is this many days old.", minimum=1),
            "activateAfterSeconds": i("Age (seconds) at which a staged key starts signing.", minimum=0),
            "keepOldDays": i("Days a retired key is kept (and while a pod's signature names it).", minimum=0),
            "rotation": obj({"enabled": b("Create the rotation CronJob."),
                             "schedule": {"type": "string", "minLength": 9, "description": "Cron schedule."}}),
            "resources": RES,
        }),
        "serviceMonitor": obj({"enabled": b("Create ServiceMonitors."), "interval": dur("Scrape interval"),
                               "labels": {"type": "object", "additionalProperties": {"type": "string"}}}),
        "dashboards": obj({"enabled": b("Create the dashboard ConfigMap."), "label": {"type": "string", "minLength": 1},
                           "labelValue": {"type": "string"}, "namespace": {"type": "string"},
                           "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}),
    },
}
open(CHART + "/values.schema.json", "w").write(json.dumps(schema, indent=2, ensure_ascii=False) + "\n")
