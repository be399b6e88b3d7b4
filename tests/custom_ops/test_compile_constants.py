"""Lookups torch.compile takes as constants (custom_ops.runtime.constants)."""

import warnings

import torch

from custom_ops.runtime.constants import compile_constant


def test_a_constant_runs_once_and_is_not_traced():
    """Dynamo runs the lookup (a graph break inside it would fail fullgraph=True if it were traced)
    and puts its result in the graph; every later call, eager or traced, takes the memoised one;
    no warning on the way (Dynamo warns at functools.cache wrappers)."""
    calls = []

    @compile_constant
    def lookup(name):
        calls.append(name)
        torch._dynamo.graph_break()
        return len(name)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(lambda x: x * lookup("abc"), fullgraph=True, backend="eager")(torch.ones(2))
    assert got.tolist() == [3.0, 3.0] and lookup("abc") == 3 and lookup("de") == 2
    assert calls == ["abc", "de"]
    assert not [w for w in caught if "cache" in str(w.message)], [str(w.message) for w in caught]
