"""The repository's shape stays easy to change: small library files, settings passed rather than
patched, benchmarks that import the package as installed, no references outside the repository."""

from __future__ import annotations

import ast
import functools
import importlib
import json
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("custom_ops", "cp_ops")
MAX_LINES = 500


def _python_files(*tops: str) -> list[Path]:
    """Python files under ``tops`` (all top-level folders when empty), hidden folders left out."""
    roots = [ROOT / t for t in tops] if tops else [p for p in ROOT.iterdir() if p.is_dir()]
    files = []
    for root in roots:
        if root.name.startswith(".") or root.name.endswith(".egg-info") or not root.is_dir():
            continue
        files.extend(p for p in root.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts))
    return sorted(files)


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix() if p.is_relative_to(ROOT) else p.name


def test_library_files_are_at_most_500_lines():
    long = {_rel(p): n for p in _python_files(*LIBRARY) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"library files over {MAX_LINES} lines (split them by job): {long}"


def test_benchmarks_do_not_edit_sys_path():
    edits = [_rel(p) for p in _python_files("benchmarks") if re.search(r"\bsys\.path\s*(\.|\[|=|\+=)", p.read_text())]
    assert not edits, f"benchmarks import the package as installed, without sys.path edits: {edits}"


# --- nothing assigns another module's attributes --------------------------------------------------


def _library_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module (not a function or class) of the library packages."""
    parts = dotted.split(".")
    if parts[0] not in LIBRARY:
        return False
    path = ROOT.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module_aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound to library modules by the file's imports: name -> dotted module."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _library_module(a.name):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                dotted = f"{node.module}.{a.name}"
                if _library_module(dotted):
                    aliases[a.asname or a.name] = dotted
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            # m = sys.modules["custom_ops.x.op"] or importlib.import_module("custom_ops.x.op")
            value = node.value
            key = None
            if isinstance(value, ast.Subscript):
                key = value.slice
            elif isinstance(value, ast.Call) and value.args:
                key = value.args[0]
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and _library_module(key.value):
                aliases[node.targets[0].id] = key.value
    return aliases


def _dotted(expr: ast.AST, aliases: dict[str, str]) -> str | None:
    """The library module an expression such as ``m`` or ``custom_ops.x.kernels`` names, if any."""
    names = []
    while isinstance(expr, ast.Attribute):
        names.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in aliases:
        return None
    dotted = ".".join([aliases[expr.id], *reversed(names)])
    return dotted if _library_module(dotted) else None


def _outside_assignments(path: Path) -> list[str]:
    """``module.attr = ...``, ``setattr(module, ...)``, ``monkeypatch.setattr(module, ...)``,
    ``patch.object(module, ...)`` and ``patch("custom_ops....")`` on library modules in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = _module_aliases(tree)
    hits = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = []
            for t in targets:
                flat.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
            for t in flat:
                if isinstance(t, ast.Attribute) and (module := _dotted(t.value, aliases)):
                    hits.append(f"{_rel(path)}:{node.lineno}: {module}.{t.attr} assigned")
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if name in ("setattr", "object", "delattr") and (module := _dotted(first, aliases)):
                hits.append(f"{_rel(path)}:{node.lineno}: {name}({module}, ...)")
            elif name in ("setattr", "patch", "delattr") and isinstance(first, ast.Constant):
                if isinstance(first.value, str) and first.value.split(".")[0] in LIBRARY:
                    hits.append(f"{_rel(path)}:{node.lineno}: {name}({first.value!r}, ...)")
    return hits


def test_no_module_attribute_is_assigned_from_outside():
    """Kernel settings and test seams are arguments: no module of the library has its attributes
    assigned, set or patched by another file (library, tests, benchmarks, examples)."""
    hits = [h for p in _python_files() for h in _outside_assignments(p)]
    assert not hits, "pass settings or parameters instead of patching modules:\n" + "\n".join(hits)


def test_the_assignment_check_sees_each_form(tmp_path):
    src = (
        "import custom_ops.runtime.tiles as c\n"
        "from custom_ops.segment_attention import op as vop\n"
        "import cp_ops\n"
        "c.ROW_SETTINGS = {}\n"
        "vop.X, y = 1, 2\n"
        "cp_ops.layout.Y += 1\n"
        "setattr(c, 'Z', 1)\n"
        "def t(monkeypatch):\n"
        "    monkeypatch.setattr(vop, 'W', 1)\n"
        "    monkeypatch.setattr('custom_ops.runtime.tiles.V', 1)\n"
        "    mock.patch.object(c, 'U', 1)\n"
        "m = sys.modules['custom_ops.segment_attention.op']\n"
        "monkeypatch.setattr(m, '_has_window', 1)\n"
        "c.f(1)\n"
        "x = c.ROW_SETTINGS\n"
    )
    f = tmp_path / "probe.py"
    f.write_text(src)
    hits = _outside_assignments(f)
    assert len(hits) == 8, hits


# --- references ----------------------------------------------------------------------------------


OUTSIDE = re.compile(r"\.\./shared|/work/|\bSTYLE\.md|(?<![\w/])DESIGN\.md")


def test_nothing_refers_to_files_outside_the_repository():
    texts = _python_files() + sorted(ROOT.glob("*.md")) + sorted((ROOT / "docs").rglob("*.md"))
    texts += sorted((ROOT / "notebooks").glob("*.ipynb")) + [ROOT / "Makefile", ROOT / "pyproject.toml"]
    texts = [p for p in texts if p.is_file() and p != Path(__file__).resolve()]  # this file holds the pattern
    bad = [f"{_rel(p)}: {m.group()}" for p in texts for m in OUTSIDE.finditer(p.read_text())]
    assert not bad, f"references to files outside the repository: {bad}"


# --- the layout of the repository (docs/design.md section 6) ---------------------------------------


def _readme_layout() -> list[str]:
    design = (ROOT / "docs" / "design.md").read_text()
    section = design[design.index("## 6. Where the code lives") :]
    section = section[: section.index("\n## ", 1)]
    block = section[section.index("```") + 3 :]
    block = block[: block.index("```")]
    return [line.split()[0] for line in block.strip().splitlines() if line.strip()]


def test_readme_layout_names_existing_paths():
    missing = []
    for entry in _readme_layout():
        if "<" in entry:  # a pattern such as custom_ops/<op>/kernels.py: some folder has it
            pattern = re.sub(r"<[^>]+>", "*", entry)
            if not list(ROOT.glob(pattern.rstrip("/"))):
                missing.append(entry)
        elif not (ROOT / entry).exists():
            missing.append(entry)
    assert not missing, f"the layout in docs/design.md section 6 names paths the tree does not have: {missing}"


def test_readme_layout_names_every_library_module():
    entries = _readme_layout()
    patterns = [re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(e).replace(r"\<", "<").replace(r"\>", ">")))
                for e in entries if "<" in e]  # fmt: skip
    unnamed = []
    for p in _python_files(*LIBRARY):
        rel = _rel(p)
        if p.name == "__init__.py" or p.name == "__main__.py":
            continue
        folder = rel.rsplit("/", 1)[0] + "/"
        if rel in entries or folder in entries or any(pat.fullmatch(rel) for pat in patterns):
            continue
        unnamed.append(rel)
    assert not unnamed, f"library modules the layout in docs/design.md section 6 does not name (file or folder): {unnamed}"


