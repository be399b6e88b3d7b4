"""Head-section permutation for CP <-> head-parallel conversions, as torch.library ops.

Also the two fused layout steps of the all-to-all in :mod:`custom_ops.all_to_all`, ops of
their own (``sections_to_rank_blocks``, ``rank_blocks_to_sections``): the same
kernel writing or reading the rank-blocked ``[W, rows, F/W]`` layout directly,
so the all-to-all send buffer is built in one pass with no separate transpose.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from custom_ops.runtime.launch import launch, use_triton
from custom_ops.runtime.registration import NAMESPACE, kernel_op
from custom_ops.runtime.tiles import cdiv, next_power_of_2
from custom_ops.runtime.words import dense, from_row_matrix, to_words, word_dtype
from custom_ops.sections.kernels import permute_sections_kernel
from custom_ops.sections.reference import permute_sections_reference, unpermute_sections_reference
from custom_ops.thd.checks import check_cp_size


def check_sections(name: str, width: int, sections, cp_size: int, world: str = "cp_size") -> list[int]:
    """Checks that ``sections`` tile a last dim of ``width`` and each splits over ``cp_size``
    ranks (called ``world`` in the messages); returns the local (per-rank) widths.

    Under ``torch.compile(dynamic=True)`` the widths and ``cp_size`` may arrive symbolic;
    they are model constants and the kernel is specialised on them, so they are
    specialised (guarded) here.
    """
    key = (name, width, cp_size, *sections) if type(sections) in (list, tuple) else None
    # plain ints only (a symbolic size must still be guarded, and True would hash as 1), and not
    # while dynamo traces a caller, which would guard on the cache's contents
    if key is not None and set(map(type, key[1:])) == {int} and not torch.compiler.is_compiling():
        local = _CHECKED.get(key)
        if local is None:
            local = _CHECKED[key] = tuple(_check_sections(name, width, sections, cp_size, world))
        return list(local)
    return _check_sections(name, width, sections, cp_size, world)


# cache: (name, width, cp_size, *sections) of every plain-int layout already checked -> local widths
_CHECKED: dict = {}


def _check_sections(name: str, width: int, sections, cp_size: int, world: str) -> list[int]:
    cp_size = _concrete(cp_size)
    check_cp_size(cp_size)
    if not isinstance(sections, (list, tuple)) or not all(
        isinstance(s, (int, torch.SymInt)) and not isinstance(s, bool) for s in sections
    ):
        raise TypeError(f"sections must be a list of ints, got {sections!r}")
    sections = [int(s) for s in sections]
    for b, s in enumerate(sections):
        if s < 0:
            raise ValueError(f"sections[{b}] = {s} is negative")
        if s % cp_size:
            raise ValueError(f"sections[{b}] = {s} is not divisible by {world} = {cp_size}")
    if sum(sections) != width:
        raise ValueError(f"sections {list(sections)} sum to {sum(sections)}, but {name} has {width} features (last dim)")
    return [s // cp_size for s in sections]


def _concrete(cp_size):
    return int(cp_size) if isinstance(cp_size, torch.SymInt) else cp_size


def _check(x: torch.Tensor, sections, cp_size: int) -> list[int]:
    """Checks x and sections; returns the local widths (concrete ints)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have a feature dimension (last dim), got a 0-d tensor")
    return check_sections("x", x.shape[-1], sections, cp_size)


def _check_rank_blocks(blocks: torch.Tensor, sections, cp_size: int) -> None:
    check_cp_size(cp_size)
    if not isinstance(blocks, torch.Tensor):
        raise TypeError(f"blocks must be a torch.Tensor, got {type(blocks).__name__}")
    if blocks.dim() < 2 or blocks.shape[0] != cp_size:
        raise ValueError(f"rank blocks must be [cp_size = {cp_size}, ..., F/cp_size], got {tuple(blocks.shape)}")
    check_sections("blocks (cp_size x last dim)", blocks.shape[-1] * cp_size, sections, cp_size)


def _words(x: torch.Tensor, num_cols: int) -> tuple[torch.Tensor, int]:
    """``x`` as a contiguous ``[R, num_cols * k]`` matrix of the same bytes, and k
    (words per element, see :func:`custom_ops.runtime.words.word_dtype`): a 2-D ``x`` of a dtype
    Triton moves as itself is that matrix already, made contiguous (no view, which costs host
    time at every call)."""
    if x.dim() == 2 and word_dtype(x.dtype)[0] == x.dtype:
        return x.contiguous(), 1
    x = dense(x)
    return to_words(x.reshape(math.prod(x.shape[:-1]), num_cols))


