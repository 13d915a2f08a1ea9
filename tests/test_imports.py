"""The layering of hetjax, read from the source with `ast` (nothing is imported). hetjax installs
one top-level package, `hetjax`; its model (`layers/`) and execution (`parallel/`) folders sit at
the repository's top level and are its subpackages `hetjax.layers` and `hetjax.parallel`. Every
module sits in one layer, stated by package where a package is a layer; a module imports only
its own layer and the layers below it, and no import circle exists anywhere:

    base        hetjax.errors, hetjax.units                       leaves
    core        hetjax.core: the hardware topology (hardware,    plain data and rules, no JAX
                catalogue, presets, topology), the Plan, the
                model's shape (model_config), the schedule
                registry (schedules), schedules lowered to ops
                (program), the executor registry (registry),
                collective byte formulas (hlo), codec names (wire),
                HF config.json <-> model fields (hf_config)
    services    distributed, checkpoint, tokenizer, data,         used by everything above;
                history, metrics, argv, linkcheck                  import no layout logic
    planner     hetjax.planner, hetjax.config, hetjax             chooses and checks Plans (no JAX)
    model       hetjax.layers (the Flax modules)
    execution   hetjax.parallel (the executors, mesh, ZeRO        turns a Plan into JAX programs
                kernels, bridge, NIC environment),
                hetjax.interop (HF checkpoints in and out),
                profile, measure
    training    hetjax/train.py, hooks, sampling, stopping
    entry       cli, launch (worker, supervise), testbed          nothing imports them from below

Every import counts, also those inside functions (a lazy import hides a circle, it does not
remove it); only `if TYPE_CHECKING:` blocks are skipped. Importing a module of a package from
outside it runs the package's `__init__` first, so that counts as importing the package too.
The planner's jax-freedom is checked for real, by importing it in a fresh interpreter.
"""

import ast
import fnmatch
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = "hetjax"  # layers/ and parallel/ are inside it (hetjax/layers, hetjax/parallel)

# Lowest first. A module's layer is the one of its most specific matching pattern (the longest);
# a new module whose name matches no pattern fails `test_every_module_has_a_layer`.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("hetjax.errors", "hetjax.units", "hetjax.files"),
    "core": ("hetjax.core", "hetjax.core.*"),
    "services": ("hetjax.distributed", "hetjax.checkpoint", "hetjax.tokenizer", "hetjax.data",
                 "hetjax.text_dataset", "hetjax.history", "hetjax.metrics", "hetjax.argv",
                 "hetjax.linkcheck", "hetjax.lock", "hetjax.corpus_size", "hetjax.noise"),
    "planner": ("hetjax", "hetjax.config", "hetjax.config.*", "hetjax.planner",
                "hetjax.planner.*"),
    "model": ("hetjax.layers", "hetjax.layers.*"),
    "execution": ("hetjax.parallel", "hetjax.parallel.*", "hetjax.interop", "hetjax.interop.*",
                  "hetjax.profile", "hetjax.measure"),
    "training": ("hetjax.train", "hetjax.hooks", "hetjax.sampling",
                 "hetjax.stopping"),
    "entry": ("hetjax.cli", "hetjax.__main__", "hetjax.launch", "hetjax.worker",
              "hetjax.supervise", "hetjax.testbed"),
}
RANK = {name: i for i, name in enumerate(LAYERS)}


def layer_of(module: str) -> str | None:
    best = None
    for layer, patterns in LAYERS.items():
        for pattern in patterns:
            if fnmatch.fnmatchcase(module, pattern) and (best is None or len(pattern) > best[0]):
                best = (len(pattern), layer)
    return best and best[1]