def test_paths_the_docs_name_exist():
    """Every library, test, benchmark or example path README and docs/design.md name is in the tree."""
    path = re.compile(r"(?<![\w./-])((?:custom_ops|cp_ops|tests|benchmarks|examples|tools|notebooks)/[\w./<>-]*\w)")
    missing = []
    for doc in (ROOT / "README.md", ROOT / "docs" / "design.md"):
        for m in path.finditer(doc.read_text()):
            entry = m.group(1)
            pattern = re.sub(r"<[^>]+>", "*", entry)
            if not (ROOT / entry).exists() and not list(ROOT.glob(pattern)):
                missing.append(f"{_rel(doc)}: {entry}")
    assert not missing, f"paths the docs name that the tree does not have: {sorted(set(missing))}"


# the op layer's public surface: its package and these modules (custom_ops/__init__.py says so)
PUBLIC_OP_MODULES = {"custom_ops", "custom_ops.env", "custom_ops.testing"}


def test_layers_use_the_op_layer_through_its_public_api():
    """cp_ops and the examples import from custom_ops only its package and public modules, and
    custom_ops never imports cp_ops: registrations live in one layer."""
    bad = []
    for path in _python_files("cp_ops", "examples", "custom_ops"):
        below = _rel(path).startswith("custom_ops/")
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if below and top == "cp_ops":
                    bad.append(f"{_rel(path)}:{node.lineno}: custom_ops imports {module}")
                elif not below and top == "custom_ops" and module not in PUBLIC_OP_MODULES:
                    bad.append(f"{_rel(path)}:{node.lineno}: imports {module}")
    assert not bad, "imports past the op layer's public API:\n" + "\n".join(bad)


