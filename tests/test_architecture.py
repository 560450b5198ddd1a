"""The import graph of segue/ has no cycles and no module imports one above it.

The layer order is the one docs/ARCHITECTURE.md states. Every import counts: top-level, inside
functions (late imports) and under TYPE_CHECKING, since each is a dependency a reader must follow.
Pure ast over the source files; nothing is imported."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import its own layer and the ones before it, never a later one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("segue.arith", "segue.sampling_params", "segue.outputs", "segue.request", "segue.config",
                    "segue.tools", "segue.structured.spec")),
    ("structured", ("segue.structured",)),
    ("kv", ("segue.kv",)),
    ("sched", ("segue.sched",)),
    ("model", ("segue.model",)),
    ("executor", ("segue.executor",)),
    ("predict", ("segue.predict",)),
    # The seam's own types: what the server may know of an engine.
    ("client", ("segue.engine.protocol", "segue.engine.engine_request", "segue.engine.calls", "segue.engine.stats",
                "segue.engine.model_info")),
    ("engine", ("segue.engine", "segue.profiler")),
    ("async", ("segue.engine.async_engine", "segue.engine.engine_thread", "segue.engine.streams",
               "segue.engine.llm")),
    ("cluster", ("segue.cluster",)),
    ("program", ("segue.program",)),
    ("server", ("segue.server",)),
    ("sim", ("segue.sim",)),
    ("bench", ("segue.bench",)),
    ("cli", ("segue.cli", "segue")),
]


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in sorted((ROOT / "segue").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _targets(module: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, mods: dict) -> set[str]:
    """The segue modules an import statement names (a name imported from a package counts as the
    submodule when there is one, else as the package)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
    found = set()
    for name in names:
        if name.split(".")[0] != "segue":
            continue
        while name not in mods:
            name = name.rsplit(".", 1)[0]
        if name != module:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for module, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        graph[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module] |= _targets(module, is_pkg, node, mods)
    return graph


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer index): the longest prefix decides
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    return None if best is None else best[1]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                    cycles.append(sorted(component))
    return cycles


def test_every_module_has_a_layer():
    unplaced = [m for m in import_graph() if layer_of(m) is None]
    assert not unplaced, f"add these modules to LAYERS (and docs/ARCHITECTURE.md): {unplaced}"


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles between segue modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_upward_imports():
    upward = []
    for module, targets in sorted(import_graph().items()):
        for target in sorted(targets):
            lo, hi = layer_of(module), layer_of(target)
            if lo is not None and hi is not None and hi > lo:
                upward.append(f"{module} ({LAYERS[lo][0]}) imports {target} ({LAYERS[hi][0]})")
    assert not upward, "imports that go up the layer order:\n" + "\n".join(upward)


def test_layer_order_is_the_documented_one():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    stated = [line.split("`")[1] for line in doc.splitlines() if line.startswith("| ") and line.count("`") >= 2
              and line.split("`")[1] in {name for name, _ in LAYERS}]
    assert stated == [name for name, _ in LAYERS], "docs/ARCHITECTURE.md's layer table and LAYERS disagree"


# What the server may import of the layers up to the cluster (the engine side): the EngineClient
# seam and the plain data that crosses it, the tool and constraint vocabulary it builds requests
# from. Everything else (engine, scheduler, KV, executors, predictors, async engine, cluster) is
# reached through an EngineClient only. launch.py is the composition root: it builds the engine
# (segue.cluster.build_engine, from an EngineConfig) and hands the app an EngineClient.
SERVER_MAY_IMPORT = ("segue.engine.protocol", "segue.engine.engine_request", "segue.engine.calls", "segue.engine.stats",
                     "segue.engine.model_info", "segue.outputs", "segue.sampling_params", "segue.tools",
                     "segue.structured")
COMPOSITION_ROOTS = ("segue.server.launch",)


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _layer_index(name: str) -> int:
    return [n for n, _ in LAYERS].index(name)


def server_imports_past_the_seam(graph: dict[str, set[str]]) -> list[str]:
    engine_side = _layer_index("cluster")
    bad = []
    for module, targets in sorted(graph.items()):
        if not _within(module, ("segue.server",)) or _within(module, COMPOSITION_ROOTS):
            continue
        for target in sorted(targets):
            layer = layer_of(target)
            if layer is not None and layer <= engine_side and not _within(target, SERVER_MAY_IMPORT):
                bad.append(f"{module} imports {target}")
    return bad


