"""The package's import graph: no circle of modules, and none of rooms (a top-level module, or a
subpackage as a whole), so every import runs down the floors. Every import counts, at the top of
a module or inside a function. Single process, no torch."""

import ast
import re
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _imported_names(tree) -> set:
    """Every module name an import statement of tree names, with `from m import x` also as m.x
    (x may be a module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def package_graph() -> dict:
    """{module: the package's modules it imports}."""
    paths = {}
    for path in (ROOT / "parm_trainer").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        paths[name.removesuffix(".__init__")] = path
    return {name: {m for m in _imported_names(ast.parse(path.read_text()))
                   if m in paths and m != name}
            for name, path in paths.items()}


def test_every_import_of_the_package_names_a_module_that_is_there():
    """An import inside a function runs only when it is called: one left behind by a move
    would fail late, so each is checked here."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in (ROOT / "parm_trainer").rglob("*.py")}
    missing = []
    for path in sorted([*(ROOT / "parm_trainer").rglob("*.py"), *(ROOT / "tools").rglob("*.py"),
                        *ROOT.glob("*.py"), *(ROOT / "tests").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level
                     and node.module else [])
            missing += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                        if name.split(".")[0] == "parm_trainer" and name not in modules]
    assert not missing, "imports of modules that are not there:\n" + "\n".join(missing)


def room(module: str) -> str:
    """parm_trainer.moe.layer -> parm_trainer.moe; parm_trainer.parallel stays itself."""
    return ".".join(module.split(".")[:2])


def circle(graph: dict):
    """One cycle of graph as a list of nodes (first repeated last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def rooms_graph(graph: dict) -> dict:
    out = {}
    for module, imports in graph.items():
        out.setdefault(room(module), set()).update(room(m) for m in imports
                                                   if room(m) != room(module))
    return out


def test_no_module_imports_itself_through_others():
    found = circle(package_graph())
    assert found is None, "import circle: " + " -> ".join(found)


def test_no_import_runs_back_up_a_floor():
    """Rooms in a circle (moe/ -> models/ -> moe/) have no floor order: one of the imports
    runs up. The message names the modules of each step."""
    graph = package_graph()
    found = circle(rooms_graph(graph))
    steps = [f"{a} -> {b} ({', '.join(sorted(f'{m} -> {n}' for m in graph if room(m) == a for n in graph[m] if room(n) == b))})"
             for a, b in zip(found, found[1:])] if found else []
    assert found is None, "rooms in a circle: " + "; ".join(steps)


def test_the_checks_find_a_circle():
    """The detector itself, on made-up graphs: it must be able to fail."""
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    rooms = rooms_graph({"parm_trainer.moe.x": {"parm_trainer.models.y"},
                         "parm_trainer.models.y": {"parm_trainer.moe.z"},
                         "parm_trainer.moe.z": set()})
    assert circle(rooms) == ["parm_trainer.models", "parm_trainer.moe", "parm_trainer.models"]


def test_the_readme_names_files_that_are_there():
    """README's "Layout of the repository" (start-up, a training step, the tree): every file
    and folder it names exists, so a newcomer's read leads somewhere."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout of the repository"):]
    named = set(re.findall(r"[\w/]+\.py|[\w]+/(?=\s)", section))
    assert len(named) > 30
    where = [ROOT, ROOT / "parm_trainer", ROOT / "parm_trainer" / "moe",
             ROOT / "parm_trainer" / "training"]
    files = {p.name for p in (ROOT / "parm_trainer").rglob("*.py")}
    missing = [name for name in sorted(named) if not any((base / name).exists() for base in where)
               and not ("/" not in name and name in files)]  # a bare name: in its folder's row
    assert not missing, f"README names what is not there: {missing}"
