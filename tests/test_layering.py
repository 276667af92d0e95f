"""Imports point one way (docs/design.md, section 1.2): a lower layer never imports a higher one,
the planner imports no torch, Ray or megatron-core, the Plan contract (``planner/contract/``)
imports only the base layer, the runtime reads only the contract of the planner, and no
modules of the package import each other in a cycle. Pure Python: the package's sources are
parsed with ``ast``, nothing is imported.

Every import counts, also one inside a function: a lazy import is still a dependency (the data
loader circle was made of lazy imports). ``megatron_bytescale/megatron/`` is our glue package;
``import megatron.core`` is megatron-core, a third-party package, and is not our glue."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = "megatron_bytescale"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Module (or package) prefix -> layer. The longest matching prefix wins.
LAYER_OF = {
    "errors": "base",
    "units": "base",
    "lengths_file": "base",  # the sequence-lengths file reader of plan, simulate and verify
    "process_lifetime": "base",  # workers that die with their launcher (stdlib only)
    "triton_stand_ins": "base",  # megatron-core's triton kernel modules stood in for (stdlib only)
    "megatron_era": "base",  # which megatron-core API is imported (stdlib only)
    "folder_lock": "base",  # one run per output folder (stdlib only)
    "checkpoint_manifest": "base",  # sizes and SHA-256 of a checkpoint folder (stdlib only)
    "virtual_stages": "base",  # the VPP layout check `bytescale plan` and the simulator share (stdlib only)
    "checkpoint_io": "runtime",  # atomic, checksummed torch.save files
    "planner.contract": "contract",  # the Plan, Op, the pipeline dependency graph, the rules
    "planner": "planner",
    "runtime": "runtime",
    "local_world": "runtime",  # starts local torch.distributed (gloo) worlds
    "data": "data",
    "sim": "sim",
    "megatron": "megatron",
    "tools": "top",
    "commands": "top",  # each subcommand's flags and printing, above every library package
    "cli": "top",
    "demo": "top",
    "verify": "top",
    "launch": "top",
    "torchrun": "top",  # torchrun with the launch checks and one-line rank errors
    "": "top",  # the package's own __init__ (only it: a new module must be given a layer here)
}

# Layer -> what its modules may import (of ours), and why.
ALLOWED = {
    "base": (
        {"base"},
        "errors.py, units.py and the small stdlib-only helpers (lengths files, process lifetime, folder locks) "
        "are shared by every layer, so they import only each other",
    ),
    "contract": (
        {"base", "contract"},
        "the Plan contract is what the runtime and the simulator read: loading it must "
        "not load the schedulers, estimates and heuristics that produce plans",
    ),
    "planner": (
        {"base", "contract", "planner"},
        "the planner is pure: it turns lengths into a Plan and knows no runtime",
    ),
    "runtime": (
        {"base", "contract", "runtime"},
        "the runtime executes Plans on torch.distributed (it reads the contract, "
        "not the planner that makes plans), below the Megatron glue, the data loaders and the tools that use it",
    ),
    "data": (
        {"base", "contract", "planner", "runtime", "data"},
        "data/ plans steps and builds the runtime's batches; the Megatron glue wires it in, never the other way round",
    ),
    "sim": (
        {"base", "contract", "sim"},
        "the simulator costs Plans (the contract) on data/'s workloads, never the runtime or the glue",
    ),
    "megatron": (
        {"base", "contract", "planner", "runtime", "data", "megatron"},
        "the Megatron glue sits on the runtime and data/; only tools, the demo, verify and the CLI sit above it",
    ),
    "top": (
        {"base", "contract", "planner", "runtime", "data", "sim", "megatron", "top"},
        "the top layer may use everything",
    ),
}

# Single modules a layer may use although their package sits elsewhere, and why.
EXTRA_ALLOWED_WHY = {
    "sim": {
        "data.workloads": "the workload generators (lengths from a distribution or a file), nothing else of data/",
        "planner.planner": "the HDP strategies are the planner itself (plan_step), compared with the others",
        "planner.fields": "the planner's errors name its fields; the simulator spells them as its flags",
        "planner.cost_model": "every strategy is costed with the planner's cost model, so they compare like for like",
        "planner.specs": "the model and hardware specs the cost model is built from",
        "planner.sizing.offload": "the copy-exposure rule of offloaded activations, the one the planner plans with",
        "planner.sizing.two_level": "the two-level attention costs (head all-to-all, split choice), the planner's",
        "planner.expert.slots": "aligning a strategy's plan to EP slots",
        "planner.expert.pipelines": "aligning a strategy's plan to EP slots over all pipelines",
        "planner.expert.timing": "the MoE all-to-all time, the planner's",
        "planner.ring_traffic": "the bytes a ring sends, the formula verify checks against the runtime's counter",
        "planner.order.walk": "the pipeline graph's longest paths, the planner's estimates' rule",
    },
}
EXTRA_ALLOWED = {layer: {f"{PACKAGE}.{m}" for m in why} for layer, why in EXTRA_ALLOWED_WHY.items()}

# The planner by concern (docs/design.md 1.2): shared pieces at its top, each concern's folder,
# then the step that puts them together. Part -> the parts it may import (besides itself), and why.
PLANNER_PART_OF = {
    "planner.sizing": "sizing",
    "planner.estimate": "estimate",
    "planner.balance": "balance",
    "planner.order": "order",
    "planner.expert": "expert",
    "planner.config": "step",
    "planner.units": "step",
    "planner.search": "step",
    "planner.build": "step",
    "planner.planner": "step",
    "planner": "shared",  # jit, selection, fields, placement, lengths, specs, cost_model, ring_traffic, cpu_profile
}
PLANNER_PARTS_ALLOWED = {
    "shared": ({"shared"}, "the kernels' helper, the cost model and the specs: what every concern reads"),
    "sizing": ({"shared"}, "ring sizes, offload ratios and packing depend on the cost model alone"),
    "estimate": ({"shared", "sizing"}, "micro-batch estimates charge the offload policy's exposed copies"),
    "balance": ({"shared"}, "the balance scheduler places units of work, whatever made them"),
    "order": ({"shared", "estimate", "balance"}, "orders and their estimates follow the scheduler's assignment"),
    "expert": ({"shared", "estimate", "order"}, "EP slots are aligned on ordered plans and timed by the estimates"),
    "step": ({"shared", "sizing", "estimate", "balance", "order", "expert"}, "the step puts the concerns together"),
}

# Third-party top-level packages a layer must not import.
FORBIDDEN_THIRD_PARTY = {
    "planner": (
        {"torch", "ray", "megatron"},
        "the planner is pure Python + numpy (it runs in Ray actors and the CLI without torch)",
    ),
    "contract": ({"torch", "ray", "megatron", "numpy", "yaml"}, "the Plan contract is the standard library only"),
}


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    path: str  # file, relative to the repository
    line: int
    target: str  # absolute module name (ours or third-party)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(name: str, source: str, path: str, is_package: bool, modules: set[str]) -> list[Import]:
    """Every import in ``source`` (the module ``name``), resolved to absolute module names. For
    ``from X import y``, ``X.y`` is the target when it is one of our modules (a submodule),
    else ``X``."""
    found = []
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            found += [Import(name, path, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level - 1 >= len(base):
                    raise AssertionError(f"{path}:{node.lineno}: relative import goes above the package")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules]
            if len(subs) < len(node.names):
                found.append(Import(name, path, node.lineno, target))
            found += [Import(name, path, node.lineno, sub) for sub in subs]
    return found


def layer(module: str) -> str | None:
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    rest = module[len(PACKAGE) + 1 :]
    for prefix in sorted(LAYER_OF, key=len, reverse=True):
        if rest == prefix or (prefix and rest.startswith(prefix + ".")):
            return LAYER_OF[prefix]
    return None


def violations(found: list[Import]) -> list[str]:
    """One line per import that breaks a rule: the importer, the imported module, the rule."""
    out = []
    for imp in found:
        src = layer(imp.importer)
        if src is None:
            out.append(
                f"{imp.path}: module {imp.importer} is in no layer: add it to LAYER_OF in tests/test_layering.py"
            )
            continue
        top = imp.target.split(".")[0]
        if top == PACKAGE:
            dst = layer(imp.target)
            allowed, why = ALLOWED[src]
            if dst not in allowed and imp.target not in EXTRA_ALLOWED.get(src, ()):
                out.append(
                    f"{imp.path}:{imp.line}: {imp.importer} ({src} layer) imports {imp.target} ({dst} layer): "
                    f"{src} may import only {', '.join(sorted(allowed | EXTRA_ALLOWED.get(src, set())))} ({why})"
                )
        elif src in FORBIDDEN_THIRD_PARTY and top in FORBIDDEN_THIRD_PARTY[src][0]:
            out.append(
                f"{imp.path}:{imp.line}: {imp.importer} ({src} layer) imports {imp.target}: "
                f"{FORBIDDEN_THIRD_PARTY[src][1]}"
            )
    return out


def cycles(found: list[Import], within: str) -> list[str]:
    """Import cycles among the modules under ``within`` (a package; its ``__init__`` excluded,
    since importing a submodule always runs its package first)."""
    graph: dict[str, set[str]] = {}
    for imp in found:
        if imp.importer.startswith(within + ".") and imp.target.startswith(within + "."):
            graph.setdefault(imp.importer, set()).add(imp.target)
    out = []
    while True:
        try:
            TopologicalSorter(graph).prepare()
            return out
        except CycleError as exc:
            cycle = exc.args[1]  # each node is imported by the next one
            out.append(" imports ".join(reversed(cycle)))
            graph[cycle[1]].discard(cycle[0])  # drop one edge of it and look for more


def package_imports(root: Path = ROOT) -> list[Import]:
    modules = all_modules(root)
    repo = root.parent
    found = []
    for name, path in modules.items():
        found += imports_of(
            name, path.read_text(), str(path.relative_to(repo)), path.name == "__init__.py", set(modules)
        )
    return found


@pytest.fixture(scope="module")
def found() -> list[Import]:
    return package_imports()


def test_no_import_points_up(found):
    bad = violations(found)
    assert not bad, "imports against the layering (docs/design.md, section 1.2):\n" + "\n".join(bad)


def test_no_modules_import_each_other_in_a_cycle(found):
    """Over the whole package (every sub-package included): a cycle hides which module is
    the lower one, and lazy imports that break it at run time still count."""
    bad = cycles(found, PACKAGE)
    assert not bad, "import cycles:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "package",
    ["data", "planner", "planner.contract", "planner.sizing", "planner.balance", "planner.order", "planner.expert"]
    + ["runtime", "sim", "megatron", "tools", "commands"],
)
def test_each_package_imports_its_own_modules_without_a_cycle(found, package):
    bad = cycles(found, f"{PACKAGE}.{package}")
    assert not bad, f"import cycles in {package}/:\n" + "\n".join(bad)


def test_runtime_and_simulator_read_the_planner_only_through_the_contract(found):
    """What runtime/ and sim/ import of planner/: the contract, and for the simulator only the
    modules EXTRA_ALLOWED names with a reason."""
    for imp in found:
        src = layer(imp.importer)
        if src in ("runtime", "sim") and imp.target.startswith(f"{PACKAGE}.planner"):
            assert layer(imp.target) == "contract" or imp.target in EXTRA_ALLOWED.get(src, ()), (
                f"{imp.path}:{imp.line}: {imp.importer} imports {imp.target}, not the planner's contract"
            )


def planner_part(module: str) -> str | None:
    rest = module[len(PACKAGE) + 1 :]
    if not (rest == "planner" or rest.startswith("planner.")) or layer(module) == "contract":
        return None
    for prefix in sorted(PLANNER_PART_OF, key=len, reverse=True):
        if rest == prefix or rest.startswith(prefix + "."):
            return PLANNER_PART_OF[prefix]
    return None


def test_the_planners_concerns_import_one_way(found):
    """Inside planner/ (outside the contract): each concern's folder imports the shared pieces
    and the concerns below it only (``PLANNER_PARTS_ALLOWED``), never the step above it."""
    bad = []
    for imp in found:
        src, dst = planner_part(imp.importer), planner_part(imp.target)
        if src is None or dst is None or src == dst:
            continue
        allowed, why = PLANNER_PARTS_ALLOWED[src]
        if dst not in allowed:
            bad.append(f"{imp.path}:{imp.line}: {imp.importer} ({src}) imports {imp.target} ({dst}): {why}")
    assert not bad, "imports against the planner's concerns:\n" + "\n".join(bad)


def test_every_planner_module_has_a_part():
    assert all(
        planner_part(name)
        for name in all_modules()
        if name.startswith(f"{PACKAGE}.planner.") and layer(name) != "contract"
    )


def test_every_module_has_a_layer():
    assert all(layer(name) for name in all_modules())


def test_command_lines_are_parsed_and_printed_in_commands_only():
    """A subcommand's flags (``add_arguments``) and its ``main(args)`` live in ``commands/``:
    the library packages take values, never a command line (docs/design.md, section 1.2)."""
    found = []
    for name, path in all_modules().items():
        if name.startswith(f"{PACKAGE}.commands."):
            continue
        tree = ast.parse(path.read_text(), str(path))
        found += [f"{name}.{n.name}" for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "add_arguments"]
    assert not found, "subcommand flags outside commands/: " + ", ".join(found)
    cli = ast.parse((ROOT / "cli.py").read_text())
    (table,) = [n.value for n in cli.body if isinstance(n, ast.AnnAssign) and n.target.id == "SUBCOMMANDS"]
    modules = [entry.elts[0].value for entry in table.values]
    assert modules and all(m.startswith(f"{PACKAGE}.commands.") for m in modules), modules


# The checker itself: it must see what it is meant to catch.


def _check(name: str, source: str, is_package: bool = False, modules=()) -> list[str]:
    known = {f"{PACKAGE}.{m}" for m in modules} | {name}
    return violations(imports_of(name, source, name.replace(".", "/") + ".py", is_package, known))


def test_checker_flags_relative_and_absolute_upward_imports():
    for source in (
        "from ..megatron import parallel",
        "from ..megatron.model import load_model",
        "import megatron_bytescale.megatron.parallel",
        "from megatron_bytescale.tools import profiler",
        "def f():\n    from ..sim.timeline import simulate\n",
    ):
        bad = _check(f"{PACKAGE}.runtime.thing", source, modules=["megatron.parallel", "tools.profiler"])
        assert len(bad) == 1 and f"{PACKAGE}.runtime.thing (runtime layer) imports {PACKAGE}." in bad[0], source
        assert "runtime may import only base, contract, runtime" in bad[0]


def test_checker_tells_megatron_core_from_our_glue():
    assert _check(f"{PACKAGE}.runtime.thing", "from megatron.core import parallel_state") == []
    assert _check(f"{PACKAGE}.runtime.thing", "import megatron.core") == []
    bad = _check(f"{PACKAGE}.planner.thing", "import megatron.core")
    assert len(bad) == 1 and "planner is pure" in bad[0]
    assert _check(f"{PACKAGE}.megatron.model", "from ..runtime.context import current_micro_batch") == []


def test_checker_resolves_package_relative_imports():
    # in a package's __init__, "." is the package itself
    assert _check(f"{PACKAGE}.sim", "from .timeline import simulate", is_package=True) == []
    assert _check(f"{PACKAGE}.sim", "from ..runtime import step", is_package=True, modules=["runtime.step"])
    # the simulator reads data/'s workloads and nothing else of data/
    assert _check(f"{PACKAGE}.sim.simulate", "from ..data.workloads import sample_lengths") == []
    assert _check(f"{PACKAGE}.sim.simulate", "from ..data.planning import StepPlan")


def test_checker_finds_a_lazy_import_cycle():
    names = {f"{PACKAGE}.data.{m}" for m in ("loader", "local_loader")}
    found = imports_of(
        f"{PACKAGE}.data.loader", "def make():\n    from .local_loader import L\n", "loader.py", False, names
    )
    found += imports_of(
        f"{PACKAGE}.data.local_loader", "from .loader import StepLoader\n", "local_loader.py", False, names
    )
    (cycle,) = cycles(found, f"{PACKAGE}.data")
    assert f"{PACKAGE}.data.loader imports {PACKAGE}.data.local_loader" in f"{cycle} imports {cycle}"
    assert f"{PACKAGE}.data.local_loader imports {PACKAGE}.data.loader" in f"{cycle} imports {cycle}"


def test_checker_keeps_the_contract_below_the_planner():
    bad = _check(
        f"{PACKAGE}.planner.contract.plan", "from ..cost_model import FORWARD_SHARE", modules=["planner.cost_model"]
    )
    assert len(bad) == 1 and "contract may import only base, contract" in bad[0]
    assert _check(f"{PACKAGE}.planner.contract.plan", "import numpy")
    (bad,) = _check(f"{PACKAGE}.runtime.thing", "from ..planner.planner import plan_step", modules=["planner.planner"])
    assert "runtime may import only base, contract, runtime" in bad
    assert _check(f"{PACKAGE}.runtime.thing", "from ..planner.contract import Plan", modules=["planner.contract"]) == []
    assert layer(f"{PACKAGE}.planner.contract") == "contract" and layer(f"{PACKAGE}.planner.planner") == "planner"


def test_checker_places_every_module():
    (bad,) = _check(f"{PACKAGE}.newthing", "import os")
    assert f"module {PACKAGE}.newthing is in no layer: add it to LAYER_OF" in bad
    assert layer("megatron.core") is None and layer(f"{PACKAGE}.megatron.model") == "megatron"
    assert layer(PACKAGE) == "top" and layer(f"{PACKAGE}.local_world") == "runtime"
