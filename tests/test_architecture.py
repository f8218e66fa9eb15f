"""The package's shape: no import circles (imports inside functions count), a small root."""

from __future__ import annotations

import ast
import collections
import importlib
import io
import pkgutil
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tensorwire"
MAX_ROOT_MODULES = 14


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Modules of the package that `path` imports at run time (TYPE_CHECKING blocks left out)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            subs = {f"{base}.{alias.name}" for alias in node.names}
            found.update(subs & modules)
            if node.module or not subs <= modules:  # names taken from `base` itself
                found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, modules) for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_algorithms_and_tuning_share_a_leaf_vocabulary():
    """Algorithms write their costs in algorithms/prices.py's terms and tuning fills them in:
    the vocabulary imports nothing of the package, and no algorithm imports tuning."""
    graph = import_graph()
    assert graph["tensorwire.algorithms.prices"] == set()
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("tensorwire.algorithms")
                    for d in deps if d.startswith("tensorwire.tuning"))
    assert upward == []


def test_torch_backend_reaches_the_library_through_its_api() -> None:
    """The torch integration sits beside the API: it gets its runtimes and groups from it
    (api.init, api.join_on_demand, Group), never an engine, a wiring or a tuner of its own."""
    below = ("tensorwire.transport", "tensorwire.tuning", "tensorwire.algorithms")
    reached = sorted(f"{module} imports {dep}" for module, deps in import_graph().items()
                     if module.startswith("tensorwire.torch") for dep in deps if dep.startswith(below))
    assert reached == []


def test_segments_live_apart_from_the_channel_that_rings_through_them() -> None:
    """Making, mapping and removing /dev/shm segments (shm_segments) is apart from the channel
    whose rings are such segments (shm): the launcher's cleanup after a killed job, the /dev/shm
    budget and the one-shot segments need only the former."""
    graph = import_graph()
    assert not graph["tensorwire.transport.shm_segments"] & {"tensorwire.transport.shm",
                                                             "tensorwire.transport.channel"}
    users = ("tensorwire.tools.launcher", "tensorwire.transport.shm_budget", "tensorwire.transport.segment")
    assert [u for u in users if "tensorwire.transport.shm" in graph[u]] == []


def test_every_error_and_warning_is_in_errors_and_public() -> None:
    """One hierarchy in one module, every class of it importable from `tensorwire`: a program
    catches StoreLostError or CudaDriverError, or silences the unauthenticated job's warning
    through TensorwireWarning, without reaching into a submodule."""
    import tensorwire

    for found in pkgutil.walk_packages(tensorwire.__path__, "tensorwire."):
        if not found.name.startswith(("tensorwire.torch", "tensorwire.__main__")):
            importlib.import_module(found.name)

    def family(cls: type) -> list[type]:
        return [cls, *(c for sub in cls.__subclasses__() for c in family(sub))]

    ours = {c for base in (tensorwire.TensorwireError, Warning) for c in family(base)
            if c.__module__.startswith("tensorwire")}
    wrong = sorted(f"{c.__module__}.{c.__qualname__}" for c in ours
                   if c.__module__ != "tensorwire.errors" or getattr(tensorwire, c.__name__, None) is not c
                   or (issubclass(c, Warning) and not issubclass(c, tensorwire.TensorwireWarning)))
    assert wrong == []


def _imports_in_functions(path: Path) -> list[str]:
    """'line: module' of each import of the package inside a function of `path`."""
    found, ours = set(), PACKAGE.name
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and (sub.level or (sub.module or "").startswith(ours)):
                    found.add(f"{sub.lineno}: {'.' * sub.level}{sub.module or ''}")
                elif isinstance(sub, ast.Import) and any(a.name.startswith(ours) for a in sub.names):
                    found.add(f"{sub.lineno}: {', '.join(a.name for a in sub.names)}")
    return sorted(found)


def test_the_launcher_and_the_torch_backend_import_the_package_at_the_top() -> None:
    """Importing either loads the whole package already (through tensorwire/__init__): an import
    inside one of their functions dodges neither a circle nor any start-up time, and hides what
    the module needs. The torch backend learns whether tensorwire run started it from
    bootstrap.detect, as everything else does, not from variables it reads itself."""
    for module in ("tools/launcher.py", "torch/__init__.py"):
        assert _imports_in_functions(PACKAGE / module) == [], module
    assert "os.environ" not in (PACKAGE / "torch" / "__init__.py").read_text()


