"""Checks of layout *values* (cumulative lengths, offsets, permutations), run where asked.

Shapes, dtypes and devices are checked on every call for free (:mod:`custom_ops.thd.checks`);
values live on the device, so checking them costs a host sync. The checked mode (``CP_OPS_CHECKS``
or :func:`~custom_ops.thd.checked_mode.set_checks`): ``"eager"`` (the default) validates eager
calls, made from Python through the ops' Python objects, the wrappers and the layers, and nothing
in compiled graphs or CUDA graph captures; ``True`` validates every call, compiled graphs included
(the opaque op ``cp_ops::check_layout`` of custom_ops/check_layout/, in the graph when it is
traced: set the mode before compiling); ``False`` validates nothing. A check raises ``ValueError``
naming the argument and the sequence, where the op would otherwise return finite, wrong rows
(docs/design.md section 1, "What is checked when").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from custom_ops.thd import checked_mode
from custom_ops.thd.checks import check_cp_size, check_index_tensor

__all__ = [
    "checked",
    "validate",
    "validate_cumulative",
    "validate_padded",
    "validate_thd",
    "validate_offsets",
    "validate_permutation",
    "validate_varlen_segments",
    "Segments",
]


class Segments(NamedTuple):
    """The five 1-D int32/int64 tables of segment attention, one entry per segment, in the ops'
    argument order: query rows ``[q_start, q_start + q_len)`` at positions from ``q_pos`` attend
    to key rows ``[k_start, k_start + k_len)`` (docs/design.md section 5)."""

    q_start: torch.Tensor
    q_len: torch.Tensor
    q_pos: torch.Tensor
    k_start: torch.Tensor
    k_len: torch.Tensor


def _first_bad(mask: torch.Tensor) -> int | None:
    idx = torch.nonzero(mask)
    return int(idx[0]) if idx.numel() else None


def validate_cumulative(name: str, cu: torch.Tensor, num_rows: int | None = None) -> None:
    """``cu`` starts at 0, is non-decreasing and, if ``num_rows`` is given, ends at it."""
    check_index_tensor(name, cu, cu.device)
    cu = cu.to(torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    bad = _first_bad(cu[1:] < cu[:-1])
    if bad is not None:
        raise ValueError(
            f"{name} must be non-decreasing: sequence {bad} has {name}[{bad}] = {int(cu[bad])} > "
            f"{name}[{bad + 1}] = {int(cu[bad + 1])}"
        )
    _check_end(name, cu, num_rows)


def _check_end(name: str, cu: torch.Tensor, num_rows: int | None) -> None:
    if num_rows is not None and int(cu[-1]) != num_rows:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} but the tensor has {num_rows} rows")


def validate_padded(cu_seqlens_padded: torch.Tensor, cp_size: int, num_rows: int | None = None) -> None:
    """``cu_seqlens_padded`` is cumulative, every padded length a multiple of ``2*cp_size``, and
    it ends at ``num_rows`` if given (the rows of the sequence-order tensor, W times a shard's)."""
    check_cp_size(cp_size)
    validate_cumulative("cu_seqlens_padded", cu_seqlens_padded, num_rows)
    _check_multiples(cu_seqlens_padded, cp_size)


def _check_multiples(cu_seqlens_padded: torch.Tensor, cp_size: int) -> None:
    padded = cu_seqlens_padded.to(torch.int64).diff()
    block = 2 * cp_size
    bad = _first_bad(padded % block != 0)
    if bad is not None:
        raise ValueError(
            f"cu_seqlens_padded: sequence {bad} has padded length {int(padded[bad])}, "
            f"not a multiple of 2*cp_size = {block} (pack the batch for cp_size = {cp_size}: "
            "cp_ops.pack or cp_ops.pad_cu_seqlens)"
        )


def _check_shard_rows(cu_seqlens_padded: torch.Tensor, cp_size: int, shard_rows: int) -> None:
    """A rank's shard has ``cu_seqlens_padded[-1] / cp_size`` rows."""
    total = int(cu_seqlens_padded[-1])
    if total != shard_rows * cp_size:
        if cp_size == 1:
            raise ValueError(f"cu_seqlens_padded[-1] = {total} but the input has {shard_rows} rows")
        raise ValueError(
            f"this rank's input has {shard_rows} rows, but its shard of the layout has cu_seqlens_padded[-1] / "
            f"cp_size = {total} / {cp_size} rows: pass this rank's shard (cp_ops.shard_thd) with the "
            "whole batch's layout"
        )


def validate_thd(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, num_rows: int | None = None
) -> None:
    """Raise ``ValueError`` (naming the argument and sequence) unless the layout is valid.

    Checks: int32/int64 1-D tensors of one length on one device; both start at
    0 and are non-decreasing; every padded length is a multiple of 2*cp_size
    and at least the real length; ``cu_seqlens_padded[-1] == num_rows`` if
    given. Reads values, so call it where data is prepared, not in a compiled step.
    """
    check_cp_size(cp_size)
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, cu_seqlens_padded.device)
    check_index_tensor("cu_seqlens", cu_seqlens, cu_seqlens_padded.device)
    if cu_seqlens.shape != cu_seqlens_padded.shape:
        raise ValueError(
            f"cu_seqlens and cu_seqlens_padded must have one length (B+1), got {cu_seqlens.shape[0]} "
            f"and {cu_seqlens_padded.shape[0]}"
        )
    validate_cumulative("cu_seqlens", cu_seqlens)
    validate_cumulative("cu_seqlens_padded", cu_seqlens_padded)
    lens, padded = cu_seqlens.to(torch.int64).diff(), cu_seqlens_padded.to(torch.int64).diff()
    bad = _first_bad(lens > padded)
    if bad is not None:
        raise ValueError(
            f"cu_seqlens: sequence {bad} has real length {int(lens[bad])} > padded length {int(padded[bad])} "
            "(are cu_seqlens and cu_seqlens_padded swapped?)"
        )
    _check_end("cu_seqlens_padded", cu_seqlens_padded, num_rows)
    _check_multiples(cu_seqlens_padded, cp_size)


