"""Typed read-only views of the Kubernetes objects kube-vgpu reads: the one place that walks their JSON.

A view wraps an object as the API server serves it (a JSON dict: ``core/v1 Pod``, ``Node``, a
``ResourceQuota``, a ``Lease``, a list response) and answers the fields the project reads, typed.
It never copies the object: building one costs a few dict look-ups (``metadata``, ``spec`` and
``status`` are checked once, at construction), so the extender builds one per pod on its hot path.
Views are immutable and hold the dict they were built from in ``raw`` (callers must not mutate it).

Shape rule (the one place it lives): a field that must be an object, a list or a string may be
absent or ``null`` (it reads as empty: ``{}``, ``()``, ``""``); any other JSON type raises
:class:`~kube_vgpu.errors.ShapeError` naming the field's JSON path, the value's type and what is
allowed, e.g. ``metadata.annotations must be an object, got a string``. Checks are made when a field
is read, so a view of a pod whose ``status`` is malformed still answers its ``metadata``. Map values
are checked one key at a time (:meth:`ObjectView.annotation`, :meth:`ObjectView.label`).

Which pod still holds GPUs (``status.phase``, ``metadata.deletionTimestamp``) is decided here too
(:attr:`PodView.finished`, :attr:`PodView.terminating`, :attr:`PodView.holds_gpus`,
:attr:`PodView.active`); :mod:`kube_vgpu.podlife` offers the same rule on raw dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from .errors import ShapeError
from .podshape import key_path

#: pod phases after which no container of the pod runs again
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})

#: what an absent object field reads as (shared, read-only)
EMPTY: Mapping[str, Any] = MappingProxyType({})

_V = TypeVar("_V", bound="ObjectView")
_T = TypeVar("_T")


def obj_field(value: Any, path: str) -> Mapping[str, Any]:
    """``value`` if it is a JSON object, :data:`EMPTY` when absent (None). Raises ShapeError naming
    ``path`` for any other type."""
    if type(value) is dict:
        return value
    if value is None:
        return EMPTY
    if isinstance(value, Mapping):
        return value
    raise ShapeError(path, value, "an object")


def list_field(value: Any, path: str) -> list[Any] | tuple[()]:
    """``value`` if it is a JSON list, ``()`` when absent (None). Raises ShapeError naming ``path``."""
    if value is None:
        return ()
    if isinstance(value, list):
        return value
    raise ShapeError(path, value, "a list")


def obj_list_field(value: Any, path: str) -> tuple[Mapping[str, Any], ...]:
    """``value`` if it is a JSON list of objects, ``()`` when absent (None). Raises ShapeError naming
    ``path`` (the list, or ``path[i]`` for an entry that is not an object)."""
    raw = list_field(value, path)
    for i, v in enumerate(raw):
        if not isinstance(v, Mapping):
            raise ShapeError(f"{path}[{i}]", v, "an object")
    return tuple(raw)


def str_entry(values: Mapping[str, Any], path: str, key: str) -> str | None:
    """The string at ``key`` of the map at ``path`` (annotations, labels), None when absent. Raises
    ShapeError naming the key's path when it is not a string."""
    v = values.get(key)
    if v is None or isinstance(v, str):
        return v
    raise ShapeError(key_path(path, key), v, "a string")


