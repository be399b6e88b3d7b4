"""torch.compile's caches keyed on this library's source (docs/design.md section 3).

Inductor's FX graph cache and AOTAutograd's cache key a compiled graph on the traced graph,
which names this library's ops but not their Python code: a backward graph cached by one
version of an op's autograd formula would be loaded by another (a renamed op fails; a changed
formula would run the old one silently). :func:`tag_compile_caches` adds a digest of the
library's source to ``torch.compiler.config.cache_key_tag``, which both caches hash, so a
changed library misses the entries of the old one; importing ``custom_ops`` calls it.
:func:`replace_tag` adds a setting that changes what a traced graph holds.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

__all__ = ["replace_tag", "source_digest", "tag_compile_caches"]

_PACKAGES = ("custom_ops", "cp_ops")
_SUFFIXES = (".py", ".json")  # the code and the tuned launch tables it reads


def source_digest(root: Path) -> str:
    """A digest of the library's files under ``root`` (the folder holding the packages):
    every ``.py`` and ``.json`` file of ``custom_ops`` and ``cp_ops``, by relative path and
    content."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.suffix in _SUFFIXES and path.is_file():
                digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _tag() -> str:
    return f"cp_ops-{source_digest(Path(__file__).resolve().parents[2])}"


def tag_compile_caches() -> str:
    """Add this library's tag to ``torch.compiler.config.cache_key_tag`` (kept after a tag the
    user set; added once). Returns the tag."""
    tag = _tag()
    current = torch.compiler.config.cache_key_tag
    if tag not in current.split("+"):
        torch.compiler.config.cache_key_tag = f"{current}+{tag}" if current else tag
    return tag


def replace_tag(prefix: str, tag: str) -> None:
    """Put ``tag`` in ``torch.compiler.config.cache_key_tag`` in place of any part that starts with
    ``prefix``: for a setting that changes what an op's traced graph holds (the GDN kernel
    backend), so that a graph cached under one value is not loaded under another."""
    parts = [p for p in torch.compiler.config.cache_key_tag.split("+") if p and not p.startswith(prefix)]
    torch.compiler.config.cache_key_tag = "+".join([*parts, tag])