def validate_offsets(offsets: torch.Tensor, cu_seqlens: torch.Tensor, num_rows: int) -> None:
    """Raise ``ValueError`` unless the segments ``[offsets[i], offsets[i] + L_i)`` of
    :func:`custom_ops.thd_copy_valid_tokens` are sorted, disjoint and inside ``num_rows`` rows."""
    check_index_tensor("cu_seqlens", cu_seqlens, cu_seqlens.device)
    check_index_tensor("offsets", offsets, cu_seqlens.device, min_numel=0)
    n_seq = cu_seqlens.shape[0] - 1
    if offsets.shape[0] not in (n_seq, n_seq + 1):
        raise ValueError(f"offsets must have B or B+1 entries for B = {n_seq}, got {offsets.shape[0]}")
    validate_cumulative("cu_seqlens", cu_seqlens)
    starts = offsets[:n_seq].to(torch.int64)
    ends = starts + cu_seqlens.to(torch.int64).diff()
    bad = _first_bad(starts < 0)
    if bad is not None:
        raise ValueError(f"offsets: sequence {bad} starts at negative row {int(starts[bad])}")
    bad = _first_bad(starts[1:] < ends[:-1])
    if bad is not None:
        raise ValueError(
            f"offsets: sequence {bad + 1} starts at row {int(starts[bad + 1])}, inside sequence {bad} "
            f"(rows {int(starts[bad])}..{int(ends[bad]) - 1}); segments must be sorted and disjoint"
        )
    bad = _first_bad(ends > num_rows)
    if bad is not None:
        raise ValueError(f"offsets: sequence {bad} ends at row {int(ends[bad])}, past the {num_rows} rows")


def validate_permutation(name: str, rows: torch.Tensor, n: int) -> None:
    """``rows`` holds every integer of ``range(n)`` exactly once."""
    check_index_tensor(name, rows, rows.device, min_numel=0)
    if rows.numel() != n:
        raise ValueError(f"{name} must be a permutation of range({n}), got {rows.numel()} entries")
    r = rows.to(torch.int64)
    bad = _first_bad((r < 0) | (r >= n))
    if bad is not None:
        raise ValueError(f"{name}[{bad}] = {int(r[bad])} is not in range({n})")
    seen = torch.bincount(r, minlength=n)
    bad = _first_bad(seen != 1)
    if bad is not None:
        raise ValueError(f"{name} must be a permutation of range({n}): {bad} appears {int(seen[bad])} times")


