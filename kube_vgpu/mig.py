"""MIG (Multi-Instance GPU): profile tables, the admin's strategy, profile choice and placement over
a GPU's geometry. Pure functions, no I/O; the device plugin's NVML adapter
(:mod:`deviceplugin.mig`) applies what is decided here.

**Strategies** (config ``devices.migStrategy``, per node ``nodes[].migStrategy``):

* ``none``: GPUs in MIG mode are not advertised (the default);
* ``single``: every MIG device of the node is advertised as one whole ``nvidia.com/gpu`` (booked by
  the scheduler like a card; one container per MIG device); all MIG devices must have one profile;
* ``mixed``: MIG devices are advertised per profile as ``nvidia.com/mig-<profile>``
  (:func:`kube_vgpu.resources.mig_resource`), counted by kube-scheduler as NVIDIA's plugin does;
* ``dynamic``: a memory request on a GPU in MIG mode is served by the smallest allowed profile that
  holds it (:func:`choose_profile`), placed where it keeps the most large profiles possible
  (:func:`place`); a GPU is repartitioned only while none of its instances is in use
  (:func:`repartition_refusal`).

**Geometry.** A GPU in MIG mode has 8 memory slices (A100, H100, H200); a GPU instance of a profile
takes ``memory_slices`` consecutive slices starting at one of the profile's allowed starts
(NVML's "possible placements"). Two instances may not share a slice, and a profile has at most
``instances`` instances at once. Units: memory in MiB (NVML's ``memorySizeMB``), slices counted.

The tables (:data:`TABLES`) hold, per GPU model, the facts docs/mig.md lists: names, compute
slices, memory fractions, instance counts and placements from NVIDIA's MIG user guide ("Supported
MIG Profiles"); the memory size in MiB each profile reports through NVML (``memorySizeMB``) from
NVIDIA's own NVML test double (go-nvml's mock GPU tables).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import VGPUError

#: the admin's choices (config ``devices.migStrategy``)
MIG_STRATEGIES = ("none", "single", "mixed", "dynamic")
#: memory slices of a GPU in MIG mode (A100, H100, H200)
MEMORY_SLICES = 8
#: compute slices of a GPU in MIG mode (A100, H100, H200)
COMPUTE_SLICES = 7


class MigError(VGPUError):
    """A MIG request cannot be served (no profile holds it, no free placement, a bad layout); the
    message names the request, the GPU and what was allowed."""


@dataclass(frozen=True, slots=True)
class Profile:
    """One GPU-instance profile of a GPU model.

    name: NVIDIA's profile name without the ``MIG `` prefix (``1g.10gb``, ``1g.10gb+me``);
    index: NVML's ``NVML_GPU_INSTANCE_PROFILE_*`` value (what ``nvmlDeviceGetGpuInstanceProfileInfo``
    takes); profile_id: the id the profile info reports and ``nvmlDeviceCreateGpuInstance`` takes
    (``nvidia-smi mig -lgip``'s ID); compute_slices: of 7; memory_slices: of 8 (the placement size);
    memory_mib: the instance's memory (MiB); instances: the most at once; starts: allowed first
    memory slices; media: the ``+me`` variant (the GPU's media engines, one instance at most).
    """

    name: str
    index: int
    profile_id: int
    compute_slices: int
    memory_slices: int
    memory_mib: int
    instances: int
    starts: tuple[int, ...]
    media: bool = False

    def slices_at(self, start: int) -> range:
        """The memory slices an instance at ``start`` takes."""
        return range(start, start + self.memory_slices)


@dataclass(frozen=True, slots=True)
class Table:
    """The MIG profiles of one GPU model: key (``A100-40GB``), NVML total memory (MiB) of the card,
    profiles from smallest to largest."""

    key: str
    memory_mib: int
    profiles: tuple[Profile, ...]

    def profile(self, name: str) -> Profile:
        """The profile called ``name``. Raises MigError naming the model and its profiles."""
        for p in self.profiles:
            if p.name == name:
                return p
        raise MigError(f"MIG profile {name!r} does not exist on {self.key}; "
                       f"its profiles: {', '.join(p.name for p in self.profiles)}")


def _table(key: str, total: int, mem: tuple[int, int, int, int, int], names: tuple[str, ...]) -> Table:
    """The shared layout of A100, H100 and H200 (7 compute, 8 memory slices): ``mem`` = MiB of the
    1-slice, 2-memory-slice, 3g/4g and 7g instances and of the 2g one; names in table order."""
    m1, m2, m4, m8, m2g = mem
    n1, n1me, n1big, n2, n3, n4, n7 = names
    return Table(key, total, (
        Profile(n1, 0, 19, 1, 1, m1, 7, (0, 1, 2, 3, 4, 5, 6)),
        Profile(n1me, 7, 20, 1, 1, m1, 1, (0, 1, 2, 3, 4, 5, 6), media=True),
        Profile(n1big, 9, 15, 1, 2, m2, 4, (0, 2, 4, 6)),
        Profile(n2, 1, 14, 2, 2, m2g, 3, (0, 2, 4)),
        Profile(n3, 2, 9, 3, 4, m4, 2, (0, 4)),
        Profile(n4, 3, 5, 4, 4, m4, 1, (0,)),
        Profile(n7, 4, 0, 7, 8, m8, 1, (0,)),
    ))


#: per GPU model, the MIG profiles (docs/mig.md lists them with their sources)
TABLES: dict[str, Table] = {t.key: t for t in (
    _table("A100-40GB", 40960, (4864, 9856, 19968, 40192, 9856),
           ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")),
    _table("A100-80GB", 81920, (9856, 19968, 40192, 80384, 19968),
           ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
    _table("H100-80GB", 81920, (10240, 20480, 40960, 81920, 20480),
           ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
    _table("H200-141GB", 144384, (18432, 35840, 72704, 144384, 35840),
           ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb")),
)}


def table_for(model: str, memory_mib: int) -> Table | None:
    """The profile table of a GPU by its NVML name and total memory (MiB), or None when MIG facts
    for it are not known (``NVIDIA H200`` -> H200-141GB; ``A100`` over 50 GiB -> A100-80GB)."""
    m = model.upper()
    if "H200" in m:
        return TABLES["H200-141GB"]
    if "H100" in m and memory_mib >= 70000:
        return TABLES["H100-80GB"]
    if "A100" in m:
        return TABLES["A100-80GB" if memory_mib > 51200 else "A100-40GB"]
    return None


@dataclass(frozen=True, slots=True)
class Instance:
    """A GPU instance on a GPU's geometry: profile name and first memory slice."""

    profile: str
    start: int


def instance_cores(profile: Profile, gpu_cores: int = 100) -> int:
    """A whole instance of ``profile`` as percent of its GPU's compute (``gpu_cores``: the GPU's,
    percent): its compute slices of 7, rounded down, so the instances of a layout never add up to
    more than the GPU (what a dynamic-MIG booking records as its cores)."""
    return profile.compute_slices * gpu_cores // COMPUTE_SLICES


def instance_memory_share(profile: Profile, gpu_mib: int) -> int:
    """The part of a GPU's memory (``gpu_mib``, MiB) an instance of ``profile`` takes: its memory
    slices of 8, rounded down. The scheduler's per-GPU accounting uses it (the profiles' own MiB
    can add up to more than the card: 3g.71gb twice is 145408 MiB on a 144384 MiB H200)."""
    return profile.memory_slices * gpu_mib // MEMORY_SLICES


def layout_error(table: Table, instances: Sequence[Instance]) -> str | None:
    """Why ``instances`` cannot exist together on a GPU of ``table`` (an unknown profile, a start the
    profile does not allow, two instances on one slice, more instances of a profile than it allows),
    or None when they can."""
    used: dict[int, Instance] = {}
    count: dict[str, int] = {}
    for inst in instances:
        try:
            p = table.profile(inst.profile)
        except MigError as e:
            return str(e)
        if inst.start not in p.starts:
            return (f"{inst.profile} cannot start at memory slice {inst.start} on {table.key}; "
                    f"allowed starts: {', '.join(map(str, p.starts))}")
        for s in p.slices_at(inst.start):
            if s in used:
                return f"{inst.profile}@{inst.start} overlaps {used[s].profile}@{used[s].start} (memory slice {s})"
            used[s] = inst
        count[p.name] = count.get(p.name, 0) + 1
        if count[p.name] > p.instances:
            return f"more than {p.instances} instance(s) of {p.name} on {table.key}"
    if sum(1 for i in instances if table.profile(i.profile).media) > 1:
        return f"more than one media-extension (+me) instance on {table.key}"
    return None


def free_starts(table: Table, profile: Profile, occupied: Sequence[Instance]) -> list[int]:
    """The starts where one more ``profile`` instance fits beside ``occupied`` (a valid layout)."""
    return [s for s in profile.starts if layout_error(table, [*occupied, Instance(profile.name, s)]) is None]


def headroom(table: Table, occupied: Sequence[Instance]) -> tuple[int, ...]:
    """How many more instances of each non-media profile still fit beside ``occupied``, largest
    profile first (placed one at a time at the lowest free start; the allowed starts are aligned to
    the profile's size, so that is the most of that profile alone). Compared lexicographically, a
    larger value keeps more large profiles possible: the fragmentation measure of :func:`place`."""
    out = []
    for p in sorted((p for p in table.profiles if not p.media),
                    key=lambda p: (p.memory_slices, p.compute_slices, p.memory_mib), reverse=True):
        got: list[Instance] = list(occupied)
        n = 0
        while True:
            starts = free_starts(table, p, got)
            if not starts:
                break
            got.append(Instance(p.name, starts[0]))
            n += 1
        out.append(n)
    return tuple(out)


def allowed_profiles(table: Table, allowlist: Sequence[str]) -> list[Profile]:
    """The profiles of ``table`` the admin allows, smallest first (memory, then compute slices, then
    memory slices): those named in ``allowlist``, or every profile without media extensions when it
    is empty. Names not in the table are ignored (an allowlist may name several models' profiles)."""
    ps = [p for p in table.profiles if (p.name in allowlist if allowlist else not p.media)]
    return sorted(ps, key=lambda p: (p.memory_mib, p.compute_slices, p.memory_slices))


def choose_profile(request_mib: int, table: Table, allowlist: Sequence[str] = ()) -> Profile:
    """The smallest allowed profile whose memory holds ``request_mib`` (MiB > 0).

    Raises MigError naming the request, the model and the allowed profiles with their sizes when
    none holds it, or when the request is not a positive whole number of MiB."""
    if isinstance(request_mib, bool) or not isinstance(request_mib, int) or request_mib <= 0:
        raise MigError(f"MIG request {request_mib!r} MiB: must be a whole number of MiB > 0")
    ps = allowed_profiles(table, allowlist)
    for p in ps:
        if p.memory_mib >= request_mib:
            return p
    sizes = ", ".join(f"{p.name} ({p.memory_mib} MiB)" for p in ps) or "none"
    raise MigError(f"no allowed MIG profile of {table.key} holds {request_mib} MiB; allowed profiles: {sizes}")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request goes: the profile and its first memory slice, and the GPU's headroom after it
    (:func:`headroom`)."""

    profile: Profile
    start: int
    headroom: tuple[int, ...]


def place(request_mib: int, table: Table, occupied: Sequence[Instance], allowlist: Sequence[str] = ()) -> Placement:
    """Place a request of ``request_mib`` MiB on a GPU of ``table`` that already holds ``occupied``.

    The smallest allowed profile that holds the request and still has a free start is taken (a
    larger allowed one only when every smaller one that holds it is full); among its free starts the
    one that leaves the largest :func:`headroom` (ties: the lowest start). Raises MigError naming the
    request, the model, the occupied layout and the profiles tried when nothing fits, or when
    ``occupied`` is not a valid layout."""
    bad = layout_error(table, occupied)
    if bad is not None:
        raise MigError(f"MIG layout of {table.key} is not valid: {bad}")
    first = choose_profile(request_mib, table, allowlist)
    tried = []
    for p in allowed_profiles(table, allowlist):
        if p.memory_mib < first.memory_mib:
            continue
        starts = free_starts(table, p, occupied)
        tried.append(p.name)
        if not starts:
            continue
        best = max(starts, key=lambda s: (headroom(table, [*occupied, Instance(p.name, s)]), -s))
        return Placement(p, best, headroom(table, [*occupied, Instance(p.name, best)]))
    layout = ", ".join(f"{i.profile}@{i.start}" for i in occupied) or "empty"
    raise MigError(f"no free placement for {request_mib} MiB on {table.key} (occupied: {layout}); "
                   f"profiles tried: {', '.join(tried)}")


def plan(requests_mib: Sequence[int], table: Table, allowlist: Sequence[str] = ()) -> list[Instance]:
    """A whole new layout for an idle GPU serving every request in ``requests_mib`` (MiB each):
    largest request first, each through :func:`place`. Raises MigError when they do not fit
    together (the message names the request that did not fit)."""
    got: list[Instance] = []
    for r in sorted(requests_mib, reverse=True):
        pl = place(r, table, got, allowlist)
        got.append(Instance(pl.profile.name, pl.start))
    return got


def repartition_refusal(gpu: str, busy: Mapping[str, int]) -> str | None:
    """Why GPU ``gpu`` may not be repartitioned now, or None: a GPU is repartitioned only while no
    instance has a process on it. ``busy``: MIG device uuid -> processes running on it."""
    inuse = sorted(u for u, n in busy.items() if n > 0)
    if inuse:
        return (f"GPU {gpu} is not repartitioned: MIG device(s) {', '.join(inuse)} have running processes; "
                f"only an idle GPU is repartitioned")
    return None


def single_profile_error(profiles: Mapping[str, str]) -> str | None:
    """The ``single`` strategy needs one profile across the node's MIG devices (uuid -> profile name);
    returns why not, or None."""
    names = sorted(set(profiles.values()))
    if len(names) > 1:
        return (f"migStrategy single needs every MIG device of the node to have one profile, found "
                f"{', '.join(names)}; use mixed, or repartition the GPUs")
    return None
