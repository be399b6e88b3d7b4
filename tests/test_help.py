"""help() of every public name of custom_ops and cp_ops shows that object's own contract, not
a generic text (an op registered through torch.library is an instance of torch's CustomOpDef,
whose class docstring help() would otherwise show)."""

from __future__ import annotations

import inspect
import pydoc

import pytest
import torch

import cp_ops
import custom_ops

PUBLIC = [(pkg, name) for pkg in (custom_ops, cp_ops) for name in pkg.__all__]


def _words(text: str) -> str:
    return " ".join(text.split())


def _documentable(obj) -> bool:
    """Whether ``obj`` can carry a docstring of its own (data such as a str or dict cannot)."""
    return callable(obj) or inspect.ismodule(obj)


@pytest.mark.parametrize(("pkg", "name"), PUBLIC, ids=[f"{p.__name__}.{n}" for p, n in PUBLIC])
def test_help_shows_the_objects_own_docstring(pkg, name):
    obj = getattr(pkg, name)
    if not _documentable(obj):  # data: the package's docstring says what it is
        assert f"``{name}``" in pkg.__doc__, f"{pkg.__name__}'s docstring does not describe {name}"
        return
    doc = obj.__doc__
    assert doc and doc.strip(), f"{pkg.__name__}.{name} has no docstring"
    if not inspect.isclass(obj):
        assert doc is not type(obj).__doc__, f"{pkg.__name__}.{name} shows its class's docstring, not its own"
    # line by line: a module's page shows its first line apart, as the synopsis
    shown = _words(pydoc.render_doc(obj, renderer=pydoc.plaintext))
    missing = [line for line in inspect.cleandoc(doc).splitlines() if _words(line) not in shown]
    assert not missing, f"help({pkg.__name__}.{name}) does not show these lines of its docstring: {missing}"


def test_an_op_shows_its_signature_and_contract():
    text = pydoc.render_doc(custom_ops.thd_seq_to_rank_order, renderer=pydoc.plaintext)
    assert "thd_seq_to_rank_order(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor" in text
    assert "CP rank order" in text and "Differentiable" in text
    assert "CustomOpDef is a wrapper" not in text


LAYERS = [getattr(cp_ops, name) for name in cp_ops.__all__ if inspect.isclass(getattr(cp_ops, name))
          and issubclass(getattr(cp_ops, name), torch.nn.Module)]  # fmt: skip


@pytest.mark.parametrize("layer", LAYERS, ids=lambda c: c.__name__)
def test_a_layer_shows_its_own_constructor_and_no_internal_method(layer):
    assert layer.__init__.__doc__ is not torch.nn.Module.__init__.__doc__, f"{layer.__name__}.__init__ has no docstring"
    text = _words(pydoc.render_doc(layer, renderer=pydoc.plaintext))
    assert _words(inspect.cleandoc(layer.__init__.__doc__).splitlines()[0]) in text
    public = {name for name, value in vars(layer).items() if callable(value) and not name.startswith("_")}
    assert public <= {"forward", "extra_repr"}, f"{layer.__name__}'s helpers are internal: {sorted(public)}"