def test_server_talks_to_the_engine_only_through_engine_client():
    bad = server_imports_past_the_seam(import_graph())
    assert not bad, ("segue/server reaches past the EngineClient seam (add a method to segue/engine/protocol.py, "
                     "or the module to SERVER_MAY_IMPORT if it is plain data):\n" + "\n".join(bad))


# Heavy libraries the seam must not load: a client of the engine (the server's worker, a program
# client, a test) imports its vocabulary without paying for the model or the predictors.
SEAM_MUST_NOT_LOAD = ("numpy", "torch")


def test_the_seam_imports_without_numpy_or_torch():
    import subprocess
    import sys

    seam = dict(LAYERS)["client"]
    probe = (f"import importlib, sys\nfor m in {seam!r}: importlib.import_module(m)\n"
             f"print(sorted(m for m in {SEAM_MUST_NOT_LOAD!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing the seam {seam} loads {out.stdout.strip()}"


def engine_imports_of_simulation(graph: dict[str, set[str]]) -> list[str]:
    """The engine's step loop serves requests; trace replay and oracle predictions belong to the
    simulator (segue/sim), which drives the engine through its public methods and hooks."""
    engine = _layer_index("engine")
    return [f"{module} imports {target}" for module, targets in sorted(graph.items())
            if layer_of(module) is not None and layer_of(module) <= engine
            for target in sorted(targets) if _within(target, ("segue.sim",))]


def test_engine_is_free_of_simulation():
    bad = engine_imports_of_simulation(import_graph())
    assert not bad, "the engine imports the simulator:\n" + "\n".join(bad)


def test_seam_checks_catch_violations():
    """The two checks above, on made-up graphs: each flags exactly the import it exists for."""
    graph = {"segue.server.chat_start": {"segue.engine.protocol", "segue.sched.scheduler", "segue.outputs"},
             "segue.server.launch": {"segue.cluster"},
             "segue.engine.llm_engine": {"segue.sim.script", "segue.sched.scheduler"}}
    assert server_imports_past_the_seam(graph) == ["segue.server.chat_start imports segue.sched.scheduler"]
    assert engine_imports_of_simulation(graph) == ["segue.engine.llm_engine imports segue.sim.script"]


@pytest.mark.parametrize("graph,expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_cycle_finder(graph, expected):
    assert find_cycles(graph) == expected


def test_readme_and_docs_link_only_into_the_repo():
    """A lone clone is all a user has: relative links must point at files in it."""
    import re

    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+://|^#|^mailto:", target):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                bad.append(f"{doc.name}: {target}")
    assert not bad, f"links outside the repository or to missing files: {bad}"


# ---- the KV manager's seam (issue 27) ------------------------------------------------------
# Outside segue/kv/ the KV manager is read through its verbs (counters(), held(), holders(),
# block_ids(), ...: segue/kv/interface.py's KVCache), never through its pools, block
# tables or private state: those change shape whenever the KV layout does, and seven modules
# reading them is what made the host tier impossible to restructure.
KV_ATTRS = {"tables", "host_tables", "device", "host"}  # internal when read off a KV manager
# Internal anywhere:
KV_ONLY_NAMES = {"host_tables", "_retained", "_num_registered", "_tier", "_link", "_hasher", "_dev"}
BLOCK_INTERNALS = {"ref_cnt", "heap_seq", "reuse_at"}  # a KVBlock's bookkeeping


def _names_kv_manager(node: ast.expr) -> bool:
    """`kv`, `self.kv`, `sched.kv`, `engine.scheduler.state.kv`: how segue refers to its KV manager."""
    return (isinstance(node, ast.Name) and node.id == "kv") or (isinstance(node, ast.Attribute) and node.attr == "kv")


def kv_internal_reads(source: str, filename: str = "<source>") -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Attribute):
            continue
        on_kv = _names_kv_manager(node.value) and (node.attr in KV_ATTRS or node.attr.startswith("_"))
        if on_kv or node.attr in KV_ONLY_NAMES or node.attr in BLOCK_INTERNALS:
            bad.append(f"{filename}:{node.lineno}: .{node.attr}")
    return bad


@functools.cache
def segue_sources() -> dict[str, str]:
    """Every module of segue/, path (relative to the repository) -> source, read once per run."""
    return {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
            for path in sorted((ROOT / "segue").rglob("*.py"))}


def test_only_segue_kv_reads_kv_internals():
    bad = []
    for name, source in segue_sources().items():
        if name.startswith("segue/kv/"):
            continue
        bad += kv_internal_reads(source, name)
    assert not bad, "KV internals read outside segue/kv/ (add a verb to segue/kv/interface.py):\n" + "\n".join(bad)


# Outside segue/kv/ only its interface is imported (the verbs of KVCache and the opaque values they
# trade in): no KVBlock, no pool, no host tier. The places that construct a KVCacheManager are the
# exceptions (and tests, which are not scanned here).
KV_INTERFACE = "segue.kv.interface"
KV_CONSTRUCTORS = ("segue.engine.scheduler_builder", "segue.sim.prefix_cache")


def kv_imports_past_the_interface(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} imports {target}" for module, targets in sorted(graph.items())
            if not _within(module, ("segue.kv",) + KV_CONSTRUCTORS)
            for target in sorted(targets) if _within(target, ("segue.kv",)) and target != KV_INTERFACE]


