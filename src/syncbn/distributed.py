"""Process-group helpers and the one collective syncbn issues.

Everything that touches ``torch.distributed`` lives here; this module knows
nothing about batch normalization. Scale-out (rendezvous, transport, launch) is
``torch.distributed``'s job: syncbn only calls ``all_reduce`` on a group the user
created.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from syncbn._protocol import recording

__all__ = [
    "all_reduce_sum_",
    "check_alive",
    "check_collective",
    "check_device_backend",
    "check_process_group",
    "compiled_group_name",
    "create_process_group",
    "destroyed_test",
    "get_rank",
    "get_world_size",
    "group_from_name",
    "group_world_size",
    "is_distributed",
]


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (the default group if ``None``); 1 when not distributed.

    Raises:
        RuntimeError: if ``group`` is given but does not contain this rank.
        TypeError: if ``group`` is not a process group (:func:`check_process_group`).
    """
    if not is_distributed():
        check_process_group(group)
        if isinstance(group, dist.ProcessGroup):
            # a group without a default group: destroy_process_group() removed both, and a
            # layer that still holds it must not train unsynchronized, silently
            check_alive(group)
        return 1
    # (two tests, not isinstance(group, (ProcessGroup, NoneType)): dynamo cannot evaluate that)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        check_process_group(group)  # not a group at all: a TypeError
        # dist.new_group() returns GroupMember.NON_GROUP_MEMBER to ranks outside the group.
        raise RuntimeError(
            f"process_group does not contain this rank (global rank {dist.get_rank()}); "
            "every rank that calls SyncBatchNorm must belong to its process group"
        )
    return dist.get_world_size(group)


def check_process_group(group: object) -> None:
    """Refuse a ``process_group`` argument that is not a process group.

    Accepted: ``None`` (the default group), a ``torch.distributed.ProcessGroup``, and
    ``GroupMember.NON_GROUP_MEMBER``, what ``torch.distributed.new_group`` returns to the
    ranks outside the new group (a layer holding it raises when it would synchronize).

    Raises:
        TypeError: for anything else (a rank number, a list of ranks, a group's name).
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return
    # the sentinel is an int (-100) on the torch versions here
    non_member = dist.GroupMember.NON_GROUP_MEMBER if dist.is_available() else None
    if type(group) is type(non_member) and group == non_member:
        return
    raise TypeError(
        "process_group must be a torch.distributed.ProcessGroup or None, got "
        f"{type(group).__name__} ({group!r}); build one with "
        "torch.distributed.new_group(ranks) or syncbn.create_process_group(group_size)"
    )


#: whether dynamo reads ``id()`` of a process group as a constant: checked on torch 2.13
#: (older dynamo refuses ``id()`` of most objects, a graph break under ``fullgraph=True``)
_GRAPHS_NAME_GROUP_IDS = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def compiled_group_name(group: dist.ProcessGroup | None) -> str:
    """How a compiled graph names ``group`` (``""`` for ``None``, the default group): its
    ``group_name`` and the object's ``id``, read as constants while dynamo traces.

    The name alone is not enough: torch numbers groups from 0 again after
    ``destroy_process_group()`` and ``init_process_group()``, so a graph that named a
    destroyed group would synchronize over whichever new group took its name, silently. A
    graph is called with the group object it was traced for (dynamo guards on it), so while
    that object lives no other group has its ``id``. Before torch 2.13, the name alone.
    """
    if group is None:
        return ""
    return f"{group.group_name}@{id(group)}" if _GRAPHS_NAME_GROUP_IDS else group.group_name


def group_from_name(group_name: str) -> dist.ProcessGroup | None:
    """The process group that :func:`compiled_group_name` named ``group_name`` (or a bare
    ``group_name``); ``None`` (the default group) for ``""``.

    Compiled graphs name groups, as torch's functional collectives do: a graph holds no
    Python object.

    Raises:
        RuntimeError: if no group of this process has that name, or the group of that
            name is not the object that the graph was traced for (that one was destroyed,
            and a new group took its name).
    """
    if not group_name:
        return None
    name, at, identity = group_name.rpartition("@")
    if not at or not identity.isdigit():  # a bare name (before torch 2.13), "@" or not
        name, identity = group_name, ""
    for group, group_name_now in dist.distributed_c10d._world.pg_names.items():
        if group_name_now == name:
            if identity and int(identity) != id(group):
                break
            return group
    raise RuntimeError(
        f"SyncBatchNorm's process group (named {name!r}) has been destroyed "
        "(destroy_process_group) since this call was compiled; give the call a live group, "
        "or None for the default group"
    )


#: per process group, its :func:`destroyed_test` (built once; the group is held weakly)
_destroyed_tests: weakref.WeakKeyDictionary[dist.ProcessGroup, Callable[[], bool]] = (
    weakref.WeakKeyDictionary()
)


def _never_destroyed() -> bool:
    return False


def destroyed_test(group: dist.ProcessGroup | None = None) -> Callable[[], bool]:
    """A test of whether ``group`` (the current default group if ``None``) has been destroyed
    since, by ``destroy_process_group``; the test holds no reference to the group.

    A check that waits for a collective's result keeps one, so that a destroyed group's
    problem is never raised in a later group's call (after ``destroy_process_group`` and
    ``init_process_group`` again, in the same process).
    """
    if group is None:
        group = dist.group.WORLD if is_distributed() else None
        if group is None:
            return _never_destroyed
    test = _destroyed_tests.get(group)
    if test is None:
        alive = weakref.ref(group)

        def destroyed() -> bool:
            current = alive()
            # a destroyed group is unregistered at once, but lives on while referenced
            return current is None or current not in dist.distributed_c10d._world.pg_names

        test = _destroyed_tests[group] = destroyed
    return test


def check_alive(group: dist.ProcessGroup | None = None) -> None:
    """Raise a clear error if ``group`` has been destroyed by ``destroy_process_group``.

    torch refuses a destroyed group in the collective, in words that vary by version (a
    ``ValueError`` "not initialized in the world group map" on torch 2.13, a ``TypeError``
    "Invariant encountered: value was None" on torch 2.3).

    Raises:
        RuntimeError: naming the cause and the way out.
    """
    if destroyed_test(group)():
        raise RuntimeError(
            "SyncBatchNorm's process group has been destroyed (destroy_process_group); give "
            "the layer a live group (layer.process_group = torch.distributed.new_group(...)), "
            "or None for the default group"
        )


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This rank's index in ``group``; 0 when not distributed."""
    return dist.get_rank(group) if is_distributed() else 0


