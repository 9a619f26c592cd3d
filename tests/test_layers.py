"""The package's layers, read from the source with ast: a module imports only from its own layer's package or
from lower layers, the sibling packages of one layer never import each other, and no import cycle exists among
modules. (docs/layout.md draws the same tree.)"""
from __future__ import annotations

import ast
from pathlib import Path


SRC = Path(__file__).resolve().parent.parent / "src" / "minitrain"

# Lowest first. A module may import its own unit and any unit of a lower layer; units of one layer are siblings
# that never import each other.
LAYERS = [
    {"errors", "utils", "version"},
    {"config"},
    {"runtime"},
    {"parallel"},
    {"models", "data", "checkpoint"},
    {"train", "api"},
    {"plan"},  # the memory/time planner: it predicts what train's optimizer and the strategies hold, from their code
    {"ddp"},  # the from-scratch DDP lab (code/main.py): torch and the data it reads only
    {"bench"},  # measurements, which `minitrain bench` runs
    {"apps"},  # the commands
]
UNIT_OF_FILE = {"data": "data", "corpus": "data", "ddp": "ddp", "errors": "errors", "__main__": "apps"}


def unit(module: str) -> str:
    """minitrain.parallel.core.strategy -> parallel; minitrain.data -> data (corpus/ is data's preparation half)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    return UNIT_OF_FILE.get(parts[1], parts[1])


def layer(u: str) -> int:
    for i, units in enumerate(LAYERS):
        if u in units:
            return i
    raise AssertionError(f"unit {u!r} is in no layer: add it to LAYERS (and docs/layout.md)")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """The minitrain modules `path` imports, at any depth in the file (a function-level import is an edge too),
    except under `if TYPE_CHECKING:`."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "minitrain"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "minitrain":
                continue
            for a in node.names:  # `from .. import checkpoint` names a module
                sub = f"{target}.{a.name}"
                found.add(sub if _exists(sub) else target)
    return found


def _exists(module: str) -> bool:
    path = SRC.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


GRAPH = {module_name(p): imports(p) for p in sorted(SRC.rglob("*.py"))}


def test_the_walk_reads_every_kind_of_import():
    """The graph the other tests judge is the real one: relative, absolute and function-level imports all seen."""
    assert len(GRAPH) > 60
    assert "minitrain.runtime.comm" in GRAPH["minitrain.parallel.core.strategy"]  # from ..runtime.comm import Comm
    assert "minitrain.checkpoint" in GRAPH["minitrain.train.trainer"]  # from .. import checkpoint
    assert "minitrain.runtime.launch" in GRAPH["minitrain.apps.cli"]


def test_no_module_imports_upward_or_sideways():
    wrong = []
    for module, targets in GRAPH.items():
        mine = unit(module)
        if mine == "package":  # minitrain/__init__.py: the public API's re-exports
            continue
        for target in targets:
            theirs = unit(target)
            if theirs == "package":
                wrong.append(f"{module} imports the top-level package")
            elif theirs != mine and layer(theirs) >= layer(mine):
                where = "a sibling" if layer(theirs) == layer(mine) else "a higher layer"
                wrong.append(f"{module} -> {target} ({where}: {mine} may not import {theirs})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    """Tarjan's strongly connected components over module edges: any component of more than one module (or a
    module importing itself) is a cycle."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in GRAPH[v]:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_api_loads_no_training_config_or_commands():
    """`import minitrain` brings in what the API needs: not the CLI's trainer, configuration, data or commands."""
    import subprocess
    import sys
    code = ("import sys, minitrain; print(' '.join(sorted(m for m in sys.modules if m.startswith('minitrain.'))))")
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    units = {unit(m) for m in loaded}
    assert units <= {"api", "parallel", "runtime", "checkpoint", "utils", "errors", "version"}, sorted(units)


# parallel/ is a syllabus: one folder per lesson. Lowest first; the folders of one level never import each other.
# state/ (placement, slices, whole-model state) is at the bottom; core/ is the contract every strategy fills in; each
# strategy imports core/ (and state/) only; user_loop/ (what a user's own loop needs: visible gradients, freed
# parameters, parameters used outside their module, replicas alike) is above them, its mechanisms handed to a
# strategy by make_strategy; parallelize() composes them on top.
PARALLEL_LEVELS = [
    {"state"},
    {"core"},
    {"data_parallel", "zero", "tensor_parallel", "pipeline_parallel", "expert_parallel", "param_server"},
    {"user_loop"},
    {"parallelize"},  # parallel/__init__.py and the model transforms beside it (recompute.py, compiled.py)
]


def lesson(module: str) -> str | None:
    """minitrain.parallel.zero.zero1 -> zero; minitrain.parallel.recompute -> parallelize; outside parallel: None."""
    parts = module.split(".")
    if parts[:2] != ["minitrain", "parallel"]:
        return None
    folder = parts[2] if len(parts) > 2 else "parallelize"
    return folder if any(folder in level for level in PARALLEL_LEVELS) else "parallelize"


def test_each_parallel_lesson_imports_only_what_is_below_it():
    level = {f: i for i, folders in enumerate(PARALLEL_LEVELS) for f in folders}
    wrong = []
    for module, targets in GRAPH.items():
        mine = lesson(module)
        for target in targets:
            theirs = lesson(target)
            if mine is None or theirs is None or theirs == mine:
                continue
            if level[theirs] >= level[mine]:
                wrong.append(f"{module} -> {target} ({mine} may not import {theirs})")
    assert not wrong, "\n".join(wrong)


MAX_FILE_LINES = 450
MAX_CLASS_CHAIN = 3


def test_no_file_over_the_limit():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines (split them along their seams): {long}"


def test_no_class_chain_deeper_than_the_limit():
    """A class's chain: itself and the minitrain classes it inherits from, along the longest line of bases (a strategy
    reads its whole chain to know what one step does)."""
    import importlib
    import inspect

    def depth(cls) -> int:
        ours = [b for b in cls.__bases__ if b.__module__.startswith("minitrain.")]
        return 1 + max((depth(b) for b in ours), default=0)

    chains = {}
    for module in GRAPH:
        # __main__ runs the CLI; _forkserver, imported, makes this process ignore the stop signals (and so every
        # process it then starts): it is for the launcher's fork server only, and holds no class.
        if module.endswith(("__main__", "._forkserver")):
            continue
        for name, cls in inspect.getmembers(importlib.import_module(module), inspect.isclass):
            if cls.__module__ == module:
                chains[f"{module}.{name}"] = depth(cls)
    assert len(chains) > 100  # every module imported, every class seen
    assert chains["minitrain.parallel.zero.sharded_units.ShardedUnits"] == 3  # ShardedUnits, ShardedStrategy, FlatStrategy
    deep = {name: d for name, d in chains.items() if d > MAX_CLASS_CHAIN}
    assert not deep, f"class chains deeper than {MAX_CLASS_CHAIN}: {deep}"
