"""Dependencies point api -> service -> core; the core imports no framework, clock or I/O."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "gateway"
FORBIDDEN_IN_CORE = {
    "asyncio",
    "httpx",
    "fastapi",
    "starlette",
    "uvicorn",
    "torch",
    "vllm",
    "zmq",
    "redis",
    "aiohttp",
    "time",
    "datetime",
    "random",
    "socket",
    "subprocess",
    "threading",
    "os",
    "gateway.service",
    "gateway.api",
    "gateway.config",
    "pydantic",
}


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def violations(folder: str, banned: set[str]) -> list[str]:
    bad = []
    for f in (ROOT / folder).rglob("*.py"):
        for mod in imports(f):
            if any(mod == b or mod.startswith(b + ".") for b in banned):
                bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    return bad


def test_core_is_pure() -> None:
    assert violations("core", FORBIDDEN_IN_CORE) == []


def test_service_does_not_import_api() -> None:
    assert violations("service", {"gateway.api", "fastapi", "starlette"}) == []


#: What gateway/api/errors.py holds for the edge alone: the HTTP error, its bodies, the mapping.
HTTP_ERROR_NAMES = {
    "ApiError",
    "error_body",
    "anthropic_error_body",
    "anthropic_error_type",
    "reshape_upstream_error",
    "to_api_error",
    "SERVICE_ERRORS",
}


def imported_names(path: Path) -> set[str]:
    """The names ``path`` imports with ``from ... import``, each also as ``module.name``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out |= {a.name for a in node.names} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_http_errors_are_the_edges_own() -> None:
    """A status code and an error body are chosen in gateway/api only: below it (wire, analysis,
    service, core...) an error is a domain error of gateway/errors.py; no module outside
    gateway/api imports gateway/api/errors.py, ``ApiError`` or a helper that shapes an error body."""
    bad = [v for v in violations(".", {"gateway.api.errors"}) if not v.startswith("api/")]
    for f in ROOT.rglob("*.py"):
        if not f.is_relative_to(ROOT / "api"):
            names = imported_names(f) & (HTTP_ERROR_NAMES | {"gateway.api.errors"})
            bad += [f"{f.relative_to(ROOT)} imports {n}" for n in sorted(names)]
    assert bad == []


def test_the_domain_errors_know_no_http() -> None:
    """gateway/errors.py, which every layer imports, holds domain errors only: it imports nothing
    (no JSON library for bodies, no web framework), names no status and holds no status code."""
    path = ROOT / "errors.py"
    tree = ast.parse(path.read_text())
    assert imports(path) <= {"__future__"}, imports(path)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    assert [n for n in names if "status" in n.lower() or "http" in n.lower()] == []
    codes = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and type(n.value) is int and 100 <= n.value <= 599
    ]
    assert codes == []
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert classes and all(
        c.name == "DomainError" or [ast.unparse(b) for b in c.bases] == ["DomainError"] for c in classes
    )


def test_no_module_level_state_in_api_or_service() -> None:
    """State hangs off the app's lifespan: no module-level instances of clients, stores, indexes."""
    suspicious = ("AsyncClient(", "PrefixIndex(", "SessionTable(", "Cluster(", "GatewayMetrics(", "Context(")
    bad = []
    for folder in ("api", "service"):
        for f in (ROOT / folder).rglob("*.py"):
            for node in ast.parse(f.read_text()).body:
                if isinstance(node, ast.Assign | ast.AnnAssign):
                    src = ast.unparse(node)
                    if any(s in src for s in suspicious):
                        bad.append(f"{f.name}: {src}")
    assert bad == []


def test_prompt_analysis_is_one_package_behind_one_interface() -> None:
    """gateway/analysis imports no service or api module, and the rest of the gateway reaches it
    only through the package itself (``gateway.analysis``: analyze(request) -> Analysis), never
    its renderer, tokenizer, encoder or workers."""
    assert violations("analysis", {"gateway.service", "gateway.api"}) == []
    bad = []
    for f in ROOT.rglob("*.py"):
        if f.is_relative_to(ROOT / "analysis"):
            continue
        bad += [f"{f.relative_to(ROOT)} imports {m}" for m in imports(f) if m.startswith("gateway.analysis.")]
    assert bad == []


def test_only_the_transport_imports_aiohttp() -> None:
    """One HTTP client API (httpx's) everywhere; aiohttp is the transport under it, in one module."""
    bad = [
        f"{f.relative_to(ROOT)}"
        for f in ROOT.rglob("*.py")
        if f != ROOT / "service" / "proxy.py"
        and any(m == "aiohttp" or m.startswith("aiohttp.") for m in imports(f))
    ]
    assert bad == []


