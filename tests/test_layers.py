"""The package's layering, read from its source: every import of one areal_lite module by another
(at the top, inside functions, or for type checking only) points down the layers, and no modules
import each other in a circle.

Layers, bottom to top (a package may import its own modules and those of lower layers):

    api  <  algorithms, utils, cpu, openai_format  <  rewards, engines  <  core  <  workflows, actors
         <  kit, launcher  <  recipes  <  service

Examples, tests and benchmarks sit above all of them.

Inside `engines`, one room per system, and the rooms stay apart: the train engines
(`engines.train`), the embedded engine (`engines.local`) and the clients of remote servers
(`engines.remote`) import no other room; our HTTP server (`engines.server`) serves the embedded
engine and speaks the vLLM worker's RPC vocabulary (`engines.remote.vllm_worker`), and imports
nothing else of another room (never a train engine).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "areal_lite"

LAYERS = {
    "api": 0,
    "algorithms": 1,
    "utils": 1,
    "cpu": 1,
    "openai_format": 1,
    "rewards": 2,
    "engines": 2,
    "core": 3,
    "workflows": 4,
    "actors": 4,
    "kit": 5,
    "launcher": 5,
    "recipes": 6,
    "service": 7,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The areal_lite modules ``path`` imports, wherever the import statement is."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("areal_lite.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("areal_lite."):
            found.add(node.module)
            # `from areal_lite.core import controller` imports a submodule
            found |= {f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")}
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> tuple[str, int]:
    top = module.split(".")[1] if module.count(".") else ""
    if top not in LAYERS:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS (and to the docstring)")
    return top, LAYERS[top]


def test_every_import_points_down_the_layers() -> None:
    upward = []
    for module, imported in graph().items():
        if module == "areal_lite":
            assert not imported, "the package's __init__ imports nothing (importing areal_lite stays cheap)"
            continue
        package, level = layer_of(module)
        for target in imported:
            target_package, target_level = layer_of(target)
            if target_package != package and target_level >= level:
                upward.append(
                    f"{module} ({package}, layer {level}) imports {target} ({target_package}, layer {target_level})"
                )
    assert not upward, "imports that point up or across the layers:\n" + "\n".join(sorted(upward))


def test_no_import_circles() -> None:
    edges = graph()
    # A package's __init__ re-exports its modules; an import of the package means one of them, and
    # counting the __init__ as importing them all would report every such package as a circle.
    edges = {m: {t for t in targets if t in edges and t != m} for m, targets in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                circles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    real = [c for c in circles if not _through_init(c)]
    assert not real, "import circles:\n" + "\n".join(" -> ".join(c) for c in real)


def _through_init(circle: list[str]) -> bool:
    """A circle that only closes through a package's own __init__ (``pkg/__init__`` imports
    ``pkg.a``, ``pkg.a`` imports ``pkg.b``, which imports ``pkg``) is Python's usual re-export."""
    return any(b.startswith(a + ".") for a, b in itertools.pairwise(circle))


ROOMS = ("train", "local", "server", "remote")
ALLOWED_ACROSS_ROOMS = {
    "server": {"areal_lite.engines.local", "areal_lite.engines.remote.vllm_worker"},
}
"""What a room may import from another room (a module, or every module of a room)."""


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "engines" and parts[2] in ROOMS else None


def test_engine_rooms_stay_apart() -> None:
    crossing = []
    for module, imported in graph().items():
        room = room_of(module)
        if module.startswith("areal_lite.engines") and module != "areal_lite.engines":
            assert room is not None, f"{module} is in no room of engines/: put it in one of {ROOMS}"
        if room is None:
            continue
        for target in imported:
            other = room_of(target)
            if other is None or other == room:
                continue
            allowed = ALLOWED_ACROSS_ROOMS.get(room, set())
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                crossing.append(f"{module} ({room}) imports {target} ({other})")
    assert not crossing, "imports across the engines' rooms:\n" + "\n".join(sorted(crossing))


def test_rooms_hold_no_two_files_of_one_name() -> None:
    """Two modules with one name in two rooms (the engines' rooms and the shared helpers) are a sign
    that one of them is in the wrong place."""
    seen: dict[str, Path] = {}
    clashes = []
    places = ("engines", "utils", "cpu", "openai_format")
    for path in sorted(p for place in places for p in (PACKAGE / place).rglob("*.py")):
        if path.name in {"__init__.py", "__main__.py"}:
            continue
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(PACKAGE)} and {path.relative_to(PACKAGE)}")
        seen[path.name] = path
    assert not clashes, "modules of one name in two places:\n" + "\n".join(clashes)
