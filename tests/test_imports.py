"""House rule (shared design): Prefect is imported only by flows/, tasks/ and the report's artifacts module."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = ("flows/", "tasks/", "evals/report_artifacts.py")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_prefect_is_imported_only_by_flows_tasks_and_the_artifacts_module():
    offenders = []
    for pkg in ("configs", "diloco", "evals", "models", "run", "flows", "tasks"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED):
                continue
            if any(m == "prefect" or m.startswith("prefect.") for m in imported_modules(path)):
                offenders.append(rel)
    assert offenders == []