def test_ops_are_registered_through_one_helper():
    """Only custom_ops/runtime/registration.py calls torch.library's registration functions; every op
    registers through its kernel_op, opaque_op or composite_op."""
    registering = re.compile(
        r"torch\.library\.(custom_op|triton_op|define|impl|Library)\b|@(custom_op|triton_op)\(|^\s*(custom_op|triton_op)\(",
        re.M,
    )
    helper = ROOT / "custom_ops" / "runtime" / "registration.py"
    assert registering.search(helper.read_text()), "the registration helper no longer registers: update this test"
    files = _python_files(*LIBRARY, "examples")
    bad = [_rel(p) for p in files if p != helper and registering.search(p.read_text())]
    assert not bad, f"torch.library registrations outside custom_ops/runtime/registration.py: {bad}"


# --- imports without circles ------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The library modules ``path`` imports anywhere in it (function-local imports included: a
    local import hides a circle from the interpreter, not from the reader)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                dotted = f"{node.module}.{a.name}"
                found.add(dotted if _library_module(dotted) else node.module)
    return {m for m in found if _library_module(m)}


def _import_graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) - {_module_name(p)} for p in _python_files(*LIBRARY)}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module -> the modules it imports), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_library_imports_have_no_circle():
    """The modules of custom_ops and cp_ops import each other along a DAG: the runtime below the
    op families, the families below the package, the layers above it."""
    cycle = _cycle(_import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_circle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# --- one address for every public name ------------------------------------------------------------

ROOTS = ("custom_ops", "cp_ops")  # the package roots: the only modules that re-export names


@functools.cache
def _library_modules() -> dict[str, ModuleType]:
    """Every module of the library, imported (a package's submodules bound on it as the import
    system binds them)."""
    modules = {}
    for name in sorted(_module_name(p) for p in _python_files(*LIBRARY) if p.name != "__main__.py"):
        try:
            modules[name] = importlib.import_module(name)
        except ModuleNotFoundError as err:  # an integration whose optional library is not installed
            if (err.name or "").split(".")[0] in LIBRARY:
                raise
    return modules


def _top_level_names(tree: ast.Module) -> set[str]:
    """The names a module's own top-level statements define (def, class, assignment), imports aside."""
    found: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    found.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)

    visit(tree.body)
    return found


@functools.cache
def _definitions() -> dict[str, set[str]]:
    """module -> the names its own code defines."""
    return {_module_name(p): _top_level_names(ast.parse(p.read_text())) for p in _python_files(*LIBRARY)}


def _defining_modules(name: str, obj) -> list[str]:
    """The library modules whose own code defines ``name`` as ``obj`` (a module is its own)."""
    if isinstance(obj, ModuleType):
        return [obj.__name__]
    modules = _library_modules()
    return [m for m, names in _definitions().items() if name in names and getattr(modules.get(m), name, None) is obj]


def _import_paths() -> dict[str, set[str]]:
    """public name -> the modules that offer it other than its defining module: the roots whose
    ``__all__`` lists it and any module whose ``__all__`` lists it without defining it."""
    modules = _library_modules()
    public = {n for root in ROOTS for n in modules[root].__all__}
    paths: dict[str, set[str]] = {n: set() for n in public}
    for m, module in modules.items():
        for n in getattr(module, "__all__", ()):
            if n in paths and n not in _definitions().get(m, set()):
                paths[n].add(m)
    return paths


