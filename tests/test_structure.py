"""The package's shape holds: no import cycle, imports point down the layers, no private name crosses a module, and
files, classes and functions stay short enough to read in one sitting (issue 36's limits)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "areno"
# Layers from the bottom up: a module may import its own layer and the ones below. A module named here sits in that
# layer whatever its package's layer (the serve protocol and errors are plain types the agent endpoint reuses).
LAYERS = [
    ["areno", "areno.config", "areno.kernels", "areno.platform"],  # "areno" is the package's __init__ alone
    ["areno.distributed.parallel", "areno.distributed.collectives"],
    ["areno.models", "areno.testing"],
    ["areno.engine", "areno.serve.protocol", "areno.serve.errors"],
    ["areno.training", "areno.distributed"],
    ["areno.rl"],
    ["areno.serve", "areno.quickstart", "areno.presets"],
    ["areno.api", "areno.platform.checks", "areno.platform.commands", "areno.platform.__main__"],
    ["areno.cli", "areno.train", "areno.__main__", "areno.distributed.worker"],
]
ALLOWED_UPWARD = {("areno", "areno.api")}  # the lazy SDK import in areno/__init__.py
LONG_FILES_OK = "areno/kernels/"  # a kernel file may hold several kernels of one family
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 600, 400, 80
KERNEL_DECORATORS = {"jit", "autotune", "heuristics", "builtin"}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def _resolve(name: str) -> str | None:
    """The areno module a dotted name refers to: itself, or the module that defines it."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path) -> set[str]:
    """Every areno module this one imports, at module level or inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.startswith("areno") else None
            if target and target != module:
                found.add(target)
    return found


GRAPH = {m: imports(m, p) for m, p in MODULES.items()}


def layer(module: str) -> int:
    best, rank = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or (name != "areno" and module.startswith(name + "."))) and len(name) > best:
                best, rank = len(name), i
    return rank if rank is not None else len(LAYERS)


def test_no_import_cycle():
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH.get(m, ())):
            if n in ("areno",):
                continue  # the package's own __init__ (the lazy SDK import) is not a dependency of its modules
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_point_down_the_layers():
    unplaced = [m for m in MODULES if layer(m) == len(LAYERS) and m != "areno"]
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"
    upward = sorted((m, n) for m, targets in GRAPH.items() for n in targets
                    if m != n and layer(n) > layer(m) and (m, n) not in ALLOWED_UPWARD)
    assert not upward, "imports that point up a layer:\n" + "\n".join(f"{m} -> {n}" for m, n in upward)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@pytest.mark.parametrize("folder", ["areno", "bench"])
def test_no_private_name_crosses_a_module(folder):
    crossings = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        module_aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("areno") or (
                    isinstance(node, ast.ImportFrom) and node.level):
                for a in node.names:
                    if _private(a.name):
                        crossings.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}")
                    elif f"{node.module}.{a.name}" in MODULES:
                        module_aliases.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                module_aliases |= {a.asname for a in node.names if a.name.startswith("areno") and a.asname}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in module_aliases and _private(node.attr)):
                crossings.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not crossings, "private names used across modules:\n" + "\n".join(crossings)


def _is_kernel(fn: ast.AST) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in KERNEL_DECORATORS:
            return True
    return False


def test_files_classes_and_functions_are_short():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        tree = ast.parse(text)
        kernels = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_kernel(n)]
        lines = len(text.splitlines())
        if lines > MAX_FILE and not (rel.startswith(LONG_FILES_OK) and len(kernels) >= 2):
            long.append(f"{rel}: {lines} lines")
        for node in ast.walk(tree):
            size = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
                long.append(f"{rel}:{node.lineno} class {node.name}: {size} lines")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION \
                    and not _is_kernel(node):
                long.append(f"{rel}:{node.lineno} {node.name}(): {size} lines")
    assert not long, "over the limits (file 600, class 400, function 80 lines):\n" + "\n".join(long)


def test_test_modules_outside_packages_have_unique_names():
    """pytest imports a test file outside a package by its basename: two of one name break collection on a fresh
    clone (no __pycache__ to hide it)."""
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if (path.parent / "__init__.py").exists():
            continue
        other = seen.setdefault(path.name, path)
        assert other == path, f"{path.relative_to(ROOT)} and {other.relative_to(ROOT)} share a module name"