def test_only_the_kv_interface_is_imported_outside_segue_kv():
    bad = kv_imports_past_the_interface(import_graph())
    assert not bad, ("modules import segue/kv past its interface (add a verb to segue/kv/interface.py's "
                     "KVCache):\n" + "\n".join(bad))


def test_kv_interface_check_catches_violations():
    graph = {"segue.sched.admission": {"segue.kv.block_pool", "segue.kv.interface"},
             "segue.engine.scheduler_builder": {"segue.kv.manager"}, "segue.kv.manager": {"segue.kv.block_pool"}}
    assert kv_imports_past_the_interface(graph) == ["segue.sched.admission imports segue.kv.block_pool"]


@pytest.mark.parametrize("source,caught", [
    ("sched.kv.tables.get(rid)", True),
    ("for rid in self.kv.host_tables: pass", True),
    ("kv.device.usage()", True),
    ("s.kv.host.num_free_blocks", True),
    ("self.kv._retained", True),
    ("held = [b for b in hits if b.ref_cnt == 0]", True),
    ("tables = manager.host_tables", True),
    ("kv.counters().usage() + kv.counters().num_free_host_blocks", False),
    ("self.kv.block_ids(rid); self.kv.held(rid).host", False),
    ("executor.device; self.tables", False),  # not a KV manager
])
def test_kv_internal_reads_are_caught(source, caught):
    assert bool(kv_internal_reads(source)) == caught


# ---- short functions -----------------------------------------------------------------------
# The scheduler's step and the engine's loop read as sequences of named steps: a function over
# 60 lines hides one.
MAX_FUNCTION_LINES = 60
SHORT_FUNCTION_DIRS = ("segue/sched", "segue/kv", "segue/engine")


