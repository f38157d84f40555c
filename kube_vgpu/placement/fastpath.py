"""The extender's front end to the placement engine: candidate lists of node names.

kube-scheduler asks about the same long lists of node names over and over (the full candidate
list to filter, then filter's feasible list to prioritize). :class:`ExtenderEngine` maps names to
node indexes once per list and asks the engine about all of them at once through its public
:meth:`~kube_vgpu.placement.Engine.evaluate_nodes` (the engine keeps its own per pod-shape cache);
feasibility is ``score > -inf`` and the rejected nodes' typed failures come back with the scores.
Results are identical to ``Engine.evaluate`` (see tests/scheduler/test_fastpath.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np

from ..model import PodRequest
from .engine import Engine
from .memo import BoundedMemo
from .status import NO_INVENTORY, FitFailure

__all__ = ["NAMES_SEP", "NO_INVENTORY", "ExtenderEngine", "names_key", "normalise_array"]


NAMES_SEP = _SEP = "\x00"  #: joins names_key; never in a node name (DNS subdomain), see ExtenderEngine._remember


def names_key(names: Sequence[str]) -> str:
    """The NUL-joined names: the key under which a candidate list is remembered (pass it to
    :meth:`ExtenderEngine.score_array` and the like to save a join). Raises TypeError if a name
    is not a str."""
    return _SEP.join(names)


def normalise_array(scores: np.ndarray, top: int = 10) -> np.ndarray:
    """Vectorised twin of :func:`kube_vgpu.placement.normalise_scores` (same float operations in
    the same order, numpy's round-half-to-even like Python's ``round``): policy scores (float64)
    -> int64 in 0..top, best = top, all equal = top. Equality is property-tested."""
    if not len(scores):
        return np.zeros(0, dtype=np.int64)
    lo = float(scores.min())
    hi = float(scores.max())
    if hi - lo < 1e-12:
        return np.full(len(scores), top, dtype=np.int64)
    return np.round((scores - lo) / (hi - lo) * top).astype(np.int64)


@dataclass(slots=True)
class _Known:
    """A remembered candidate list: node index per name (-1 unknown) and, built on first use,
    the names as a numpy object array (to pick the feasible ones without a Python loop)."""

    idx: np.ndarray
    names: np.ndarray | None = None

    def name_array(self, names: Sequence[str]) -> np.ndarray:
        if self.names is None:
            self.names = np.fromiter(names, dtype=object, count=len(names))
        return self.names


class ExtenderEngine(Engine):
    """Engine with :meth:`evaluate_names` / :meth:`score_array` over remembered name lists (it
    uses only the engine's public API)."""

    #: how many recent candidate lists are remembered (least recently used dropped). Keyed by the
    #: NUL-joined names: one C-speed join and hash per request instead of comparing against every
    #: remembered list.
    RECENT = 8

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._name_gen = -1
        self._name_idx: dict[str, int] = {}
        self._lists: BoundedMemo[str, _Known] = BoundedMemo(self.RECENT)

    def _lookup(self, names: Sequence[str], key: str | None = None) -> tuple[_Known, bool]:
        """(the list's record, whether it is remembered). ``key``: :func:`names_key` of
        ``names`` if the caller has it. Raises TypeError if a name is not a str."""
        if self._name_gen != self.state.generation:
            self._name_idx = {n.name: n.idx for n in self.state.node_list}
            self._name_gen = self.state.generation
            self._lists.clear()
        n = len(names)
        if key is None:
            key = _SEP.join(names)
        known = self._lists.get(key)
        if known is not None and len(known.idx) == n:
            return known, True
        known = _Known(np.fromiter(map(self._name_idx.get, names, repeat(-1)), dtype=np.int64, count=n))
        return known, self._remember(key, n, known)

    def _remember(self, key: str, n: int, known: _Known, nul_free: bool = False) -> bool:
        """Remember ``known`` for the list whose NUL-joined names are ``key``; True if kept.
        Only lists whose names hold no NUL are kept (``nul_free``: the caller knows, e.g. a
        subset of a kept list): then the join has exactly one split into ``n`` names, so a later
        list with the same key and length is the same list."""
        if not nul_free and key.count(_SEP) != n - 1:
            return False
        self._lists.put(key, known)
        return True

    def _eval(self, pod: PodRequest, names: Sequence[str], key: str | None = None
              ) -> tuple[_Known, bool, np.ndarray, np.ndarray]:
        """(list record, remembered, score per name, outcome per name: None for unknown names)."""
        known, kept = self._lookup(names, key)
        idx = known.idx
        found = idx >= 0
        if bool(found.all()):
            res = self.evaluate_nodes(pod, idx)
            return known, kept, res.scores, res.outcomes
        res = self.evaluate_nodes(pod, idx[found])
        sc = np.full(len(names), -np.inf)
        sc[found] = res.scores
        out = np.full(len(names), None, dtype=object)
        out[found] = res.outcomes
        return known, kept, sc, out

    def score_array(self, pod: PodRequest, names: Sequence[str], key: str | None = None) -> np.ndarray:
        """Policy score per name (float64; -inf where the pod does not fit or the node is unknown).
        ``key``: :func:`names_key` of ``names`` if the caller has it."""
        if not names:
            return np.zeros(0)
        return self._eval(pod, names, key)[2]

    def evaluate_names(self, pod: PodRequest, names: Sequence[str], want_scores: bool = True
                       ) -> tuple[list[str], dict[str, FitFailure], dict[str, float]]:
        """Same contract as ``Engine.evaluate(pod, names)``: feasible names in input order,
        failure per rejected name (unknown names: NO_INVENTORY), policy score per feasible name
        (``want_scores=False``: an empty dict, for filter, which does not need them)."""
        if not names:
            return [], {}, {}
        known, kept, sc, outcomes = self._eval(pod, names)
        idx = known.idx
        feasible = sc > -np.inf
        if bool(feasible.all()):
            ok = list(names)
            fsc = sc
        else:
            ok = known.name_array(names)[feasible].tolist()
            fsc = sc[feasible]
            if kept:  # prioritize asks for exactly these next
                self._remember(_SEP.join(ok), len(ok), _Known(idx[feasible]), nul_free=True)
        scores = dict(zip(ok, fsc.tolist(), strict=True)) if want_scores else {}
        bad = np.flatnonzero(~feasible)
        if not len(bad):
            return ok, {}, scores
        reasons = [NO_INVENTORY if r is None else r for r in outcomes[bad].tolist()]
        failed = dict(zip(map(names.__getitem__, bad.tolist()), reasons, strict=True))
        return ok, failed, scores
