# ruff: noqa: E701, E702, E731, E741
"""Regenerate charts/kube-vgpu/values.schema.json and the key tables of docs/configuration.md.

    python charts/tools/gen_schema.py           # rewrite both (commit the result)
    python charts/tools/gen_schema.py --check   # exit 1 if either is stale (tests run this check)

The ``config`` part of the schema and the docs tables come from the one declaration of every config
key in kube_vgpu/config.py (type, default, range, pattern, doc line) and from the policy registry
(kube_vgpu/policyregistry.py); the rest of the chart values are declared below. The chart tests
check the output: bad values fail with a schema message, every values key is in the schema."""
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..')
sys.path.insert(0, os.path.abspath(ROOT))
from kube_vgpu import config as C  # noqa: E402
from kube_vgpu.policyregistry import GPU_POLICY_SPECS, NODE_POLICY_SPECS  # noqa: E402

CHART = os.path.join(ROOT, 'charts', 'kube-vgpu')
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
DNS = {"type": "string", "pattern": C.DNS_SUBDOMAIN, "maxLength": 253}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
LEVEL = {"type": "string", "enum": ["debug", "info", "warning", "error"]}
RES = {"type": "object", "description": "Container resources (requests/limits).",
       "additionalProperties": False,
       "properties": {"requests": {"type": "object"}, "limits": {"type": "object"}, "claims": {"type": "array"}}}