@functools.cache
def _supported_device_types(backend: str) -> frozenset[str] | None:
    """Device types a backend (or a ``"cpu:gloo,cuda:nccl"`` spec) can all_reduce, if known."""
    capability = getattr(dist.Backend, "backend_capability", None)
    if capability is None:  # torch < 2.2 has no capability table: let the collective decide
        return None
    devices: set[str] = set()
    for part in backend.split(","):
        if ":" in part:
            device_type, name = part.split(":", 1)
            if name.strip().lower() in capability:
                devices.add(device_type.strip())
            continue
        if part.strip().lower() not in capability:
            return None  # a third-party backend: we cannot know, let the collective decide
        devices.update(capability[part.strip().lower()])
    return frozenset(devices)


class _GroupFacts(NamedTuple):
    """What every synchronized call reads of its process group and which never changes
    while the group lives, read once per group (see :func:`group_world_size`)."""

    world_size: int
    backend: str
    destroyed: Callable[[], bool]


#: per explicit process group, its facts (the group is held weakly)
_group_facts: weakref.WeakKeyDictionary[dist.ProcessGroup, _GroupFacts] = (
    weakref.WeakKeyDictionary()
)
#: the facts of the default group (``group=None``) read last, valid while that group lives
_default_group_facts: list[_GroupFacts | None] = [None]


def _live_facts(group: dist.ProcessGroup | None) -> _GroupFacts | None:
    """The remembered facts of ``group`` if it still lives; ``None`` where none are (not
    read yet, destroyed since, a default group destroyed and initialized again, or not a
    process group), and the caller takes torch's own path."""
    if group is None:
        facts = _default_group_facts[0]
    elif isinstance(group, dist.ProcessGroup):
        facts = _group_facts.get(group)
    else:
        return None
    return None if facts is None or facts.destroyed() else facts


def _remember_facts(group: dist.ProcessGroup | None) -> None:
    """Read ``group``'s facts and remember them, if it lives in an initialized world."""
    if not is_distributed():
        return
    destroyed = destroyed_test(group)  # for None, that of the default group now
    if destroyed():
        return
    facts = _GroupFacts(dist.get_world_size(group), str(dist.get_backend(group)), destroyed)
    if group is None:
        _default_group_facts[0] = facts
    else:
        _group_facts[group] = facts


def group_world_size(group: dist.ProcessGroup | None = None) -> int:
    """:func:`get_world_size`, read once per live process group: for the code that runs
    at each synchronized call (and that dynamo never traces: it cannot trace the cache).

    A group's size never changes; a destroyed group, or a default group initialized
    again, is read again (and refused where :func:`get_world_size` refuses it). Each
    ``torch.distributed`` query is several Python calls: read at every call, the world
    size, the backend and the destroyed test were ~30 of the ~100 Python calls of a
    compiled layer's synchronizing op.
    """
    facts = _live_facts(group)
    if facts is not None:
        return facts.world_size
    world_size = get_world_size(group)
    _remember_facts(group)
    return world_size


