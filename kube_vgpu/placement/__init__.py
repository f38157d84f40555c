"""Placement engine: cluster state, fit rules, policies (binpack, spread, FGD, BestFit, DotProd)."""

from .engine import Decision, Engine, NodeResults, normalise_scores, pod_shape
from .fit import Plan, fit_pod, gpu_order
from .policies import (
           FGD,
           BestFit,
           Binpack,
           DotProd,
           FragModel,
           Policy,
           Spread,
           TaskShape,
           make_policy,
           typical_shapes,
)
from .state import Assumption, Booking, ClusterState, NodeState, OvercommitError
from .status import Code, FitFailure

__all__ = ["Assumption", "BestFit", "Binpack", "Booking", "ClusterState", "Code", "Decision", "DotProd", "Engine", "FGD", "FitFailure", "FragModel",
           "NodeResults", "NodeState", "OvercommitError", "Plan", "Policy", "Spread", "TaskShape", "fit_pod", "gpu_order",
           "make_policy", "normalise_scores", "pod_shape", "typical_shapes"]