EXPR = {"type": "object", "required": ["key", "operator"], "additionalProperties": False,
        "properties": {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": {"type": "string"}}}}
# A dedicated host directory. The schema checks its shape: absolute, not "/", no trailing slash, no
# empty component. The chart's templates (kube-vgpu.validateHostDir) refuse "." / ".." components and
# system directories themselves (the chart mounts it, mostly read-write, and replaces files in it) with
# a message naming the value: JSON Schema's "not" would only say "Must not validate the schema (not)".
def HOSTDIR(desc): return {
    "type": "string", "pattern": r"^(/[^/]+)+$", "minLength": 2,
    "description": desc + ": an absolute path of a dedicated directory (not /, no trailing slash, no . or .. "
                   "component, not a system directory such as /usr or /var/lib)."}
STRLIST = {"type": "array", "items": {"type": "string"}}


# -- the config section: generated from kube_vgpu/config.py's declaration ----------------------

def _rule_schema(rule, base):
    d = dict(base)
    if rule.choices is not None: d["enum"] = list(rule.choices) + ([None] if rule.nullable else [])
    for attr, kw in (("minimum", "minimum"), ("maximum", "maximum"), ("exclusive_minimum", "exclusiveMinimum"),
                     ("pattern", "pattern"), ("min_length", "minLength"), ("max_length", "maxLength")):
        v = getattr(rule, attr)
        if v is not None: d[kw] = v
    return d

def key_schema(k):
    """The JSON Schema of one declared config key."""
    r = k.rule
    if k.kind == "ids":
        d = {"type": "array", "items": {"type": ["string", "integer"]}}
    elif k.kind == "strings":
        d = {"type": "array", "items": _rule_schema(r.items or C.Rule("item", ""), {"type": "string", "minLength": 1})}
    else:
        t = {"bool": "boolean", "int": "integer", "number": "number", "string": "string"}[k.kind]
        d = _rule_schema(r, {"type": [t, "null"] if r.nullable else t})
    d["description"] = r.doc[:1].upper() + r.doc[1:] + "."
    d.update(r.chart or {})
    return d

def config_schema():
    """The chart's ``config`` value: the domain config file, key by key."""
    props = {k.rule.yaml: key_schema(k) for k in C.top_keys()}
    for sec in C.sections():
        o = obj({k.rule.yaml: key_schema(k) for k in sec.keys},
                req=[k.rule.yaml for k in sec.keys if k.rule.required] or None,
                desc=None if sec.many else sec.doc[:1].upper() + sec.doc[1:] + ".")
        props[sec.yaml] = arr(sec.doc[:1].upper() + sec.doc[1:] + ".", o) if sec.many else o
    return obj(props, desc="The policy file (kube-vgpu.io/v1 domain config).")


# -- the docs tables: generated from the same declaration -------------------------------------

BEGIN = "<!-- BEGIN GENERATED by charts/tools/gen_schema.py from kube_vgpu/config.py; do not edit -->"
END = "<!-- END GENERATED -->"
DOCS = os.path.join(ROOT, "docs", "configuration.md")
SCHEMA = os.path.join(CHART, "values.schema.json")

def _cell(text): return str(text).replace("|", "\\|").replace("\n", " ")
def _code(v): return "`" + json.dumps(v, ensure_ascii=False) + "`" if not isinstance(v, str) else ("`" + v + "`" if v else '`""`')

def _type_text(k):
    return {"bool": "boolean", "int": "integer", "number": "number", "string": "string",
            "strings": "list of strings", "ids": "list of UUIDs or indexes"}[k.kind] + (" or null" if k.rule.nullable else "")

def _allowed_text(k):
    r = k.rule
    parts = []
    if r.choices is not None: parts.append(" | ".join(f"`{c}`" for c in r.choices))
    rng = C.range_text(r)
    if rng: parts.append(rng)
    if r.allowed: parts.append(r.allowed)
    if r.items is not None and r.items.allowed: parts.append("each " + r.items.allowed)
    if r.check_doc: parts.append(f"also: {r.check_doc} (not in the schema: checked by the loader and the chart's templates)")
    if r.chart_doc: parts.append(f"the chart also refuses {r.chart_doc}")
    return "; ".join(parts) or "any"

def _default_text(k):
    if k.rule.required: return "(required)"
    v = k.default
    if isinstance(v, tuple): v = list(v)
    return _code(v)

def docs_tables():
    """The generated part of docs/configuration.md: every key, then the policies."""
    lines = [BEGIN, "", "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for k in C.all_keys():
        lines.append(f"| `{k.path}` | {_type_text(k)} | {_default_text(k)} | {_cell(_allowed_text(k))} | {_cell(k.rule.doc)} |")
    lines += ["", "Across keys: the five `resourceNames` are distinct; `webhook.runtimeClassName`, when set, is one "
              "of `webhook.allowedRuntimeClasses`; each `nodes[].name` appears once. A key set to `null` in `nodes[]` means the `devices` default.", "", "Node policies (`scheduling.nodePolicy`, and the pod annotation "
              "`kube-vgpu.io/node-scheduler-policy`):", "", "| policy | needs | GPU policy | meaning |", "|---|---|---|---|"]
    for p in NODE_POLICY_SPECS:
        needs = "the workload's task shapes" if p.needs_shapes else "-"
        gp = "`scheduling.gpuPolicy`" if p.uses_gpu_policy else "its own order"
        lines.append(f"| `{p.name}` | {needs} | {gp} | {_cell(p.doc)} |")
    lines += ["", "GPU policies (`scheduling.gpuPolicy`, pod annotation `kube-vgpu.io/gpu-scheduler-policy`): "
              + "; ".join(f"`{g.name}`: {g.doc}" for g in GPU_POLICY_SPECS) + ".", "", END]
    return "\n".join(lines) + "\n"

def docs_with_tables(text):
    """``text`` (docs/configuration.md) with its generated part replaced. Raises ValueError
    when the markers are missing."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOCS}: the markers {BEGIN!r} ... {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    return head + docs_tables() + "\n" + rest.split(END, 1)[1].lstrip("\n")

config = config_schema()

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
        "image": obj({**IMAGE["properties"], "overrides": obj({
            c: obj({"repository": {"type": "string"}, "tag": {"type": "string"}})
            for c in ("extender", "webhook", "devicePlugin", "certs")})}),
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
                "filterBestNode": b("Filter answers only the best node (no prioritize round trip)."),
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
            "selectGPUNodes": b("Run on nodes NFD or GPU feature discovery label as NVIDIA GPU nodes."),
            "seLinuxOptions": obj({k: {"type": "string"} for k in ("user", "role", "type", "level")}),
            "priorityClassName": {"type": "string"},
            "runtimeClassName": {"type": "string"},
            "pluginDir": HOSTDIR("kubelet's device-plugin directory"),
            "podResourcesDir": HOSTDIR("kubelet's PodResources directory (mounted read-only)"),
            "shimHostDir": HOSTDIR("Host directory of the shim (mounted read-write)"),
            "shimImagePath": {"type": "string", "pattern": "^/.*\\.so$"},
            "cacheHostDir": HOSTDIR("Host directory of the shared accounting files (mounted read-write)"),
            "metricsPort": PORT,
            "heartbeatSeconds": i("Heartbeat period.", minimum=1),
            "simulateGPUs": {"type": "string", "pattern": r"^$|^\d{1,3}x\d{1,8}(:[A-Za-z0-9][A-Za-z0-9 ._()-]{0,63})?"
                             r"(,\s*\d{1,3}x\d{1,8}(:[A-Za-z0-9][A-Za-z0-9 ._()-]{0,63})?)*$",
                             "description": "GPU-less trial: simulated GPUs COUNTxMIB[:MODEL],... (no isolation)."},
            "extraArgs": STRLIST,
            "securityContext": {"type": "object"},
            "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
            "resources": RES,
            "maxUnavailable": {"type": ["integer", "string"]},
            **POD_COMMON,
        }),
        "dra": obj({
            "enabled": b("Run the DRA node component (DaemonSet); install the DeviceClasses."),
            "nodes": {"enum": ["labelled", "all"], "description": "GPU nodes on the DRA path: labelled or all."},
            "nodeLabel": {"type": "string", "minLength": 1, "maxLength": 316,
                          "pattern": r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$",
                          "description": "Node label (value true) of the DRA nodes."},
            "deviceClass": obj({
                "name": {**DNS, "minLength": 1, "description": "Name of the DeviceClass of every kube-vgpu GPU."},
                "extendedResourceName": {"type": "string", "pattern": r"^$|" + C.RESOURCE_NAME,
                                         "maxLength": 253,
                                         "description": "Extended resource served by the class (\"\" = off)."}}),
            "modelClasses": arr("One DeviceClass per GPU model.", obj({
                "name": {**DNS, "minLength": 1},
                "model": {"type": "string", "minLength": 1, "maxLength": 64, "pattern": r"^[^'\\]+$",
                          "description": "NVML product name (no quote or backslash)."},
                "extendedResourceName": {"type": "string", "pattern": r"^$|" + C.RESOURCE_NAME,
                                         "maxLength": 253}}, req=["name", "model"])),
            "sliceNodeRestriction": b("Only the node component, on its own node, writes our ResourceSlices."),
            "pluginsDir": HOSTDIR("kubelet's DRA plugin directory"),
            "registryDir": HOSTDIR("kubelet's plugin registration directory"),
            "cdiDir": HOSTDIR("CDI spec directory"),
            "metricsPort": PORT,
            "extenderScoring": b("The extender ranks the nodes of pods with claims on our DeviceClasses."),
            "extenderWeight": i("Weight of the DRA scoring extender entry.", minimum=1, maximum=100),
            "extraArgs": STRLIST,
            "resources": RES,
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
        "prometheusRule": obj({"enabled": b("Create the PrometheusRule."),
                               "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                               "memoryNearLimitRatio": n("Share of a container's GPU memory limit that raises "
                                                         "KubeVgpuContainerMemoryNearLimit.",
                                                         exclusiveMinimum=0, maximum=1),
                               "runbookBase": {"type": "string", "minLength": 1,
                                               "description": "Base URL of the docs the alerts' runbook_url links to."},
                               "additionalRules": arr("Extra rules appended to the group.", {"type": "object"})}),
        "dashboards": obj({"enabled": b("Create the dashboard ConfigMap."), "label": {"type": "string", "minLength": 1},
                           "labelValue": {"type": "string"}, "namespace": {"type": "string"},
                           "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}),
    },
}

def render_schema():
    """The text of values.schema.json."""
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv):
    """Write (or with --check, compare) both generated files. Returns 0, or 1 when --check finds
    a stale file (named on stderr)."""
    with open(DOCS) as f:
        docs = f.read()
    want = {SCHEMA: render_schema(), DOCS: docs_with_tables(docs)}
    if "--check" in argv:
        stale = []
        for path, text in want.items():
            with open(path) as f:
                if f.read() != text:
                    stale.append(os.path.relpath(path, ROOT))
        if stale:
            print("stale (run python charts/tools/gen_schema.py): " + ", ".join(stale), file=sys.stderr)
            return 1
        return 0
    for path, text in want.items():
        with open(path, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