def check_collective(device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """:func:`check_alive` and :func:`check_device_backend` before a collective, from
    the facts that :func:`group_world_size` remembers where it has them."""
    facts = _live_facts(group)
    if facts is None:  # torch's own queries, which refuse what they refuse
        check_alive(group)
        check_device_backend(device, group)
        return
    _check_device_type(device, facts.backend)


def check_device_backend(device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """Raise a clear error if ``group``'s backend cannot all_reduce tensors on ``device``.

    Raises:
        RuntimeError: naming the device type and the backend, e.g. CPU tensors on an
            nccl group.
    """
    _check_device_type(device, str(dist.get_backend(group)))


def _check_device_type(device: torch.device, backend: str) -> None:
    """:func:`check_device_backend` for a backend already read (``str`` of its name)."""
    supported = _supported_device_types(backend)
    if supported is not None and device.type not in supported:
        raise RuntimeError(
            f"SyncBatchNorm input is on device type '{device.type}' but the process group's "
            f"backend '{backend}' only supports {sorted(supported)}; move the model and its "
            "input to a supported device, or pass a process_group created with a backend that "
            "supports this device (e.g. gloo for cpu, nccl for cuda)"
        )


def all_reduce_sum_(buffer: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``buffer`` in place over all ranks of ``group``: one ``all_reduce``, synchronous.

    Errors raised by the backend (including a timeout when another rank never
    joins) are re-raised with the same type, prefixed with what syncbn was doing.
    """
    try:
        if recording():
            _recorded_all_reduce_sum_(buffer, group)
        else:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as error:
        if _vectorized(error):  # not another rank's doing
            raise type(error)(
                "SyncBatchNorm: a synchronized training call cannot run under a torch.func "
                "transform (vmap, jacrev, torch.autograd.functional.jacobian with "
                "vectorize=True, ...): its collective has no batching rule. Call it "
                f"without the transform (jacobian with vectorize=False). Backend error: {error}"
            ) from error
        raise type(error)(
            f"SyncBatchNorm all_reduce of {buffer.numel()} values on device "
            f"'{buffer.device}' failed (backend '{dist.get_backend(group)}'). If other ranks "
            "stopped calling SyncBatchNorm, check that every rank calls every SyncBatchNorm "
            f"layer the same number of times, in the same order. Backend error: {error}"
        ) from error
    return buffer


def _vectorized(error: RuntimeError) -> bool:
    """Whether the collective failed because a ``vmap`` runs the call: a ``torch.func``
    transform, or the older vmap of ``torch.autograd.functional.jacobian(vectorize=True)``,
    which torch tells only by its error (no collective has a batching rule)."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active is not None and active()) or "Batching rule not implemented" in str(error)


def _recorded_all_reduce_sum_(buffer: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """:func:`all_reduce_sum_` where ``make_fx`` records the ops into a graph: through torch's
    functional collectives, which it records with their wait. ``dist.all_reduce`` waits
    on its work object, outside the ops: its graph read the sum before the collective had
    written it (gloo runs it on a thread of its own), and gave other numbers at each run."""
    from torch.distributed import _functional_collectives

    if group is None:
        group = dist.distributed_c10d._get_default_group()
    total = _functional_collectives.all_reduce(buffer, "sum", group)
    buffer.copy_(_functional_collectives.wait_tensor(total))


def create_process_group(group_size: int) -> dist.ProcessGroup:
    """Split the world into consecutive blocks of ``group_size`` ranks; return this rank's block.

    This is a collective: every rank of the default group must call it, with the
    same ``group_size``. Use it to synchronize statistics within a node, e.g.
    ``create_process_group(torch.cuda.device_count())``.

    Args:
        group_size: number of ranks per block; must divide the world size.

    Returns:
        The process group of the block that contains this rank.

    Raises:
        RuntimeError: if no default process group is initialized.
        ValueError: if ``group_size`` is not positive or does not divide the world size.
    """
    if not is_distributed():
        raise RuntimeError(
            "create_process_group requires torch.distributed.init_process_group() "
            "to be called first"
        )
    world_size = dist.get_world_size()
    if group_size <= 0 or world_size % group_size != 0:
        raise ValueError(
            f"group_size must be a positive divisor of the world size, got group_size={group_size} "
            f"and world_size={world_size}"
        )
    blocks = [list(range(start, start + group_size)) for start in range(0, world_size, group_size)]
    current, _ = dist.new_subgroups_by_enumeration(blocks)
    return current