def validate_varlen_segments(
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    num_q_rows: int,
    num_k_rows: int,
) -> None:
    """Check segment tables on the host (syncs; call it where batches are built).

    Raises ValueError unless lengths are >= 0, every query range lies in
    ``[0, num_q_rows)`` and the key range of every non-empty one in ``[0, num_k_rows)``
    (a segment without query rows reads no key), and the non-empty query ranges are
    pairwise disjoint.
    """
    tables = {name: t.tolist() for name, t in zip(Segments._fields, (q_start, q_len, q_pos, k_start, k_len))}
    n = len(tables["q_start"])
    if any(len(t) != n for t in tables.values()):
        raise ValueError("the five segment tensors must have one length")
    spans = []
    for s in range(n):
        qs, ql, ks, kl = tables["q_start"][s], tables["q_len"][s], tables["k_start"][s], tables["k_len"][s]
        if ql < 0 or kl < 0:
            raise ValueError(f"segment {s}: q_len = {ql} and k_len = {kl} must be >= 0")
        if qs < 0 or qs + ql > num_q_rows:
            raise ValueError(f"segment {s}: query rows [{qs}, {qs + ql}) are not inside [0, {num_q_rows})")
        if ql > 0 and (ks < 0 or ks + kl > num_k_rows):
            raise ValueError(f"segment {s}: key rows [{ks}, {ks + kl}) are not inside [0, {num_k_rows})")
        if ql > 0:
            spans.append((qs, qs + ql, s))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"the query rows of segments {a} and {b} overlap")


# kind -> validator(index, *others, *sizes)
_VALIDATORS = {
    "cumulative": lambda cu, num_rows: validate_cumulative("cu_seqlens", cu, num_rows),
    "padded": validate_padded,
    "thd": validate_thd,
    # a rank's shard of shard_rows rows (a layer's x): the layout's rows are cp_size times as many
    "padded_shard": lambda cup, cp_size, shard_rows: (
        check_cp_size(cp_size),
        validate_cumulative("cu_seqlens_padded", cup),
        _check_shard_rows(cup, cp_size, shard_rows),
        _check_multiples(cup, cp_size),
    ),
    "thd_shard": lambda cu, cup, cp_size, shard_rows: (
        validate_thd(cu, cup, cp_size), _check_shard_rows(cup, cp_size, shard_rows)
    ),
    "offsets": lambda offsets, cu, num_rows: validate_offsets(offsets, cu, num_rows),
    "permutation": lambda rows, n: validate_permutation("rows", rows, n),
    "segments": validate_varlen_segments,
}


def validate(kind: str, index: torch.Tensor, others: Sequence[torch.Tensor], sizes: Sequence[int]) -> None:
    """Validate ``index`` (and ``others``, ``sizes``) as layout ``kind`` on the host: the check that
    :func:`checked` runs, eagerly or through the op ``cp_ops::check_layout``."""
    if kind not in _VALIDATORS:
        raise ValueError(f"unknown layout kind {kind!r}; one of {sorted(_VALIDATORS)}")
    _VALIDATORS[kind](index, *others, *sizes)


def _eager(index: torch.Tensor) -> bool:
    """Whether ``index`` is a real tensor outside a CUDA graph capture (not a compiler's fake or
    functional tensor), so that reading it now is an eager check."""
    return type(index) is torch.Tensor and not (index.is_cuda and torch.cuda.is_current_stream_capturing())


def checked(
    kind: str, index: torch.Tensor, others: Sequence[torch.Tensor] = (), *sizes: int, entry: bool = False
) -> torch.Tensor:
    """``index``, validated as ``kind`` (see ``_VALIDATORS``) where the checked mode asks for it;
    use the result in place of ``index``. With the mode on, through the op ``cp_ops::check_layout`` (so that
    a compiled graph holds the check); in the eager mode, on the host where the call is eager:
    ``entry=True`` for Python code the compiler traces (a layer's forward), which is eager
    whenever no compiler traces it; an op's body (the default) only within
    :func:`~custom_ops.thd.checked_mode.call_checked`.
    """
    mode = checked_mode.checks_enabled()
    if mode is True:
        return torch.ops.cp_ops.check_layout(kind, index, list(others), list(sizes))
    if not mode:
        return index
    eager = not torch.compiler.is_compiling() if entry else checked_mode.eager_call()
    if eager and _eager(index):
        validate(kind, index, others, sizes)
    return index
