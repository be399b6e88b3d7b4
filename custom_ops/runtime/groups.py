"""Process groups at the op boundary: resolved to a group name and a size.

Groups cross op boundaries as a group name string (traceable, hashable); the Python entry points
take a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``None`` (no context parallelism) and resolve it
with :func:`resolve_group` (docs/design.md section 3).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["resolve_group", "group_rank", "group_size", "check_group_size"]


def group_size(group_name: str) -> int:
    """The number of ranks in the process group registered under ``group_name`` (a string:
    :func:`resolve_group` takes a ``ProcessGroup`` or ``DeviceMesh``)."""
    if not isinstance(group_name, str):
        raise TypeError(
            f"group_size takes a group name (str), got {type(group_name).__name__}; use resolve_group(group)[1]"
        )
    by_name = getattr(dist.distributed_c10d, "_get_group_size_by_name", None)
    if by_name is not None:
        return by_name(group_name)
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def check_group_size(group_name: str, cp_size: int) -> int:
    """The group's size, which must equal ``cp_size``. cp_size is in the ops' schemas so that a
    compiled graph's cache key holds it: group names repeat across runs of different sizes."""
    world = group_size(group_name)
    if world != cp_size:
        raise ValueError(f"cp_size = {cp_size} but the process group {group_name!r} has {world} ranks")
    return world


def _group_name(pg: dist.ProcessGroup) -> str:
    name = getattr(pg, "group_name", None)
    return name if name is not None else dist.distributed_c10d._get_process_group_name(pg)


def resolve_group(group) -> tuple[str | None, int]:
    """``(group_name, world_size)`` for a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``None``.

    ``None`` means no context parallelism: ``(None, 1)``.
    """
    if group is None:
        return None, 1
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group: a DeviceMesh must be 1-D (the CP dimension), got {group.ndim}-D; pass mesh['cp'] or similar"
            )
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}")
    return _group_name(group), group.size()


def group_rank(group) -> int:
    """This process's rank in a ``ProcessGroup`` or 1-D ``DeviceMesh`` (0 for ``None``).

    ``ProcessGroup.rank()`` is a constant to dynamo, so this costs nothing under compile.
    """
    if group is None:
        return 0
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        group = group.get_group()
    return group.rank()