def _module_files() -> dict[str, str]:
    """Module name -> file, for every module of the hetjax package (its layers/ and parallel/
    subpackages are links to the top-level folders, so the walk follows links)."""
    files = {}
    for folder, dirs, names in os.walk(os.path.join(REPO, ROOT), followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        rel = os.path.relpath(folder, REPO)
        for name in names:
            if name.endswith(".py"):
                package = rel.replace(os.sep, ".")
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                files[module] = os.path.join(rel, name)
    return files


MODULES = _module_files()
PACKAGES = tuple(sorted(m for m, f in MODULES.items() if f.endswith("__init__.py")))


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
                if (target.startswith(package + ".")
                        and not (module == package or module.startswith(package + "."))):
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


def test_every_module_has_a_layer():
    assert len(MODULES) > 60 and {"hetjax.train", "hetjax.layers.model", "hetjax.parallel.mpmd"} <= set(MODULES)
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_every_folder_is_one_layer():
    """Folders are layers: every module of a subpackage (hetjax.core, hetjax.planner,
    hetjax.config, hetjax.layers, hetjax.parallel, hetjax.interop) sits in its package's layer.
    Only the top-level hetjax package, the user-facing one, holds modules of several layers."""
    mixed = sorted(f"{m} ({layer_of(m)}) in {p} ({layer_of(p)})" for p in PACKAGES if p != ROOT
                   for m in MODULES if m.startswith(p + ".") and layer_of(m) != layer_of(p))
    assert not mixed, "\n".join(mixed)


def test_the_folder_check_finds_a_module_outside_its_layer(monkeypatch):
    monkeypatch.setitem(LAYERS, "execution", LAYERS["execution"] + ("hetjax.core.toy",))
    monkeypatch.setitem(MODULES, "hetjax.core.toy", "hetjax/core/toy.py")
    with pytest.raises(AssertionError, match="hetjax.core.toy .execution. in hetjax.core .core."):
        test_every_folder_is_one_layer()


def test_the_layers_are_as_documented():
    """A few fixed points, so a pattern change cannot quietly move a module."""
    assert layer_of("hetjax.planner.cost") == "planner"
    assert layer_of("hetjax.core.schedules") == "core" and layer_of("hetjax.parallel.mpmd") == "execution"
    assert layer_of("hetjax.core.model_config") == "core" and layer_of("hetjax.layers.attention") == "model"
    assert layer_of("hetjax.cli") == "entry" and layer_of("hetjax.nonexistent") is None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({layer_of(m)}) -> {n} ({layer_of(n)})" for m in graph
                  for n in graph[m] if RANK[layer_of(n)] > RANK[layer_of(m)])


def test_the_upward_import_finder_finds_one():
    assert upward_imports({"hetjax.core.plan": {"hetjax.parallel.mpmd"}, "hetjax.parallel.mpmd": {"hetjax.core.plan"}}) \
        == ["hetjax.core.plan (core) -> hetjax.parallel.mpmd (execution)"]


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    assert not upward_imports(GRAPH), "\n".join(upward_imports(GRAPH))


def test_the_units_are_a_leaf():
    assert {n.split(".")[0] for n in all_names("hetjax.units")} <= set(sys.stdlib_module_names)


def test_the_plan_is_a_leaf():
    """hetjax/core/plan.py: the standard library, numpy, the topology, the errors, the units, the
    schedule registry and the executor registry's names only."""
    with open(os.path.join(REPO, MODULES["hetjax.core.plan"])) as f:
        tree = ast.parse(f.read())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    ours = {m for m in modules if m.split(".")[0] == "hetjax"}
    others = {m.split(".")[0] for m in modules - ours} - set(sys.stdlib_module_names)
    assert ours <= {"hetjax.core.topology", "hetjax.errors", "hetjax.units", "hetjax.core.registry",
                    "hetjax.core.schedules"}, ours
    assert others <= {"numpy"}, others


@pytest.mark.parametrize("module", sorted(m for m in MODULES
                                           if m.startswith(("hetjax.parallel", "hetjax.interop"))))
def test_parallel_never_imports_the_planner_or_the_config(module):
    """Below the Plan nothing reaches back into the planner or the raw config: the executors
    and the checkpoint interop take what they need as arguments."""
    upward = {n for n in all_names(module)
              if n.startswith(("hetjax.planner", "hetjax.config", "hetjax.train"))}
    assert not upward, f"{MODULES[module]} imports {sorted(upward)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m) == "planner"))
def test_planning_reads_the_core_not_the_model_or_the_executors(module):
    """The planner reads the JAX-free core (schedules, program, hlo, wire, the executor
    registry, the model's shape), never the Flax model or the executors."""
    below = {n for n in all_names(module)
             if n.startswith(("hetjax.parallel", "hetjax.layers"))}
    assert not below, f"{MODULES[module]}: {sorted(below)}"


def test_importing_the_planner_and_the_config_does_not_start_jax():
    below = sorted(m for m in MODULES if RANK[layer_of(m)] <= RANK["planner"]
                   and layer_of(m) != "services")
    code = (f"import sys, {', '.join(below)}\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]", out
