"""Classify the engine's human-readable failure reasons into a small, fixed label set.

The placement engine explains a rejected node in free text (``"container main needs 8192 MiB on one
GPU; largest free is 4096 MiB on GPU-1a2b3c4d"``). Prometheus labels and the extender's
``FailedAndUnresolvableNodes`` need a bounded classification instead; :func:`classify` maps any
reason to one of :data:`CATEGORIES` (unknown texts map to ``"other"``) and memoises the result.
"""

from __future__ import annotations

#: every value :func:`classify` can return (the bounded ``reason`` label set of the metrics)
CATEGORIES = ("no_inventory", "stale_inventory", "no_allocatable", "bad_inventory", "gpu_count", "memory",
              "cores", "slots", "exclusive", "constraints", "unhealthy", "host_resources",
              "invalid_request", "other")

#: categories where evicting other pods cannot help (kube-scheduler skips preemption on them)
UNRESOLVABLE = frozenset({"no_inventory", "stale_inventory", "no_allocatable", "bad_inventory", "gpu_count",
                          "constraints", "unhealthy", "invalid_request"})

# Ordered: first match wins. Substrings of the engine's and this service's reason texts.
_RULES: tuple[tuple[str, str], ...] = (
    ("no vgpu inventory", "no_inventory"),
    ("inventory heartbeat is stale", "stale_inventory"),
    ("inventory annotation is invalid", "bad_inventory"),
    ("allocatable", "no_allocatable"),
    ("gpus, node has", "gpu_count"),
    ("idle gpu", "exclusive"),
    ("fully booked", "exclusive"),
    ("vgpu slots", "slots"),
    ("unhealthy", "unhealthy"),
    ("no usable gpu", "constraints"),
    ("use-gpu", "constraints"),
    ("not in", "constraints"),
    ("host memory", "host_resources"),
    ("m cpu, node has", "host_resources"),
    ("mib", "memory"),
    ("% memory", "memory"),
    ("cores", "cores"),
    ("invalid; allowed", "invalid_request"),
)

_memo: dict[str, str] = {}


def classify(reason: str) -> str:
    """The category (one of :data:`CATEGORIES`) of a failure reason text."""
    c = _memo.get(reason)
    if c is not None:
        return c
    low = reason.lower()
    c = "other"
    for needle, cat in _RULES:
        if needle in low:
            c = cat
            break
    if len(_memo) > 50_000:
        _memo.clear()
    _memo[reason] = c
    return c


def split_unresolvable(failed: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """node -> reason into (resolvable, unresolvable): ExtenderFilterResult's ``FailedNodes`` and
    ``FailedAndUnresolvableNodes`` (unresolvable: categories in :data:`UNRESOLVABLE`, which
    preemption on that node cannot fix). Classifies each distinct text once; when none is
    unresolvable, ``failed`` itself is returned as the resolvable map."""
    bad = {r for r in set(failed.values()) if classify(r) in UNRESOLVABLE}
    if not bad:
        return failed, {}
    resolvable: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    for n, why in failed.items():
        (unresolvable if why in bad else resolvable)[n] = why
    return resolvable, unresolvable


def aggregate(failed: dict[str, str], total: int, top: int = 5) -> str:
    """kube-scheduler style summary: ``"0/5 nodes are available: 3 <reason>, 2 <reason>."``.

    failed: node name -> reason; total: number of candidate nodes; identical texts are grouped,
    the ``top`` largest groups are listed (most frequent first), the rest are counted.
    """
    counts: dict[str, int] = {}
    for r in failed.values():
        counts[r] = counts.get(r, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{n} {r}" for r, n in ranked[:top]]
    rest = sum(n for _, n in ranked[top:])
    if rest:
        parts.append(f"{rest} other (different reasons)")
    ok = total - len(failed)
    return f"{ok}/{total} nodes are available: " + "; ".join(parts) + "."
