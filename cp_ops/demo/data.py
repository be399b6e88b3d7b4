"""The demo's data: packed random token sequences of mixed lengths in the THD layout.

A batch is B sequences of real lengths ``seqlens`` (zero-length and one-token ones
allowed), padded with :func:`cp_ops.pad_cu_seqlens` so that every padded length is a
multiple of 2W, and packed along dim 0. Every rank builds the same global batch from
the same seed and keeps its shard (:func:`cp_ops.shard_thd`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import cp_ops
import custom_ops
from cp_ops.demo.model import IGNORE_INDEX

__all__ = ["make_batch", "random_seqlens", "num_targets", "Batches", "shard"]


def make_batch(seqlens: Sequence[int], cp_size: int, vocab: int, seed: int):
    """One global THD batch of random tokens: ``(tokens [T], labels [T], cu_seqlens, cu_seqlens_padded)``.

    Padded for ``cp_size`` (every padded length a multiple of 2W); padding rows carry
    token 0. labels[t] = tokens[t+1] for every real token followed by a real token of
    its sequence, else ``IGNORE_INDEX``. The real tokens depend on the seed and the
    lengths only, not on ``cp_size``, so runs with different CP sizes see the same data.
    Built on the host (data preparation); the same on every rank for the same seed.
    """
    cu, cup = cp_ops.pad_cu_seqlens(seqlens, cp_size)
    num_rows = int(cup[-1])
    custom_ops.validate_thd(cu, cup, cp_size, num_rows)
    gen = torch.Generator().manual_seed(seed)
    real_tokens = torch.randint(vocab, (int(cu[-1]),), generator=gen)
    tokens = torch.zeros(num_rows, dtype=torch.int64)
    labels = torch.full((num_rows,), IGNORE_INDEX, dtype=torch.int64)
    for start, real_start, length in zip(cup[:-1].tolist(), cu[:-1].tolist(), seqlens):
        seq = real_tokens[real_start : real_start + length]
        tokens[start : start + length] = seq
        if length > 1:
            labels[start : start + length - 1] = seq[1:]
    return tokens, labels, cu, cup


def random_seqlens(num_seqs: int, max_len: int, seed: int) -> list[int]:
    """``num_seqs`` lengths: 0 and 1 first (the edge cases), the rest uniform in ``[0, max_len]``."""
    gen = torch.Generator().manual_seed(seed)
    return [0, 1] + torch.randint(0, max_len + 1, (num_seqs - 2,), generator=gen).tolist()


def num_targets(seqlens: Sequence[int]) -> int:
    """The batch's targets: every real token that has a next real token in its sequence."""
    return sum(max(n - 1, 0) for n in seqlens)


class Batches:
    """The global batch of each step on ``device``: the same one every step (``fresh=False``,
    the loss falls as it is memorised) or new random tokens of the same lengths each step.

    ``batches(step)`` returns ``(tokens, labels, cu_seqlens, cu_seqlens_padded)``, padded
    for ``cp_size``; only the latest batch is kept.
    """

    def __init__(self, seqlens: Sequence[int], cp_size: int, vocab: int, seed: int, fresh: bool, device):
        self.seqlens, self.cp_size, self.vocab, self.seed = list(seqlens), cp_size, vocab, seed
        self.fresh, self.device = fresh, device
        self._key, self._batch = None, None

    def __call__(self, step: int):
        key = step if self.fresh else 0
        if key != self._key:
            self._batch = None
            batch = make_batch(self.seqlens, self.cp_size, self.vocab, self.seed * 1000 + key)
            self._key, self._batch = key, tuple(t.to(self.device) for t in batch)
        return self._batch


def shard(tokens: torch.Tensor, labels: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, rank: int):
    """This rank's rows of the tokens and labels (:func:`cp_ops.shard_thd`); the whole batch at W = 1."""
    if cp_size == 1:
        return tokens, labels
    return tuple(cp_ops.shard_thd(t, cu_seqlens_padded, cp_size, rank) for t in (tokens, labels))
