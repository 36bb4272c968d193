"""The README and docs/ name only things that exist.

Every dotted path ``areal_lite.x.y[.Name]`` they write must import (the module with importlib, the
rest as attributes of it), every ``from areal_lite.x import a, b`` line too; every file or folder
path under the repository's top folders (``areal_lite/``, ``examples/``, ``benchmarks/``,
``configs/``, ``tests/``, ``docs/``) must exist; every config key (``local_engine.cores``, an inline code span of its own or a
``key=value`` override in a command) must be a field of the experiment config's schema; every
``make TARGET`` must be a target of the Makefile; every relative Markdown link must reach its file and heading; and every section that the
docs or the code cite by name (``docs/performance.md, "On a GPU"``) must be a heading of that doc.
The README stays short: at most 200 lines, none over 300 characters, ``make demo`` and ``make
test`` its first commands. Nothing here builds a model: modules are imported, not run.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import typing
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where the code cites doc sections by name (docstrings, comments, the Makefile's notes).
CITING = [
    ROOT / "Makefile",
    *sorted(p for d in ("areal_lite", "examples", "benchmarks") for p in (ROOT / d).rglob("*.py")),
]

DOTTED = re.compile(r"(?<![\w.])areal_lite(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(
    r"^[ \t]*from[ \t]+(areal_lite(?:\.\w+)*)[ \t]+import[ \t]+(?:\(([\w\s,]+)\)|([\w ,]+))", re.MULTILINE
)
FILE_PATH = re.compile(r"(?<![\w./$-])((?:areal_lite|examples|benchmarks|configs|tests|docs)/[\w./-]*[\w/])")
MAKE = re.compile(r"(?<![\w-])make\s+([a-z][a-z0-9-]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITED_SECTION = re.compile(r"([\w./-]+\.md)(?:#[\w-]*)?\)?,\s*\"([^\"]+)\"")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.DOTALL)


INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCED = re.compile(r"```.*?```", re.DOTALL)
OVERRIDE = re.compile(r"(?<![\w./-])([a-z_]+(?:\.[a-z_][a-z0-9_]*)+)=")
KEY = re.compile(r"([a-z_]+(?:\.[a-z_][a-z0-9_]*)+)(?:=\S*)?")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_of(text: str) -> str:
    """The fenced blocks and inline code spans of a Markdown text, one per line."""
    return "\n".join(m.group(0).strip("`") for m in CODE.finditer(text))


@cache
def makefile_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.MULTILINE))


def _slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


@cache
def headings(doc: Path) -> tuple[str, ...]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
    return tuple(m.group(1).strip().replace("`", "") for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.MULTILINE))


@cache
def sections(doc: Path) -> tuple[str, ...]:
    """What a citation may name: the headings, and the bold labels that open list items."""
    labels = re.findall(r"^\s*[-*]\s+\*\*(.+?)\*\*", doc.read_text(), re.MULTILINE)
    return headings(doc) + tuple(label.replace("`", "") for label in labels)


@cache
def slugs(doc: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(doc):
        s = _slug(h)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return frozenset(out)


def _defined_names(path: Path) -> set[str]:
    """Top-level names a module file defines or imports (for modules that need an absent extra)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@cache
