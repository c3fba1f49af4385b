"""The architecture's import rules (docs/contracts.md, "Module boundaries"), read from the source.

* each package imports only the packages listed for it in ``ALLOWED`` (no upward imports); in
  particular ``diloco/`` imports nothing of ours but itself: the learner loop gets its step as a
  function, never a model;
* Prefect only in ``flows/`` (with the engines' task runners, ``flows/engines.py``), ``tasks/`` and
  ``reports/artifacts.py``; no JAX or Flax in the packages that run before JAX starts or draw
  reports, nor in ``flows/engines.py`` and ``training/exchange_checks.py`` (the CLI uses them before
  JAX starts);
* no circular imports between modules, counting every import (module level, in a function, under
  ``TYPE_CHECKING``): a lazy import does not hide a circle.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {  # package -> the project packages it may import
    "configs": set(),
    "run": set(),
    "data": {"configs", "run"},
    "models": set(),
    "diloco": set(),
    "reports": {"configs", "run"},
    "sim": {"reports", "run"},
    "evals": {"configs", "models", "run"},  # the adapter decodes through models.text.generate
    "training": {"configs", "data", "diloco", "evals", "models", "run"},
    "tasks": {"configs", "data", "reports", "run", "sim", "training"},
    "flows": {"configs", "data", "models", "reports", "run", "sim", "tasks", "training"},
}
PREFECT_ALLOWED = ("flows/", "tasks/", "reports/artifacts.py")
NO_JAX = ("configs", "run", "data", "reports", "sim", "flows/engines.py", "training/exchange_checks.py")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _files():
    for pkg in ALLOWED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield pkg, path, path.relative_to(ROOT).as_posix()


def test_packages_import_only_what_the_architecture_allows():
    offenders = []
    for pkg, path, rel in _files():
        for m in _imports(path):
            top = m.split(".")[0]
            if top in ALLOWED and top != pkg and top not in ALLOWED[pkg]:
                offenders.append(f"{rel} imports {m}")
    assert offenders == []


def test_prefect_only_in_flows_tasks_and_the_report_artifacts_and_no_jax_before_it_starts():
    offenders = []
    for pkg, path, rel in _files():
        mods = {m.split(".")[0] for m in _imports(path)}
        if "prefect" in mods and not rel.startswith(PREFECT_ALLOWED):
            offenders.append(f"{rel} imports prefect")
        if (pkg in NO_JAX or rel in NO_JAX) and mods & {"jax", "flax", "optax", "orbax"}:
            offenders.append(f"{rel} imports {sorted(mods & {'jax', 'flax', 'optax', 'orbax'})}")
    assert offenders == []


def test_no_circular_imports_between_modules():
    modules = {}
    for _, path, rel in _files():
        name = rel[:-3].replace("/", ".")
        modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for m in _imports(path):
            # "a.b.c" may be module a.b.c or name c of module a.b: keep the longest known module
            while m and m not in modules:
                m = m.rpartition(".")[0]
            if m and m != name:
                deps.add(m)
        graph[name] = deps
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for dep in graph[node]:
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [node])
    assert cycles == []