def str_field(value: Any, path: str) -> str:
    """``value`` if it is a string, ``""`` when absent (None). Raises ShapeError naming ``path``."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    raise ShapeError(path, value, "a string")


class Field(property, Generic[_T]):
    """A field of a view's ``metadata``, ``spec`` or ``status`` read as a property: ``read(value,
    path)`` of the field's value (None when absent) and its path (``metadata.uid``), e.g.
    :func:`str_field` or :func:`obj_field`. One rule for every such accessor."""

    def __init__(self, section: str, key: str, read: Callable[[Any, str], _T], doc: str):
        of_section = attrgetter(section)
        path = f"{'metadata' if section == 'meta' else section}.{key}"
        get: Callable[[ObjectView], Any]
        # metadata and spec strings (name, uid, resourceVersion, nodeName) are read for every watch
        # event and request: their getters read the slot directly and inline str_field's check
        if read is str_field and section == "meta":
            def get(view: ObjectView) -> Any:
                v = view.meta.get(key)
                return v if type(v) is str else str_field(v, path)
        elif read is str_field and section == "spec":
            def get(view: ObjectView) -> Any:
                v = view.spec.get(key)
                return v if type(v) is str else str_field(v, path)
        else:
            def get(view: ObjectView) -> Any:
                return read(of_section(view).get(key), path)
        super().__init__(get)
        self.__doc__ = doc  # (property(doc=...) drops it in a subclass with a docstring of its own)

    if TYPE_CHECKING:
        @overload  # type: ignore[override]
        def __get__(self, view: None, owner: type | None = None) -> Field[_T]: ...
        @overload
        def __get__(self, view: ObjectView, owner: type | None = None) -> _T: ...
        def __get__(self, view: ObjectView | None, owner: type | None = None) -> _T | Field[_T]: ...


def _namespace_or_default(value: Any, path: str) -> str:
    return str_field(value, path) or "default"


class ObjectView:
    """Any Kubernetes object: its ``metadata`` (and ``spec`` / ``status`` as plain objects).

    Raises ShapeError at construction when the object is not a JSON object, or its ``metadata``,
    ``spec`` or ``status`` is present and not an object.
    """

    __slots__ = ("raw", "meta", "spec", "status")
    raw: Mapping[str, Any]
    meta: Mapping[str, Any]
    spec: Mapping[str, Any]
    status: Mapping[str, Any]

    def __init__(self, obj: Mapping[str, Any]):
        if type(obj) is not dict and not isinstance(obj, Mapping):
            raise ShapeError("(object)", obj, "an object")
        get = obj.get
        meta, spec, status = get("metadata"), get("spec"), get("status")
        # (type(x) is dict: the common case, without the cost of an ABC check)
        _set_raw(self, obj)
        _set_meta(self, meta if type(meta) is dict else obj_field(meta, "metadata"))
        _set_spec(self, spec if type(spec) is dict else obj_field(spec, "spec"))
        _set_status(self, status if type(status) is dict else obj_field(status, "status"))

    @classmethod
    def of(cls: type[_V], obj: Mapping[str, Any] | ObjectView) -> _V:
        """A view of ``obj``; ``obj`` itself when it already is one of this class (no second build)."""
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, ObjectView):
            return cls(obj.raw)
        return cls(obj)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __repr__(self) -> str:
        try:
            ns, name = self.namespace, self.name
        except ShapeError:
            return f"{type(self).__name__}(<malformed metadata>)"
        return f"{type(self).__name__}({ns + '/' if ns else ''}{name})"

    # -- metadata ---------------------------------------------------------------------------------

    name = Field("meta", "name", str_field, '``metadata.name`` ("" when absent).')
    namespace = Field("meta", "namespace", str_field, '``metadata.namespace`` as written ("" when absent).')
    generate_name = Field("meta", "generateName", str_field, '``metadata.generateName`` ("" when absent).')
    uid = Field("meta", "uid", str_field, '``metadata.uid`` ("" when absent).')
    resource_version = Field("meta", "resourceVersion", str_field,
                             '``metadata.resourceVersion`` ("" when absent).')
    creation_timestamp = Field("meta", "creationTimestamp", str_field,
                               '``metadata.creationTimestamp`` (RFC 3339 text, "" when absent).')
    deletion_timestamp = Field("meta", "deletionTimestamp", str_field,
                               '``metadata.deletionTimestamp`` (RFC 3339 text, "" when absent: not being deleted).')

    annotations = Field("meta", "annotations", obj_field,
                        "``metadata.annotations`` (read-only use; values unchecked: see :meth:`annotation`).")
    labels = Field("meta", "labels", obj_field,
                   "``metadata.labels`` (read-only use; values unchecked: see :meth:`label`).")

    def annotation(self, key: str) -> str | None:
        """The annotation ``key``'s value, None when absent. Raises ShapeError when it is not a string."""
        return str_entry(self.annotations, "metadata.annotations", key)

    def label(self, key: str) -> str | None:
        """The label ``key``'s value, None when absent. Raises ShapeError when it is not a string."""
        return str_entry(self.labels, "metadata.labels", key)

    @property
    def owner_references(self) -> tuple[Mapping[str, Any], ...]:
        """``metadata.ownerReferences`` (each an object)."""
        return obj_list_field(self.meta.get("ownerReferences"), "metadata.ownerReferences")

    def conditions(self) -> tuple[Mapping[str, Any], ...]:
        """``status.conditions`` (each an object)."""
        return obj_list_field(self.status.get("conditions"), "status.conditions")

    def condition(self, kind: str) -> Mapping[str, Any] | None:
        """The first ``status.conditions`` entry of ``type`` ``kind``, or None."""
        return next((c for c in self.conditions() if c.get("type") == kind), None)


