"""torch.compile's caches keyed on the library's source (custom_ops.runtime.compile_cache)."""

import torch

import custom_ops  # noqa: F401  (importing it tags the caches)
from custom_ops.runtime.compile_cache import source_digest, tag_compile_caches


def _tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_importing_the_library_tags_the_compile_caches():
    tag = tag_compile_caches()
    assert tag.startswith("cp_ops-")
    assert tag in torch.compiler.config.cache_key_tag.split("+")


def test_a_tag_the_user_set_is_kept_and_ours_added_once():
    with torch.compiler.config.patch(cache_key_tag="mine"):
        tag = tag_compile_caches()
        tag_compile_caches()
        assert torch.compiler.config.cache_key_tag == f"mine+{tag}"


def test_the_digest_follows_the_code_and_configs_only(tmp_path):
    files = {"custom_ops/op.py": "def f(): return 1\n", "cp_ops/layer.py": "x = 1\n", "custom_ops/t.json": "{}"}
    root = _tree(tmp_path / "a", files)
    digest = source_digest(root)
    assert len(digest) == 16
    assert source_digest(_tree(tmp_path / "b", files)) == digest  # where it is installed does not count
    _tree(root, {"custom_ops/notes.txt": "not code", "other/op.py": "not ours"})
    assert source_digest(root) == digest
    for name, text in (("custom_ops/op.py", "def f(): return 2\n"), ("custom_ops/t.json", '{"a": 1}'),
                       ("cp_ops/new.py", "")):  # fmt: skip
        _tree(root, {name: text})
        assert source_digest(root) != digest, name
        digest = source_digest(root)