def test_small_package_root():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


LAB_NOTE = re.compile(r"\b20\d\d-\d\d-\d\d\b"                                   # a date
                      r"|\b[Ii]ssues? #?\d+"                                     # an issue number
                      r"|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")   # a commit hash


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    lines = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            lines.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(path.read_text())):  # docstrings, of attributes too
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            lines.extend((node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines()))
    return lines


def test_code_carries_no_lab_notes():
    """Dates, issue numbers and commit hashes belong to docs/design/ and commit messages; a
    comment or docstring says what and why (and may link the note)."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{n}: {text.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) for n, text in _comments_and_docstrings(path)
             if LAB_NOTE.search(text)]
    assert found == []


MEASUREMENT = re.compile(r"\b\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?x\b(?! ?[0-9a-f])"     # a ratio: 1.5x, 2-3x
                         r"|\b\d+(?:\.\d+)?[-–]\d+(?:\.\d+)?\s?%"                          # a range: 5-20%
                         r"|\ba (?:tenth|third|quarter) of (?:a|this|the) [\w' ]*(?:time|call|send)\b"
                         r"|\bused to\b|\b[Ff]itted to the\b[^.]*\bsweeps?\b")           # a story


def test_code_tells_no_measurement_stories():
    """What was measured, and what the code used to do, belong to docs/design/ (or the commit
    message); a comment or docstring says in a line or two what the code does and why."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{n}: {text.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) for n, text in _comments_and_docstrings(path)
             if MEASUREMENT.search(text)]
    assert found == []


def test_every_function_is_used_beyond_the_tests():
    """A module-level function or class that only tests call is dead code kept alive by its
    test: each is named somewhere else in the package (its C too), bench/, examples/ or scripts/."""
    root = PACKAGE.parents[1]
    texts = [p.read_text() for folder in (PACKAGE, root / "bench", root / "examples", root / "scripts")
             for p in folder.rglob("*") if p.suffix in (".py", ".c", ".h")]
    names = collections.Counter(w for text in texts for w in re.findall(r"[A-Za-z_]\w*", text))
    unused = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.name}"
              for path in sorted(PACKAGE.rglob("*.py")) for node in ast.parse(path.read_text()).body
              if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
              and names[node.name] <= 1]
    assert unused == []


def _classes() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Every class of the package by name: (module file, definition)."""
    found: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append((str(path.relative_to(PACKAGE)), node))
    return found


def _slots(node: ast.ClassDef) -> set[str] | None:
    for stmt in node.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(
            stmt, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets) and stmt.value is not None:
            value = ast.literal_eval(stmt.value)
            return {value} if isinstance(value, str) else set(value)
    return None


def _assigned(node: ast.ClassDef) -> set[str]:
    """Attributes the class's own methods set on `self`."""
    names: set[str] = set()
    for method in node.body:
        if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for sub in ast.walk(method):
            targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                sub, ast.AnnAssign | ast.AugAssign) else []
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store) \
                            and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def test_classes_with_slots_set_only_their_slots() -> None:
    """An instance of a class with __slots__ all the way up has no __dict__: setting anything
    else raises AttributeError, on whatever path first does it. Paths this machine cannot run
    (CUDA) meet that only on a GPU; this finds it everywhere."""
    classes = _classes()

    def allowed(node: ast.ClassDef, seen: frozenset[str] = frozenset()) -> set[str] | None:
        own = _slots(node)
        if own is None or "__dict__" in own:
            return None
        total = set(own)
        for base in node.bases:
            name = base.id if isinstance(base, ast.Name) else None
            if name == "object":
                continue
            defs = classes.get(name or "", [])
            if len(defs) != 1 or name in seen:
                return None  # from outside the package, or ambiguous: it may give a __dict__
            inherited = allowed(defs[0][1], seen | {name})  # type: ignore[operator]
            if inherited is None:
                return None
            total |= inherited
        return total

    wrong = []
    for name, defs in classes.items():
        for module, node in defs:
            slots = allowed(node)
            if slots is not None:
                extra = _assigned(node) - slots
                if extra:
                    wrong.append(f"{module}: {name} sets {sorted(extra)} outside its __slots__")
    assert not wrong, "\n".join(wrong)