def long_functions(source: str, filename: str = "<source>", limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                out.append(f"{filename}:{node.lineno}: {node.name} has {length} lines")
    return out


def test_no_long_functions_in_the_scheduler_and_the_engine_loop():
    empty = [folder for folder in SHORT_FUNCTION_DIRS if not any((ROOT / folder).rglob("*.py"))]
    assert not empty, f"SHORT_FUNCTION_DIRS names folders without Python files (moved?): {empty}"
    paths = [p for folder in SHORT_FUNCTION_DIRS for p in sorted((ROOT / folder).rglob("*.py"))]
    bad = []
    for path in paths:
        bad += long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(bad)


def test_long_functions_are_caught():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") and not long_functions("def f():\n    return 1\n")


# ---- names and signatures -------------------------------------------------------------------
# One class per name: two classes called KVCache (the tensors and the scheduler's protocol) made
# every reader check which one an import meant.
def class_definitions(source: str, filename: str = "<source>") -> list[tuple[str, str]]:
    return [(node.name, f"{filename}:{node.lineno}") for node in ast.walk(ast.parse(source, filename))
            if isinstance(node, ast.ClassDef)]


def duplicate_class_names(definitions: list[tuple[str, str]]) -> list[str]:
    places: dict[str, list[str]] = {}
    for name, where in definitions:
        places.setdefault(name, []).append(where)
    return [f"{name}: {', '.join(where)}" for name, where in sorted(places.items()) if len(where) > 1]


def test_no_class_name_is_defined_twice():
    definitions = [d for name, source in segue_sources().items() for d in class_definitions(source, name)]
    bad = duplicate_class_names(definitions)
    assert not bad, "class names defined more than once in segue/ (name each for what it holds):\n" + "\n".join(bad)


# A function that needs more than this many values takes some of them as a named group (a
# dataclass: the plan of a model's matmuls, where a turn starts), so call sites read by name.
MAX_PARAMETERS = 8


def wide_functions(source: str, filename: str = "<source>", limit: int = MAX_PARAMETERS) -> list[str]:
    """Functions with more than `limit` parameters, self and cls not counted (*args and **kwargs
    count one each)."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
        names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
        if names and names[0] in ("self", "cls"):
            names = names[1:]
        if len(names) > limit:
            out.append(f"{filename}:{node.lineno}: {node.name} takes {len(names)}")
    return out


def test_no_function_takes_more_than_eight_parameters():
    bad = [w for name, source in segue_sources().items() for w in wide_functions(source, name)]
    assert not bad, (f"functions with more than {MAX_PARAMETERS} parameters (group some into a dataclass of "
                     "named values):\n" + "\n".join(bad))


def test_names_and_signatures_checks_catch_violations():
    defs = class_definitions("class A: pass\nclass B:\n    class A: pass\n", "m.py")
    assert duplicate_class_names(defs + [("C", "n.py:1")]) == ["A: m.py:1, m.py:3"]
    eight = ", ".join(f"a{i}" for i in range(8))
    assert not wide_functions(f"class K:\n    def f(self, {eight}): pass\n")
    assert wide_functions(f"def f({eight}, *rest): pass\n") == ["<source>:1: f takes 9"]
    assert wide_functions(f"async def f({eight}, *, k=1): pass\n") == ["<source>:1: f takes 9"]


def test_top_of_the_package_holds_only_shared_vocabulary():
    # Everything else lives in the package of its layer (engine/, sched/, kv/, ...), so the tree
    # shows the layers.
    top = sorted(p.stem for p in (ROOT / "segue").glob("*.py"))
    assert top == ["__init__", "arith", "cli", "config", "outputs", "request", "sampling_params"]


# ---- one owner for memory (issue 46) -------------------------------------------------------
# Memory is taken from one request (a paused context, a retained history, a running or waiting
# request) for another, and given up by those that keep it, in one place: sched/memory.py walks the
# table in sched/memory_table.py, and sched/memory_kept.py releases the paused contexts and retained
# histories (for the walk, and as the interception policy's dispositions, expiry, a hand-over to the
# next turn, abandon() and finish decide). The paused queue and the agents choose (which go, in
# which order) and return their choice; a change to who gives memory to whom is made and reviewed
# in these two modules. The release verbs: the KV manager's free, release, swap_out and
# release_retained, and release_for_memory, the sources' own verb before they only chose (a
# source that releases for itself again is caught anywhere).
MEMORY_OWNER = ("segue/sched/memory.py", "segue/sched/memory_kept.py")
SOURCE_RELEASE_VERBS = {"release_for_memory"}
KV_RELEASE_VERBS = {"free", "release", "swap_out", "release_retained"}
# The prefix-cache replay drives a KV manager of its own, without a scheduler.
STANDALONE_KV = ("segue/sim/prefix_cache.py",)


def release_calls(source: str, filename: str = "<source>") -> list[str]:
    """Calls of a release verb: release_for_memory on anything, the KV verbs on a KV manager."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        verb = node.func.attr
        if verb in SOURCE_RELEASE_VERBS or (verb in KV_RELEASE_VERBS and _names_kv_manager(node.func.value)):
            found.append(f"{filename}:{node.lineno}: {verb}()")
    return found


def memory_released_outside_the_owner(files: dict[str, str]) -> list[str]:
    """The release calls in `files` (path -> source) outside the memory owner; segue/kv/ releases
    its own blocks, and the standalone replay only with the KV verbs."""
    bad = []
    for name, source in sorted(files.items()):
        if name.startswith("segue/kv/") or name in MEMORY_OWNER:
            continue
        calls = release_calls(source, name)
        if name in STANDALONE_KV:
            calls = [c for c in calls if c.endswith(tuple(f" {v}()" for v in SOURCE_RELEASE_VERBS))]
        bad += calls
    return bad


def test_only_the_memory_owner_releases_memory():
    bad = memory_released_outside_the_owner(segue_sources())
    assert not bad, (f"memory released outside {' and '.join(MEMORY_OWNER)} (return the choice to "
                     "segue/sched/memory_kept.py, or add a site or a source to segue/sched/memory_table.py, "
                     "and release it there):\n" + "\n".join(bad))


def test_the_memory_owner_calls_every_release_verb():
    found = {c.rsplit(" ", 1)[1] for name in MEMORY_OWNER
             for c in release_calls((ROOT / name).read_text(encoding="utf-8"))}
    assert found == {f"{v}()" for v in KV_RELEASE_VERBS}


def test_a_release_outside_the_owner_is_caught():
    """On made-up files: the paused queue or the agents releasing for themselves again is flagged;
    the owner, segue/kv/ and the replay's KV calls are not."""
    files = {
        "segue/sched/paused.py": "def plan(self):\n    self.kv.swap_out(req, 4)\n",
        "segue/sched/agents.py": "def expire(self):\n    x = 1\n    self.kv.release_retained(ctx)\n",
        "segue/sched/memory_kept.py": "sched.kv.release(req, None, 0.0)",
        "segue/kv/manager.py": "self.kv.free(req)",
        "segue/sim/prefix_cache.py": "kv.free(req); paused.release_for_memory(4, now)",
    }
    assert memory_released_outside_the_owner(files) == [
        "segue/sched/agents.py:3: release_retained()", "segue/sched/paused.py:2: swap_out()",
        "segue/sim/prefix_cache.py:1: release_for_memory()"]


@pytest.mark.parametrize("source,caught", [
    ("sched.paused.release_for_memory(need, now)", True),
    ("agents.release_for_memory(short, now, keep=keep)", True),
    ("self.state.kv.free(request)", True),
    ("sched.kv.swap_out(req, 4)", True),
    ("kv.release(req)", True),
    ("self.kv.release_retained(handle)", True),
    ("self.slot.release(); cache.swap_out(mapping); self.release(req)", False),  # not a KV manager
    ("sched.kv.allocate_slots(req, 4); kv.finish(req, now, 0.0)", False),
])
def test_release_calls_are_caught(source, caught):
    assert bool(release_calls(source)) == caught


# ---- one typed call per request operation --------------------------------------------------------
# A request's verbs cross the server, the engine client, the pool, the replicas and the Ray actor
# as one EngineCall value (segue/engine/calls.py) through one `call` method per layer, instead of
# one method per verb per layer. The verb itself is defined where it is done: the engine's
# requests and the scheduler (and the LLMEngine that forwards to its requests).
REQUEST_VERBS = ("abort", "abandon", "expect_resume", "held_token_ids", "get_stats")
VERB_LAYERS = ("segue/server", "segue/engine", "segue/cluster", "segue/sched")
MAX_CLASSES_PER_VERB = 4


def classes_defining(source: str, names: tuple[str, ...]) -> dict[str, list[str]]:
    """For each of `names`, the classes of `source` that define it: a method, or a class-level
    assignment (LLMEngine's forwarding `abandon = _to_requests(...)`)."""
    found: dict[str, list[str]] = {name: [] for name in names}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        defined = set()
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(item.name)
            elif isinstance(item, ast.Assign):
                defined |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        for name in names:
            if name in defined:
                found[name].append(node.name)
    return found


def verb_definitions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {verb: [] for verb in REQUEST_VERBS}
    for name, source in segue_sources().items():
        if name.startswith(tuple(f"{folder}/" for folder in VERB_LAYERS)):
            for verb, classes in classes_defining(source, REQUEST_VERBS).items():
                found[verb] += [f"{name}:{c}" for c in classes]
    return found


def test_no_request_verb_is_respelled_at_every_layer():
    bad = {verb: classes for verb, classes in verb_definitions().items() if len(classes) > MAX_CLASSES_PER_VERB}
    assert not bad, ("request verbs defined in more than four classes (send them as an EngineCall, "
                     f"segue/engine/calls.py, through `call`): {bad}")


def test_verb_definitions_are_counted():
    source = ("class A:\n    def abort(self): ...\n    async def abandon(self): ...\n"
              "class B:\n    abandon = forward\n    def other(self): ...\n"
              "def abort(): ...\n")
    found = classes_defining(source, ("abort", "abandon", "get_stats"))
    assert found == {"abort": ["A"], "abandon": ["A", "B"], "get_stats": []}
