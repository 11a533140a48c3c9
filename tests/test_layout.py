"""The house's floors: bench -> services -> shared. Services touch only shared/, never each other."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_services_import_only_shared_and_themselves():
    services = sorted(p.name for p in (REPO / "services").iterdir() if (p / "__init__.py").exists())
    assert {"trainer", "evaluator", "exporter", "server", "dashboards"} <= set(services)
    crossings = []
    for service in services:
        for path in (REPO / "services" / service).rglob("*.py"):
            for module in imported_modules(path):
                parts = module.split(".")
                if parts[0] == "bench" or (parts[0] == "services" and len(parts) > 1 and parts[1] != service):
                    crossings.append(f"{path.relative_to(REPO)} imports {module}")
    assert not crossings, crossings


def test_shared_imports_no_service_or_benchmark():
    crossings = [f"{path.relative_to(REPO)} imports {module}"
                 for path in (REPO / "shared").rglob("*.py") for module in imported_modules(path)
                 if module.split(".")[0] in ("services", "bench")]
    assert not crossings, crossings


def test_every_benchmark_script_loads_and_defines_run():
    """`make bench` imports each bench/bench_*.py and calls its run(): a broken import fails the whole table."""
    import importlib

    scripts = sorted(p.stem for p in (REPO / "bench").glob("bench_*.py"))
    assert {"bench_rollout", "bench_eval"} <= set(scripts)
    for name in scripts:
        assert callable(importlib.import_module(f"bench.{name}").run), name
