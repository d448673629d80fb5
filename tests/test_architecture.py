"""The architecture as a test: layers without upward imports or circles, imports at the top, small files.

The layers (pyproject.toml, `[tool.importlinter]`), bottom to top: cluster.core (pure algorithm and
typed messages) < cluster.model (loading, runner, verifier engine) < drafts (proposers, policy, one
factory) < cluster.session (the loop) < cluster.wire (gRPC) < cluster.ray (actors, router, standalone
runtime) < cluster.vllm (the vLLM backend) < deployments (the Serve application, CLI) < tools (outside
the wheel). drafts.training is never imported on the serving path.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cluster", "deployments", "drafts", "tools", "protos")
RUNTIME = ("cluster", "deployments", "drafts")
MAX_LINES = 400
# vLLM is an optional heavy dependency: a module that needs it may be imported where it is used
IMPORTED_ON_USE = ("cluster.vllm", "deployments.vllm_serving", "deployments.vllm_app", "tools.bench_vllm", "vllm")


def _sources(packages=PACKAGES):
    for package in packages:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_import_contracts_hold():
    proc = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and proc.stdout.count("KEPT") >= 3


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circles():
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*PACKAGES, cache_dir=None, exclude_type_checking_imports=True)
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle():
    class Graph:  # a -> b -> c -> a, d alone
        modules = {"a", "b", "c", "d"}
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, m):
            return self.edges[m]

    assert _cycles(Graph()) == [["a", "b", "c"]]


def _local_project_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                module = node.module
            elif isinstance(node, ast.Import):
                module = node.names[0].name
            else:
                continue
            if module.split(".")[0] in PACKAGES and not module.startswith(IMPORTED_ON_USE):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {module}")
    return found


def test_project_modules_are_imported_at_the_top():
    found = [hit for path in _sources() for hit in _local_project_imports(path)]
    assert found == []


def test_files_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in _sources(RUNTIME) if (n := len(p.read_text().splitlines())) >= MAX_LINES}
    assert big == {}


def test_tools_stay_outside_the_wheel():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["cluster*", "deployments*", "drafts*", "protos*"]' in pyproject
    for path in _sources(RUNTIME):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert not node.module.startswith("tools"), f"{path}: imports {node.module}"


def test_a_router_replica_does_not_load_what_the_pools_run():
    """A router replica imports `deployments.router` (Serve loads a deployment by its module): with the pools'
    routers' side in `deployments.leases` it loads none of what the pool replicas run (the drafter's proposers,
    the torch model runner, the verifier ranks), about 3 CPU-seconds less for each router that starts."""
    heavy = ("deployments.pools", "cluster.ray.drafter", "drafts.factory", "cluster.model.runner",
             "cluster.model.packed")

    def loaded_by(module: str) -> str:
        code = f"import sys, {module}; print(sorted(set({heavy!r}) & set(sys.modules)))"
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split("\n")[-2]

    assert loaded_by("deployments.router") == "[]"
    assert loaded_by("deployments.pools") == repr(sorted(heavy))  # the same check sees the pools' replicas load them