def test_every_public_name_is_defined_in_one_module_of_its_root():
    """Each name in the two roots' ``__all__`` is one object, defined by one module, of the
    package whose root exports it."""
    modules = _library_modules()
    bad = []
    for root in ROOTS:
        exported = modules[root].__all__
        assert len(exported) == len(set(exported)), f"{root}.__all__ names a name twice"
        for name in exported:
            definers = _defining_modules(name, getattr(modules[root], name))
            if len(definers) != 1 or definers[0].split(".")[0] != root:
                bad.append(f"{root}.{name}: defined in {definers or 'no module of the library'}")
    assert not bad, "public names need one defining module in their own package:\n" + "\n".join(bad)


def test_public_names_have_one_import_path():
    """Besides the module that defines it, a public name is offered by its package root alone: no
    facade module, no second root."""
    paths = _import_paths()
    several = {n: sorted(p) for n, p in paths.items() if len(p) != 1}
    print(f"public names: {len(paths)}; with more than one import path: {len(several)}")
    assert len(several) == 0, f"public names offered by several modules: {several}"


def test_no_module_but_the_roots_re_exports():
    """Outside the two roots, a module's ``__all__`` lists only what its own code defines, and no
    module is a facade of imports alone."""
    bad = []
    for p in _python_files(*LIBRARY):
        m = _module_name(p)
        if m in ROOTS:
            continue
        tree = ast.parse(p.read_text())
        listed = _all_names(tree)
        foreign = sorted(set(listed) - _definitions()[m])
        if foreign:
            bad.append(f"{_rel(p)}: __all__ lists {foreign}, defined elsewhere")
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        if body and all(isinstance(n, (ast.Import, ast.ImportFrom)) or _all_names_node(n) for n in body):
            bad.append(f"{_rel(p)}: a facade, of imports alone")
    assert not bad, "re-exports outside the package roots:\n" + "\n".join(bad)


def _all_names_node(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    )


def _all_names(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if _all_names_node(node) and isinstance(node.value, (ast.List, ast.Tuple)):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return []


def test_no_package_attribute_shadows_a_subpackage():
    """``custom_ops.<family>`` is the family's folder: no function of a package bears the name of
    one of its modules (``custom_ops.<family>.op`` then resolves)."""
    modules = _library_modules()
    bad = []
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent and getattr(modules[parent], child) is not module:
            bad.append(f"{name}: {parent}.{child} is {type(getattr(modules[parent], child)).__name__}")
    assert not bad, "package attributes that shadow a submodule:\n" + "\n".join(bad)


def _code_sources() -> list[tuple[str, str]]:
    """(where, source) of every piece of Python in the repository: its files, the notebooks'
    code cells and the python blocks of README and docs/."""
    sources = [(_rel(p), p.read_text()) for p in _python_files()]
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):  # its code cells as one script
        cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
        lines = [ln for c in cells for ln in "".join(c["source"]).splitlines() if not ln.startswith(("%", "!"))]
        sources.append((_rel(nb), "\n".join(lines)))
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)):
            sources.append((f"{_rel(doc)} block {i}", block))
    return sources