# slot setters: a view's own __setattr__ refuses every write (read-only), so __init__ fills the
# slots through their descriptors (several times cheaper than object.__setattr__)
_set_raw = vars(ObjectView)["raw"].__set__
_set_meta = vars(ObjectView)["meta"].__set__
_set_spec = vars(ObjectView)["spec"].__set__
_set_status = vars(ObjectView)["status"].__set__


class ContainerView:
    """One container (``core/v1 Container``) of a pod; ``init`` says which list it is in and ``path``
    its JSON path (``spec.initContainers[0]``). Raises ShapeError when it is not an object."""

    __slots__ = ("raw", "init", "path")
    raw: Mapping[str, Any]
    init: bool
    path: str

    def __init__(self, obj: Any, init: bool, path: str):
        if type(obj) is not dict and not isinstance(obj, Mapping):
            raise ShapeError(path, obj, "an object (core/v1 Container)")
        _cset_raw(self, obj)
        _cset_init(self, init)
        _cset_path(self, path)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ContainerView is read-only")

    def __repr__(self) -> str:
        return f"ContainerView({self.path} {self.name!r})"

    @property
    def name(self) -> str:
        """The container's name ("" when absent)."""
        return str_field(self.raw.get("name"), f"{self.path}.name")

    @property
    def limits(self) -> Mapping[str, Any]:
        """``resources.limits`` (resource name -> quantity as written)."""
        res = obj_field(self.raw.get("resources"), f"{self.path}.resources")
        return obj_field(res.get("limits"), f"{self.path}.resources.limits")

    @property
    def requests(self) -> Mapping[str, Any]:
        """``resources.requests`` (resource name -> quantity as written)."""
        res = obj_field(self.raw.get("resources"), f"{self.path}.resources")
        return obj_field(res.get("requests"), f"{self.path}.resources.requests")

    def resource(self, name: str) -> Any:
        """The raw quantity of resource ``name``: limits first, requests as fallback; None when absent."""
        limits = self.limits
        if name in limits:
            return limits[name]
        return self.requests.get(name)

    def env(self) -> tuple[Mapping[str, Any], ...]:
        """``env`` entries (each an object)."""
        return obj_list_field(self.raw.get("env"), f"{self.path}.env")


_cset_raw = vars(ContainerView)["raw"].__set__
_cset_init = vars(ContainerView)["init"].__set__
_cset_path = vars(ContainerView)["path"].__set__


