"""The layering of hetjax's core, read from the source with `ast` (nothing is imported):

    hetjax/errors.py                  errors                   (a leaf)
    hetjax/units.py                   numbers in human units   (a leaf)
    hetjax/hardware.py, catalogue.py, the hardware topology      (no JAX; `hetjax.topology`
      paper_presets.py, testbed_presets.py, topology.py            gathers them)
    hetjax/plan.py                    the Plan                 (topology and errors only)
    hetjax/planner/                   chooses and checks Plans (no JAX)
    hetjax/config.py                  reads configs            (calls the planner's rules)
    parallel/                         executes a Plan          (never the planner or config)

Every import counts, also those inside functions (a lazy import hides a circle, it does not
remove it); only `if TYPE_CHECKING:` blocks are skipped. The planner's jax-freedom is checked
for real, by importing it in a fresh interpreter.
"""

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("hetjax.planner", "parallel")  # whose __init__ runs before any of their modules


def _module_files() -> dict[str, str]:
    """Module name -> file, for the modules whose layering this test guards."""
    files = {"hetjax.plan": "hetjax/plan.py", "hetjax.config": "hetjax/config.py",
             "hetjax.errors": "hetjax/errors.py", "hetjax.units": "hetjax/units.py"}
    for name in ("topology", "hardware", "catalogue", "paper_presets", "testbed_presets"):
        files[f"hetjax.{name}"] = f"hetjax/{name}.py"
    for package in PACKAGES:
        folder = package.replace(".", "/")
        for name in os.listdir(os.path.join(REPO, folder)):
            if name.endswith(".py"):
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                files[module] = f"{folder}/{name}"
    return files


MODULES = _module_files()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(module, names) of every import statement: ('a.b', ()) for `import a.b`, ('a', ('b',
    'c')) for `from a import b, c`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from ((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, tuple(a.name for a in node.names)
        stack.extend(ast.iter_child_nodes(node))


def _imported_names(tree: ast.AST):
    """Every name an import statement names (for `from m import x`: m and m.x)."""
    for module, names in _imports(tree):
        yield module
        yield from (f"{module}.{n}" for n in names)


def imports_of(module: str) -> set[str]:
    """The guarded modules `module` imports: the modules it names, the package itself for
    `from package import name` of a name that is not a submodule (its __init__), and the
    __init__ of a guarded package it enters from outside (which Python runs first)."""
    with open(os.path.join(REPO, MODULES[module])) as f:
        tree = ast.parse(f.read())
    out = set()
    for name, names in _imports(tree):
        targets = [f"{name}.{n}" for n in names if f"{name}.{n}" in MODULES]
        if not names or len(targets) < len(names):
            targets.append(name)
        for target in targets:
            if target in MODULES:
                out.add(target)
            for package in PACKAGES:
                if target.startswith(package + ".") and not module.startswith(package):
                    out.add(package)
    out.discard(module)
    return out


def all_names(module: str) -> set[str]:
    with open(os.path.join(REPO, MODULES[module])) as f:
        return set(_imported_names(ast.parse(f.read())))


GRAPH = {m: imports_of(m) for m in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circles():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_the_units_are_a_leaf():
    assert {n.split(".")[0] for n in all_names("hetjax.units")} <= set(sys.stdlib_module_names)


def test_the_plan_is_a_leaf():
    """hetjax/plan.py: the standard library, numpy, the topology, the errors and the units
    only."""
    with open(os.path.join(REPO, MODULES["hetjax.plan"])) as f:
        tree = ast.parse(f.read())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    ours = {m for m in modules if m.split(".")[0] in ("hetjax", "parallel", "layers")}
    others = {m.split(".")[0] for m in modules - ours} - set(sys.stdlib_module_names)
    assert ours <= {"hetjax.topology", "hetjax.errors", "hetjax.units"}, ours
    assert others <= {"numpy"}, others


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("parallel")))
def test_parallel_never_imports_the_planner_or_the_config(module):
    upward = {n for n in all_names(module)
              if n.startswith(("hetjax.planner", "hetjax.config", "hetjax.train"))}
    assert not upward, f"{MODULES[module]} imports {sorted(upward)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES
                                          if not m.startswith(("parallel", "hetjax.config"))))
def test_planning_uses_only_the_jax_free_modules_of_parallel(module):
    """The planner may read parallel/'s jax-free modules (schedules, hlo), nothing else."""
    from_parallel = {n.split(".")[1] for n in all_names(module)
                     if n.startswith("parallel.")}
    assert from_parallel <= {"schedules", "hlo"}, f"{MODULES[module]}: {from_parallel}"


def test_importing_the_planner_and_the_config_does_not_start_jax():
    code = ("import sys, hetjax.planner, hetjax.config, hetjax.plan, hetjax.topology\n"
            "import parallel.schedules, parallel.hlo\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]", out