def _imports_off_address(where: str, source: str) -> list[str]:
    """The imports in ``source`` that take a library name from a module other than the one that
    defines it or the root that exports it, and the ``<root>.<name>`` uses of a name the root lacks."""
    modules = _library_modules()
    tree = ast.parse(source, filename=where)
    roots = {}
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in ROOTS:
                    roots[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
            for a in node.names:
                dotted = f"{node.module}.{a.name}"
                if a.name == "*" or dotted in modules:
                    continue
                owner = modules[node.module]
                if not hasattr(owner, a.name):
                    bad.append(f"{where}:{node.lineno}: {node.module} has no {a.name}")
                elif a.name not in _definitions()[node.module] and not (
                    node.module in ROOTS and a.name in owner.__all__
                ):
                    obj = getattr(owner, a.name)
                    definers = _defining_modules(a.name, obj)
                    if definers:  # a library name, not one a module imported from elsewhere
                        home = next((r for r in ROOTS if a.name in modules[r].__all__), definers[0])
                        bad.append(f"{where}:{node.lineno}: {a.name} from {node.module}, not {home}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in roots:
            root = roots[node.value.id]
            if not hasattr(modules[root], node.attr) and f"{root}.{node.attr}" not in modules:
                bad.append(f"{where}:{node.lineno}: {root}.{node.attr} does not exist")
    return bad


def test_every_import_uses_a_name_s_one_address():
    """Library, tests, benchmarks, examples, notebooks and the docs' code take each library name
    from the module that defines it or from the root that exports it."""
    bad = []
    for where, source in _code_sources():
        try:
            bad.extend(_imports_off_address(where, source))
        except SyntaxError:
            continue  # a docs block that is a fragment
    assert not bad, "imports past a name's address:\n" + "\n".join(bad)


def test_the_address_check_sees_each_form():
    src = (
        "import cp_ops\n"
        "from custom_ops.thd.validation import validate_thd\n"  # the defining module: fine
        "from custom_ops import validate_thd\n"  # the root: fine
        "from cp_ops.layout import padding_multiple\n"  # imported there, defined in custom_ops.thd.index
        "from custom_ops.thd.index import no_such_name\n"
        "cp_ops.validate_thd\n"  # custom_ops's, not cp_ops's
        "cp_ops.pack, cp_ops.layout\n"
    )
    bad = _imports_off_address("probe", src)
    assert len(bad) == 3, bad


# --- the library and its examples ------------------------------------------------------------------


def _example_modules() -> set[str]:
    """The top-level names examples/ provides when it is on the path: its scripts and packages."""
    return {p.stem for p in (ROOT / "examples").glob("*.py")} | {
        p.parent.name for p in (ROOT / "examples").glob("*/__init__.py")
    }


def _loads_of_examples(path: Path) -> list[str]:
    """Imports of an examples/ module in ``path``, and loads of a file or module under examples/
    by importlib or runpy."""
    examples = _example_modules()
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Call) and (getattr(node.func, "attr", None) or getattr(node.func, "id", "")) in (
            "import_module", "run_path", "run_module", "spec_from_file_location", "__import__"
        ):  # fmt: skip
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            names = [n.split(".")[0] if "examples" not in n else "examples" for n in names]
        else:
            continue
        hits += [f"{_rel(path)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in examples | {"examples"}]
    return hits


def test_the_library_never_imports_its_examples():
    """custom_ops and cp_ops run without examples/: no import of its modules, no load of its files
    (the demo that ``python -m cp_ops demo`` runs is cp_ops.demo)."""
    hits = [h for p in _python_files(*LIBRARY) for h in _loads_of_examples(p)]
    assert not hits, "the library loads examples/:\n" + "\n".join(hits)


def test_the_examples_check_sees_each_form(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text(
        "import train_qwen3_next\n"
        "from finetune_qwen3_next import main\n"
        "importlib.import_module('sft_qwen3_next_trainer')\n"
        "runpy.run_path('examples/train_qwen3_next.py')\n"
        "import cp_ops.demo\n"
    )
    assert len(_loads_of_examples(f)) == 4, _loads_of_examples(f)


def test_examples_import_only_public_names():
    """examples/ takes from the library only what a module lists in ``__all__`` (a root's public
    names, or those of a public module such as ``cp_ops.integrations.transformers``)."""
    modules = _library_modules()
    bad = []
    for path in _python_files("examples"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            if node.module.split(".")[0] not in LIBRARY:
                continue
            public = set(getattr(modules[node.module], "__all__", ()))
            for a in node.names:
                if f"{node.module}.{a.name}" not in modules and a.name not in public:
                    bad.append(f"{_rel(path)}:{node.lineno}: {a.name} from {node.module}")
    assert not bad, "examples import names outside the public API:\n" + "\n".join(bad)
