"""Every environment variable the library reads goes through custom_ops.env, and
docs/environment.md's table is that module's list."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from custom_ops import env

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "environment.md"
MODULE = ROOT / "custom_ops" / "env.py"
OS_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _table(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return "\n".join(lines) + "\n"


def test_the_doc_table_is_the_module_list():
    assert _table(DOC.read_text()) == env.markdown_table(), (
        "docs/environment.md's table differs from custom_ops.env.VARIABLES; regenerate it with "
        "custom_ops.env.markdown_table()"
    )


def _environment_uses(path: Path) -> list[str]:
    """``os.environ``, ``os.getenv`` and the like, by attribute or imported name, in a source file."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr in OS_NAMES:
            hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            names = [a.name for a in node.names if a.name in OS_NAMES]
            hits += [f"{path.relative_to(ROOT)}:{node.lineno}: from os import {n}" for n in names]
    return hits


def test_no_other_file_touches_the_environment():
    files = [p for top in ("custom_ops", "cp_ops", "examples") for p in sorted((ROOT / top).rglob("*.py"))]
    assert MODULE in files and _environment_uses(MODULE), "the check no longer sees custom_ops/env.py's reads"
    bad = [hit for p in files if p != MODULE for hit in _environment_uses(p)]
    assert not bad, "read and set environment variables through custom_ops.env:\n" + "\n".join(bad)


def test_every_variable_is_described():
    names = [v.name for v in env.VARIABLES]
    assert len(names) == len(set(names))
    for v in env.VARIABLES:
        assert v.effect and v.read, v.name
        assert v.default is None or v.values is None or v.default in v.values, v.name


@pytest.mark.parametrize("name", ["CP_OPS_CHECKS", "CP_OPS_OPAQUE_KERNELS", "CP_OPS_PRECOMPILE", "CP_OPS_FLA_CONFIGS"])
def test_switches_accept_0_and_1_only(name):
    assert env.parse(name, "0") == "0" and env.parse(name, "1") == "1"
    accepted = "0, eager or 1" if name == "CP_OPS_CHECKS" else "0 or 1"
    for bad in ("yes", "true", "", " 1"):
        with pytest.raises(ValueError, match=rf"{name} must be {accepted}, got {bad!r}"):
            env.parse(name, bad)


def test_accessors_read_the_environment_and_defaults(monkeypatch):
    for name in ("CP_OPS_CHECKS", "CP_OPS_OPAQUE_KERNELS", "CP_OPS_PRECOMPILE", "CP_OPS_FLA_CONFIGS",
                 "TRITON_INTERPRET", "TORCHINDUCTOR_COMPILE_THREADS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert (env.checks(), env.opaque_kernels(), env.precompile(), env.fla_configs()) == ("eager", None, True, True)
    assert not env.triton_interpret() and not env.inductor_compile_threads_set()
    monkeypatch.setenv("CP_OPS_CHECKS", "1")
    monkeypatch.setenv("CP_OPS_OPAQUE_KERNELS", "0")
    monkeypatch.setenv("CP_OPS_PRECOMPILE", "0")
    monkeypatch.setenv("CP_OPS_FLA_CONFIGS", "0")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    assert (env.checks(), env.opaque_kernels(), env.precompile(), env.fla_configs()) == (True, False, False, False)
    assert env.inductor_compile_threads_set()
    # what the library has always taken TRITON_INTERPRET to mean: 1 on, any other value off
    for value, on in (("1", True), ("0", False), ("true", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert env.triton_interpret() is on
    monkeypatch.setenv("CP_OPS_CHECKS", "yes")
    with pytest.raises(ValueError, match="CP_OPS_CHECKS"):
        env.checks()


def test_multicast_defaults_keep_a_value_already_set(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "")  # recorded, so that teardown restores it
    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    env.set_nvlink_multicast_off()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "0"


def test_host_threads_one_a_cuda_rank_unless_omp_is_set(monkeypatch):
    from cp_ops.local_ranks import host_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "")  # recorded, so that teardown restores it
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert host_threads("cuda", 4) == 1 and host_threads("cuda", 1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert host_threads("cuda", 4) is None  # left to OpenMP's own setting
    # the CPU shares the cores out whatever OMP_NUM_THREADS says
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert (host_threads("cpu", 4), host_threads("cpu", 32)) == (4, 1)