@dataclasses.dataclass(frozen=True)
class SectionSettings:
    """Tiles of the section-permutation kernel: a column tile covers up to ``max_run_bytes`` of
    one section's run per row; a program takes as many rows as make its widest tile about
    ``tile_bytes``, with ``num_warps``."""

    max_run_bytes: int = 4096
    tile_bytes: int = 16384
    num_warps: int = 4


# the settings the ops launch with; a sweep passes others to :func:`section_tiles`
SECTION_SETTINGS = SectionSettings()


def section_tiles(
    local_widths: list[int], word_bytes: int, interpreting: bool = False, settings: SectionSettings = SECTION_SETTINGS
) -> tuple[tuple[int, ...], int, int]:
    """(column tile of each section, rows per program, column tiles of the widest section) for
    :func:`permute_sections_kernel` over local section widths in words. Under Triton's
    interpreter the tiles are tiny, so CPU tests run several column tiles per section."""
    cap = 4 if interpreting else max(1, settings.max_run_bytes // word_bytes)
    blocks = tuple(min(next_power_of_2(max(w, 1)), cap) for w in local_widths)
    block_r = 2 if interpreting else max(1, min(64, settings.tile_bytes // (max(blocks) * word_bytes)))
    tiles = max(cdiv(w, bc) for w, bc in zip(local_widths, blocks))
    return blocks, block_r, tiles


@functools.lru_cache(maxsize=256)
def _tiles(local_widths: tuple, k: int, word_bytes: int, interpreting: bool, settings: SectionSettings):
    """``(LOFF, BLOCKS, BLOCK_R, column tiles)`` of a launch under ``settings``."""
    words = [w * k for w in local_widths]
    loff = [0]
    for w in words:
        loff.append(loff[-1] + w)
    blocks, block_r, tiles = section_tiles(words, word_bytes, interpreting, settings)
    return tuple(loff), blocks, block_r, tiles


def _launch(plain, blocked, local_widths, cp_size: int, k: int, blocked_strides, to_blocks, settings: SectionSettings):
    rows, cols = plain.shape
    if rows == 0 or cols == 0:
        return
    # CPU tensors reach the kernel only under Triton's interpreter
    loff, blocks, block_r, tiles = _tiles(tuple(local_widths), k, plain.element_size(), plain.device.type == "cpu", settings)
    grid = (cdiv(rows, block_r), cp_size, tiles)
    launch(
        permute_sections_kernel,
        grid,
        plain,
        blocked,
        rows,
        cp_size,
        blocked_strides[0],
        blocked_strides[1],
        LOFF=loff,
        BLOCKS=blocks,
        TO_BLOCKS=to_blocks,
        BLOCK_R=block_r,
        num_warps=settings.num_warps,
    )


def _permute(x: torch.Tensor, sections, cp_size: int, rank_blocks: bool) -> torch.Tensor:
    cp_size = _concrete(cp_size)
    local = _check(x, sections, cp_size)
    sections = [int(s) for s in sections]
    num_cols, local_cols = x.shape[-1], x.shape[-1] // cp_size
    lead = tuple(x.shape[:-1])
    if not use_triton(x):
        out = permute_sections_reference(x, sections, cp_size)
        if rank_blocks:
            out = out.unflatten(-1, (cp_size, local_cols)).movedim(-2, 0)
        return out.contiguous()
    if x.numel() == 0:  # nothing to move (and no word view of an empty tensor is needed)
        return x.new_empty(((cp_size,) + lead + (local_cols,)) if rank_blocks else x.shape)
    plain, k = _words(x, num_cols)
    rows = plain.shape[0]
    if rank_blocks:
        out = plain.new_empty((cp_size, rows, local_cols * k))
        strides = (rows * local_cols * k, local_cols * k)
        shape = (cp_size,) + lead + (local_cols,)
    else:
        out = torch.empty_like(plain)
        strides = (local_cols * k, num_cols * k)
        shape = x.shape
    _launch(plain, out, local, cp_size, k, strides, True, SECTION_SETTINGS)
    return from_row_matrix(out, x.dtype, shape)


def _unpermute(x: torch.Tensor, sections, cp_size: int, rank_blocks: bool) -> torch.Tensor:
    """``rank_blocks``: x is ``[W, ..., F/W]`` and the result ``[..., F]``; else both ``[..., F]``."""
    cp_size = _concrete(cp_size)
    if rank_blocks:
        _check_rank_blocks(x, sections, cp_size)
        num_cols = x.shape[-1] * cp_size
        lead = tuple(x.shape[1:-1])
    else:
        _check(x, sections, cp_size)
        num_cols = x.shape[-1]
        lead = tuple(x.shape[:-1])
    sections = [int(s) for s in sections]
    local = [s // cp_size for s in sections]
    local_cols = num_cols // cp_size
    if not use_triton(x):
        plain = x.movedim(0, -2).flatten(-2) if rank_blocks else x
        return unpermute_sections_reference(plain, sections, cp_size).contiguous()
    if x.numel() == 0:
        return x.new_empty(lead + (num_cols,))
    src = x.contiguous()
    word, k = word_dtype(x.dtype)
    rows = math.prod(lead)
    blocked = src if word == x.dtype else src.view(word)
    out = torch.empty((rows, num_cols * k), dtype=word, device=x.device)
    if rank_blocks:
        strides = (rows * local_cols * k, local_cols * k)
    else:
        strides = (local_cols * k, num_cols * k)
    _launch(out, blocked, local, cp_size, k, strides, False, SECTION_SETTINGS)
    return from_row_matrix(out, x.dtype, lead + (num_cols,))


@kernel_op(f"{NAMESPACE}::sections_to_rank_blocks", mutates_args=())
def sections_to_rank_blocks(x: torch.Tensor, sections: list[int], cp_size: int) -> torch.Tensor:
    """``[..., F]`` -> ``[W, ..., F/W]``: block d is rank d's slice of every section, in section
    order (``permute_sections`` with the rank blocks moved to the front), in one kernel pass:
    the send buffer of the CP -> head-parallel all-to-all. Differentiable (the gradient is
    :func:`rank_blocks_to_sections`)."""
    return _permute(x, sections, cp_size, rank_blocks=True)


@sections_to_rank_blocks.register_fake
def _(x, sections, cp_size):
    _check(x, sections, cp_size)
    return x.new_empty((cp_size,) + tuple(x.shape[:-1]) + (x.shape[-1] // cp_size,))


@kernel_op(f"{NAMESPACE}::rank_blocks_to_sections", mutates_args=())
def rank_blocks_to_sections(blocks: torch.Tensor, sections: list[int], cp_size: int) -> torch.Tensor:
    """The inverse of :func:`sections_to_rank_blocks`: ``[W, ..., F/W]`` -> ``[..., F]``
    (``sections`` are the global widths)."""
    return _unpermute(blocks, sections, cp_size, rank_blocks=True)


@rank_blocks_to_sections.register_fake
def _(blocks, sections, cp_size):
    _check_rank_blocks(blocks, sections, cp_size)
    return blocks.new_empty(tuple(blocks.shape[1:-1]) + (blocks.shape[-1] * cp_size,))


@kernel_op(f"{NAMESPACE}::permute_sections", mutates_args=())
def permute_sections(x: torch.Tensor, sections: list[int], cp_size: int) -> torch.Tensor:
    """Regroup the sections of the last dim by rank.

    x: ``[..., F]``, any dtype; the last dim is a concatenation of sections of widths
    ``sections`` (each divisible by ``W = cp_size``, summing to F). Returns ``[..., F]``
    whose block d (columns ``[d*F/W, (d+1)*F/W)``) is rank d's contiguous slice
    (width ``s/W``) of every section, in section order. Moves bits exactly;
    differentiable (the gradient is :func:`unpermute_sections`).
    """
    return _permute(x, sections, cp_size, rank_blocks=False)


@permute_sections.register_fake
def _(x, sections, cp_size):
    _check(x, sections, cp_size)
    return x.new_empty(x.shape)


@kernel_op(f"{NAMESPACE}::unpermute_sections", mutates_args=())
def unpermute_sections(x: torch.Tensor, sections: list[int], cp_size: int) -> torch.Tensor:
    """The inverse of :func:`permute_sections` (``sections`` are the global widths)."""
    return _unpermute(x, sections, cp_size, rank_blocks=False)


@unpermute_sections.register_fake
def _(x, sections, cp_size):
    _check(x, sections, cp_size)
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    _, ctx.sections, ctx.cp_size = inputs


def _permute_backward(ctx, grad):
    return unpermute_sections(grad, ctx.sections, ctx.cp_size), None, None


def _unpermute_backward(ctx, grad):
    return permute_sections(grad, ctx.sections, ctx.cp_size), None, None


def _to_blocks_backward(ctx, grad):
    return rank_blocks_to_sections(grad, ctx.sections, ctx.cp_size), None, None


def _from_blocks_backward(ctx, grad):
    return sections_to_rank_blocks(grad, ctx.sections, ctx.cp_size), None, None


permute_sections.register_autograd(_permute_backward, setup_context=_setup_context)
unpermute_sections.register_autograd(_unpermute_backward, setup_context=_setup_context)
sections_to_rank_blocks.register_autograd(_to_blocks_backward, setup_context=_setup_context)
rank_blocks_to_sections.register_autograd(_from_blocks_backward, setup_context=_setup_context)
