"""Lookups that ``torch.compile`` takes as constants: what a process cannot change while it runs
(an installed package's version, a device's compute capability), read while a graph is traced."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def compile_constant(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` memoised by its (hashable) arguments and run, not traced, by Dynamo, which puts its
    result in the graph as a constant: Dynamo refuses some lookups (importlib's on torch 2.11), and
    warns at every ``functools.cache`` wrapper it meets, so neither is used here."""
    results: dict[tuple, T] = {}

    @functools.wraps(fn)
    def lookup(*args):
        if args not in results:
            results[args] = fn(*args)
        return results[args]

    return torch.compiler.assume_constant_result(lookup)