def resolve(dotted: str) -> str | None:
    """None when ``dotted`` names a module, or an attribute path of one; else why not."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        file = ROOT.joinpath(*parts[:n])
        if not (file.with_suffix(".py").exists() or (file / "__init__.py").exists()):
            continue
        rest = parts[n:]
        try:
            obj: object = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("areal_lite"):
                # An optional extra is absent here: read the names the file defines instead.
                path = file.with_suffix(".py") if file.with_suffix(".py").exists() else file / "__init__.py"
                if not rest or rest[0] in _defined_names(path):
                    return None
                return f"{name} defines no {rest[0]}"
            return f"{name} does not import: {e}"
        for i, attr in enumerate(rest):
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[: n + i])} has no attribute {attr}"
            obj = getattr(obj, attr)
        return None
    return "no such module"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_dotted_paths_import(doc: Path) -> None:
    text = doc.read_text()
    named = set(DOTTED.findall(text))
    for module, in_parens, on_line in FROM_IMPORT.findall(code_of(text)):
        names = in_parens or on_line
        named |= {f"{module}.{n.strip()}" for n in names.split(",") if n.strip()}
    broken = sorted(f"{d}: {why}" for d in named if (why := resolve(d)) is not None)
    assert not broken, f"{rel(doc)} names what does not import:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_file_paths_exist(doc: Path) -> None:
    paths = set(FILE_PATH.findall(doc.read_text()))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{rel(doc)} names paths that do not exist:\n" + "\n".join(missing)


@cache
def experiment_config() -> type:
    """`RLExperimentConfig`, the schema a run's keys are checked against, from whichever module of
    `areal_lite.api` defines it."""
    for path in sorted((ROOT / "areal_lite" / "api").glob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.ClassDef) and n.name == "RLExperimentConfig" for n in tree.body):
            return importlib.import_module(f"areal_lite.api.{path.stem}").RLExperimentConfig
    raise AssertionError("no module of areal_lite.api defines RLExperimentConfig")


def config_keys(text: str) -> set[str]:
    """Dotted keys under a section of the experiment config: inline code spans that are only a key
    (or ``key=value``), and ``key=value`` overrides in fenced blocks."""
    roots = {f.name for f in dataclasses.fields(experiment_config())}
    spans = [m.group(1) for m in (KEY.fullmatch(c) for c in INLINE.findall(FENCED.sub("", text))) if m]
    overrides = [k for block in FENCED.findall(text) for k in OVERRIDE.findall(block)]
    keys = {k for k in spans + overrides if k.split(".")[0] in roots}
    # `rollout.py`, `launcher.local`: files and modules, not keys
    return {k for k in keys if k.rsplit(".", 1)[-1] not in ("py", "md", "yaml") and resolve(f"areal_lite.{k}")}


def config_key_error(key: str) -> str | None:
    cls: object = experiment_config()
    parts = key.split(".")
    for i, name in enumerate(parts):
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if name not in hints:
            return f"{'.'.join(parts[:i])} has no field {name}"
        cls = hints[name]
    return None


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_config_keys_are_fields(doc: Path) -> None:
    broken = sorted(f"{k}: {why}" for k in config_keys(doc.read_text()) if (why := config_key_error(k)))
    assert not broken, f"{rel(doc)} names config keys the schema lacks:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_make_targets_exist(doc: Path) -> None:
    named = set(MAKE.findall(code_of(doc.read_text())))
    missing = sorted(named - makefile_targets())
    assert not missing, f"{rel(doc)} names make targets the Makefile lacks: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_links_reach_their_file_and_heading(doc: Path) -> None:
    broken = []
    for target in LINK.findall(CODE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in slugs(path):
            broken.append(f"{target}: no such heading in {rel(path)}")
    assert not broken, f"{rel(doc)} has broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("source", DOCS + CITING, ids=rel)
def test_cited_sections_exist(source: Path) -> None:
    """``docs/X.md, "Section"`` (a prefix, any case) names a heading or a list item's bold label there."""
    text = source.read_text()
    if source.suffix != ".md":
        text = re.sub(r"\n\s*#\s*", " ", text)  # a citation that runs on in the next comment line
    broken = []
    for file, section in CITED_SECTION.findall(text):
        doc = ROOT / "docs" / Path(file).name if Path(file).name != "README.md" else ROOT / "README.md"
        if not doc.exists():
            broken.append(f"{file}: no such doc")
            continue
        wanted = " ".join(section.replace("`", "").split()).lower()
        if not any(h.lower().startswith(wanted) for h in sections(doc)):
            broken.append(f'{file}, "{section}": no such heading')
    assert not broken, f"{rel(source)} cites sections that do not exist:\n" + "\n".join(broken)


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; at most 200 (history goes in commit messages)"
    long = [f"line {i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > 300]
    assert not long, "README.md lines over 300 characters:\n" + "\n".join(long)


def test_readme_starts_with_the_two_set_up_commands() -> None:
    commands = MAKE.findall(code_of((ROOT / "README.md").read_text()))
    assert commands[:2] == ["demo", "test"], f"the README's first commands are make {commands[:2]}"
