"""The package's two floors: the library never imports the tooling (bench/, evaluate/, cli/), and no module takes
part in an import cycle, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import tome_processors

PACKAGE = Path(tome_processors.__file__).parent
TOOLING = ("tome_processors.bench", "tome_processors.evaluate", "tome_processors.cli", "tome_processors.__main__")
#: What tooling may import inside a function: optional or heavy dependencies only.
#: Optional dependencies, and diffusers' pipeline modules whose helpers make one bench architecture's inputs as its
#: pipeline does (imported where that architecture is benched: the bench loads no pipeline until it needs one).
LAZY_ALLOWED = (
    "matplotlib",
    "tomesd",
    "skimage",
    "peft",
    "DeepCache",
    "diffusers.pipelines",
    "diffusers.modular_pipelines",
    "diffusers.AllegroPipeline",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(path: Path) -> list[tuple[str, bool]]:
    """`(imported module, inside a function)` for every import of `path`, `from x import y` as `x.y` and `x`."""
    module, is_package = _module_name(path), path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, nested) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                source = _resolve(module, is_package, child)
                found.append((source, nested))
                found.extend((f"{source}.{alias.name}", nested) for alias in child.names)
            visit(child, nested)

    visit(tree, False)
    return found


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _is_tooling(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TOOLING)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = {imported for imported, _ in _imports(path) if imported in MODULES and imported != name}
        # Importing a submodule from outside its package first runs the package's __init__.
        parents = {t.rsplit(".", 1)[0] for t in targets}
        graph[name] = targets | {p for p in parents if p in MODULES and not (name + ".").startswith(p + ".")}
    return graph


def test_the_library_never_imports_the_tooling():
    offenders = {
        name: sorted(t for t in targets if _is_tooling(t))
        for name, targets in _graph().items()
        if not _is_tooling(name) and any(_is_tooling(t) for t in targets)
    }
    assert offenders == {}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` as the modules along it (first module repeated at the end), or [] if none."""
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        for dependency in sorted(graph.get(module, ())):
            found = visit(dependency, (*path, module))
            if found:
                return found
        done.add(module)
        return []

    for module in sorted(graph):
        found = visit(module, ())
        if found:
            return found
    return []


def test_no_import_cycle_anywhere():
    assert " -> ".join(_cycle(_graph())) == ""


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_core_modules_sit_on_their_floor():
    # The attach path and the hooks sit below the processor and apply (they used to import them, lazily).
    graph = _graph()
    assert "tome_processors.apply" not in graph["tome_processors.attach"]
    assert "tome_processors.processor" not in graph["tome_processors.hooks"] | graph["tome_processors.attach"]
    assert not {t for t in graph["tome_processors.merge"] if t.startswith("tome_processors.")} - {
        "tome_processors._similarity"
    }
    for math_module in ("tome_processors.merge", "tome_processors._similarity"):  # pure tensor functions
        assert not [i for i, _ in _imports(MODULES[math_module]) if i.split(".")[0] in ("diffusers", "transformers")]


def test_tooling_imports_inside_functions_only_optional_dependencies():
    lazy = {
        name: sorted({imported for imported, nested in _imports(path) if nested})
        for name, path in MODULES.items()
        if _is_tooling(name)
    }
    offenders = {
        name: [i for i in imported if not i.startswith(LAZY_ALLOWED)] for name, imported in lazy.items() if imported
    }
    assert {name: bad for name, bad in offenders.items() if bad} == {}
    assert not [name for name, path in MODULES.items() if _is_tooling(name) and "PLC0415" in path.read_text()]


def test_the_graph_sees_imports_inside_functions(tmp_path):
    # The checks above rely on the AST walk finding function-level and relative imports.
    imported = _imports(PACKAGE / "bench" / "photos.py")
    assert ("skimage.data", True) in imported
    assert ("tome_processors.bench.engine.Method", False) in _imports(PACKAGE / "bench" / "quality.py")


def test_the_package_ships_typed_and_every_function_is_annotated():
    assert (PACKAGE / "py.typed").is_file()
    untyped = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            arguments = node.args
            every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
            bare = [a.arg for a in every if a.annotation is None and a.arg not in ("self", "cls")]
            if bare or node.returns is None:
                untyped.append(f"{name}.{node.name}{bare if bare else ''}{'' if node.returns else ' (return)'}")
    assert untyped == []