def test_the_package_never_imports_the_benchmarks() -> None:
    """The simulator and ``agentgw plan`` are the package's; benchmark scripts import it."""
    assert violations(".", {"benchmarks"}) == []


def test_the_simulator_drives_the_core_only() -> None:
    """gateway/sim runs the routing core in virtual time: no service, no edge, no I/O framework."""
    assert (
        violations("sim", {"gateway.service", "gateway.api", "asyncio", "httpx", "aiohttp", "fastapi"}) == []
    )


def test_each_formula_is_written_once() -> None:
    """The pin's TTL (expected gap plus margin, capped) and the expected gap (hint, then the
    session's own, then the default) are computed in one place each (``PlannerParams.pin_ttl_s``
    and ``.gap_s``), which the service, the simulator and the dashboard call; a copy written
    elsewhere drifts."""
    pin_sums, gap_defaults = [], []
    for f in ROOT.rglob("*.py"):
        where = str(f.relative_to(ROOT))
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.BinOp) and "pin_margin_s" in ast.unparse(node):
                pin_sums.append(where)
            if isinstance(node, ast.Attribute) and node.attr == "default_gap_s":
                gap_defaults.append(where)
    assert pin_sums == ["core/planner.py"], pin_sums
    assert set(gap_defaults) <= {"core/planner.py", "config.py"}, gap_defaults  # config: its default value


REPO = ROOT.parent


def test_no_tracked_file_names_a_path_of_one_machine() -> None:
    """A default that names a folder of one machine (a checkout's absolute location, a user's
    home) works there only: paths are relative to the checkout, or options."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    pattern = re.compile(r"(?<![\w./~-])/(?:work|Users)/[\w.-]")
    bad = []
    for name in files.splitlines():
        path = REPO / name
        if path.suffix not in {".py", ".md", ".sh", ".yml", ".yaml", ".toml", ".json", ".cfg", ".txt", ""}:
            continue
        if not path.is_file() or path.stat().st_size > 1 << 20:  # recorded data, not paths
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        bad += [f"{name}: {m.group(0)}" for m in pattern.finditer(text)]
    assert bad == []


def test_tests_reach_the_benchmarks_only_to_test_them() -> None:
    """The stand-in engine, the loopback proxy, the replica harness and the port helpers live in
    ``testing/``, which tests and benchmarks both import; only tests/benchmarks/, which tests the
    benchmark scripts themselves, imports ``benchmarks`` or runs one of its modules."""
    import re

    tests = REPO / "tests"
    run = re.compile(r"""["']-m["'],\s*["']benchmarks\.""")
    bad = []
    for f in tests.rglob("*.py"):
        if f.is_relative_to(tests / "benchmarks"):
            continue
        uses = any(m == "benchmarks" or m.startswith("benchmarks.") for m in imports(f))
        if uses or run.search(f.read_text()):
            bad.append(str(f.relative_to(REPO)))
    assert bad == []
    product = [
        str(f.relative_to(REPO))
        for f in ROOT.rglob("*.py")
        if any(m.startswith("testing") for m in imports(f))
    ]
    assert product == [], "the product package imports testing/"


def module_graph() -> dict[str, set[str]]:
    """Each module of gateway/ and the gateway modules it imports (``TYPE_CHECKING`` imports and
    imports inside functions included: a cycle is a cycle, whenever it is taken)."""
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    graph: dict[str, set[str]] = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from package import submodule`` depends on the submodule (the package's
                # __init__ being mid-import is Python's ordinary case); anything else on the module
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [node.module, *subs]
            for t in targets:
                if t in mods and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_gateway() -> None:
    """Wiring is explicit: each service part gets what it uses, typed against those parts (the
    pipeline against :class:`TurnStages`), so no module reaches back up to what built it."""
    assert cycles(module_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_calls_another_modules_private_names() -> None:
    """``obj._name(...)`` on anything but ``self``/``cls``: a private of another object, which its
    owner may change freely (the simulator's planning called the cluster's ``_engine_views``)."""
    bad = []
    for f in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr.startswith("_")
                and not node.func.attr.startswith("__")
                and not (isinstance(node.func.value, ast.Name) and node.func.value.id in ("self", "cls"))
                and not (isinstance(node.func.value, ast.Call) and ast.unparse(node.func.value) == "super()")
            ):
                bad.append(f"{f.relative_to(ROOT)}:{node.lineno} {ast.unparse(node.func)}")
    assert bad == []