class PodView(ObjectView):
    """A ``core/v1 Pod``. ``namespace`` is ``default`` when the object names none (the pod key's rule)."""

    __slots__ = ()

    namespace = Field("meta", "namespace", _namespace_or_default,
                      "``metadata.namespace``, ``default`` when absent or empty.")

    @property
    def key(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"

    node_name = Field("spec", "nodeName", str_field, '``spec.nodeName`` ("" while unbound).')
    scheduler_name = Field("spec", "schedulerName", str_field, '``spec.schedulerName`` ("" when absent).')
    phase = Field("status", "phase", str_field, '``status.phase`` ("" when absent).')

    @property
    def priority(self) -> int:
        """``spec.priority`` as kube-scheduler reads it (``corev1helpers.PodPriority``): the integer the
        API server's Priority admission set, 0 when absent. Raises ShapeError when not an integer."""
        v = self.spec.get("priority")
        if v is None:
            return 0
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        raise ShapeError("spec.priority", v, "an integer")

    # -- the one rule of where a pod is in its life, as far as GPUs go ---------------------------

    @property
    def finished(self) -> bool:
        """``status.phase`` is Succeeded or Failed: no container runs again, the pod holds no GPUs."""
        phase = self.status.get("phase")
        return isinstance(phase, str) and phase in FINISHED_PHASES

    @property
    def terminating(self) -> bool:
        """``metadata.deletionTimestamp`` is set: going away, but its containers may still run."""
        return bool(self.meta.get("deletionTimestamp"))

    @property
    def holds_gpus(self) -> bool:
        """The pod still holds the GPUs it was given: it has not finished (a terminating pod does)."""
        return not self.finished

    @property
    def active(self) -> bool:
        """Neither finished nor being deleted: new work (a bind, an Allocate) may still go to it."""
        return not self.finished and not self.terminating

    # -- containers --------------------------------------------------------------------------------

    def _containers(self, field: str, init: bool) -> tuple[ContainerView, ...]:
        raw = list_field(self.spec.get(field), f"spec.{field}")
        return tuple(ContainerView(c, init, f"spec.{field}[{i}]") for i, c in enumerate(raw))

    def containers(self) -> tuple[ContainerView, ...]:
        """``spec.containers`` (app containers), in spec order."""
        return self._containers("containers", False)

    def init_containers(self) -> tuple[ContainerView, ...]:
        """``spec.initContainers``, in spec order."""
        return self._containers("initContainers", True)

    def all_containers(self) -> tuple[ContainerView, ...]:
        """Init containers, then app containers, each in spec order (the order kubelet starts them)."""
        return self.init_containers() + self.containers()

    def container(self, name: str, init: bool | None = None) -> ContainerView | None:
        """The container called ``name`` (in the init list, the app list, or either when None)."""
        ctrs = self.all_containers() if init is None else self._containers(
            "initContainers" if init else "containers", init)
        return next((c for c in ctrs if c.name == name), None)

    @property
    def admitted(self) -> bool:
        """kubelet has admitted the pod: it reports container statuses (only kubelet writes them, through
        the status subresource, and only after admission)."""
        return bool(self.status.get("containerStatuses") or self.status.get("initContainerStatuses"))


class NodeView(ObjectView):
    """A ``core/v1 Node``."""

    __slots__ = ()

    @property
    def unschedulable(self) -> bool:
        """``spec.unschedulable`` is true (the node is cordoned)."""
        return self.spec.get("unschedulable") is True

    allocatable = Field("status", "allocatable", obj_field,
                        "``status.allocatable`` (resource name -> quantity as written).")
    capacity = Field("status", "capacity", obj_field,
                     "``status.capacity`` (resource name -> quantity as written).")

    @property
    def ready(self) -> bool | None:
        """The ``Ready`` condition: True/False, None when the node reports none (or Unknown)."""
        c = self.condition("Ready")
        s = c.get("status") if c is not None else None
        return True if s == "True" else False if s == "False" else None


class ListView:
    """A list response (``PodList``, ``NodeList``...): its ``items`` and list metadata. Raises
    ShapeError when the body is not an object or ``metadata``/``items`` have the wrong type."""

    __slots__ = ("raw", "meta", "items")
    raw: Mapping[str, Any]
    meta: Mapping[str, Any]
    items: list[Any] | tuple[()]

    def __init__(self, body: Mapping[str, Any]):
        if not isinstance(body, Mapping):
            raise ShapeError("(list)", body, "an object")
        object.__setattr__(self, "raw", body)
        object.__setattr__(self, "meta", obj_field(body.get("metadata"), "metadata"))
        object.__setattr__(self, "items", list_field(body.get("items"), "items"))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ListView is read-only")

    @property
    def resource_version(self) -> str:
        """``metadata.resourceVersion`` of the list (where a watch starts), "" when absent."""
        return str_field(self.meta.get("resourceVersion"), "metadata.resourceVersion")

    @property
    def continue_token(self) -> str:
        """``metadata.continue`` (the next page's token), "" on the last page."""
        return str_field(self.meta.get("continue"), "metadata.continue")


__all__ = ["EMPTY", "FINISHED_PHASES", "ContainerView", "ListView", "NodeView", "ObjectView", "PodView",
           "list_field", "obj_field", "obj_list_field", "str_entry", "str_field"]
