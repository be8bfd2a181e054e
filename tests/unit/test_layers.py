"""The layered house: src/plait's folders are its floors (FLOORS, lowest first); every import in plait (at top
level or inside a function) points to its own floor or a lower one, no modules import each other in a circle,
and the command line lives in plait/cli alone. Read from the source with `ast`, nothing imported."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "src" / "plait"

FLOORS: list[tuple[str, ...]] = [
    # the folders of src/plait, lowest floor first: a module may import its own floor's and lower floors'
    ("core",),  # errors, storage, hardware, torch's private API, digests, signed directories, signals
    ("model", "data"),  # the Transformer and its parts; corpora, tokenizers, loaders
    ("config",),  # the settings' sections, loading and validation (the model's arguments are a section)
    ("parallel",),  # meshes, layout rules, parallelize, pipelines, context parallel, experts, compile
    ("engine",),  # the trainer, step, loss, optimizer, callbacks, checkpoints, metrics, run directory
    ("planner", "interop", "features"),  # libraries over the engine: the cost model, HF formats, run features
    ("lifecycle",),  # lineage, fine-tuning, LoRA, compression, evaluation, serving
    ("cli", "api.py", "__main__.py"),  # the commands and the Python API: nothing imports them
]
TOP_FILES = {"__init__.py", "api.py", "__main__.py"}  # src/plait's only modules outside a floor's folder


def _floor_of(module: str) -> int:
    """A module's floor, from the folder it lives in (plait.<folder>.…), or its own file at the top."""
    parts = module.split(".")
    if parts[0] != "plait":
        raise AssertionError(f"{module} is in no floor: not a plait module")
    if len(parts) == 1:
        return len(FLOORS) - 1  # the package's face hands out plait.api's names
    top = parts[1] if (ROOT / parts[1]).is_dir() else parts[1] + ".py"
    for i, folders in enumerate(FLOORS):
        if top in folders:
            return i
    raise AssertionError(f"{module} is in no floor: put it in one of the folders of FLOORS in {__file__}")


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT.parent).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return mods


def test_the_folders_are_the_floors():
    """`ls src/plait` shows the layers: a folder per floor, and no module at the top but the API's."""
    entries = {p.name for p in ROOT.iterdir() if p.name != "__pycache__" and not p.name.endswith(".egg-info")}
    known = {name for floor in FLOORS for name in floor} | TOP_FILES
    assert entries <= known, f"src/plait holds {sorted(entries - known)}: put each in the folder of its floor"
    assert {n for n in entries if n.endswith(".py")} <= TOP_FILES
    assert all((ROOT / n).is_dir() for floor in FLOORS for n in floor if not n.endswith(".py"))


def test_no_command_line_inside_a_library():
    """Commands (argument parsing, `cmd_*`) live in plait.cli alone: the libraries below are called, not run."""
    found = [
        f"{m}: {why}"
        for m, f in sorted(_modules().items())
        if not m.startswith("plait.cli") and m != "plait.__main__"  # `python -m plait`: the entry point
        for why in _command_line_in(f.read_text())
    ]
    assert not found, "command-line code outside plait/cli:\n" + "\n".join(found)


def _command_line_in(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("cmd_"):
            found.append(f"defines {node.name}")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            found += [
                f"imports {n}" for n in names if n in ("argparse", "plait.cli") or str(n).startswith("plait.cli.")
            ]
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the plait modules it imports anywhere in its source (functions included); every name of a
    `from plait.x import a, b` counts (a submodule each, or a name of plait.x itself)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        base = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    parts = base.split(".")
                    mod = ".".join(parts[: len(parts) - node.level + 1] + ([mod] if mod else []))
                targets = [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] == "plait" and (r := resolve(t)) and r != m and not m.startswith(r + "."):
                    edges[m].add(r)
    return edges


def test_every_import_points_down_or_sideways():
    edges = import_graph()
    upward = [
        f"{a} (floor {_floor_of(a)}) -> {b} (floor {_floor_of(b)})"
        for a, targets in sorted(edges.items())
        for b in sorted(targets)
        if _floor_of(b) > _floor_of(a)
    ]
    assert not upward, "imports pointing up a floor:\n" + "\n".join(upward)


def test_no_import_cycle():
    edges = import_graph()
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(", ".join(c) for c in cycles)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_the_checks_catch_a_cycle_an_upward_arrow_and_a_command():
    """The oracle itself: a planted cycle is found, floors order as the folders say, a command is seen."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _floor_of("plait.engine.trainer") == _floor_of("plait.engine.checkpoint") > _floor_of("plait.model.llama")
    assert _floor_of("plait.cli") > _floor_of("plait.lifecycle.tracking") > _floor_of("plait.engine.trainer")
    assert _floor_of("plait.api") == _floor_of("plait.cli.main") > _floor_of("plait.config.load")
    with pytest.raises(AssertionError, match="in no floor"):
        _floor_of("elsewhere.module")
    with pytest.raises(AssertionError, match="in no floor"):
        _floor_of("plait.newcomer")
    assert _command_line_in("import argparse\ndef cmd_x(argv): pass\n") == ["imports argparse", "defines cmd_x"]
    assert _command_line_in("from plait.cli.args import PlaitParser\n") == ["imports plait.cli.args"]


# ------------------------------------------------------------------- torch's private APIs: in one module

PRIVATE_HOME = "torch_private.py"


def _private_torch_uses(source: str) -> list[str]:
    """Where this source reaches into torch's private API: an import of a `_module` or a `_name` from torch,
    an attribute `_x` on a chain that starts at torch (or a name bound to a torch module), a `getattr` of a
    `_x` name, or a call with a `_keyword` (torch's experimental arguments)."""
    tree, found, bound = ast.parse(source), [], {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    bound.add(alias.asname or "torch")
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if alias.name.startswith("_"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    private = lambda name: name.startswith("_") and not name.endswith("__")  # noqa: E731

    def root(node) -> str | None:
        while isinstance(node, (ast.Attribute, ast.Call)):
            node = node.value if isinstance(node, ast.Attribute) else node.func
        return node.id if isinstance(node, ast.Name) else None

    torch_classes: set[str] = set()  # classes of this source built on torch's (their calls take torch's keywords)
    while len(torch_classes) < len(
        torch_classes := torch_classes
        | {
            c.name
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef) and {root(b) for b in c.bases} & (bound | torch_classes)
        }
    ):
        pass
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and root(node) in bound:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "id", None)
            if (
                name in ("getattr", "hasattr", "setattr")
                and len(node.args) > 1
                and root(node.args[0]) not in ("self", "cls")
            ):
                key = node.args[1]
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and private(key.value):
                    found.append(f"line {node.lineno}: {name}(..., {key.value!r})")
            if root(node.func) in bound | torch_classes:
                found += [f"line {node.lineno}: {k.arg}=" for k in node.keywords if k.arg and private(k.arg)]
    return found


def test_torch_private_apis_are_reached_only_through_one_module():
    """A torch upgrade that moves a private API breaks plait.core.torch_private (and its test), not its callers."""
    uses = {
        str(path.relative_to(ROOT)): where
        for path in sorted(ROOT.rglob("*.py"))
        if path.name != PRIVATE_HOME and (where := _private_torch_uses(path.read_text()))
    }
    assert not uses, f"torch's private API outside plait/{PRIVATE_HOME}: {uses}"


def test_the_private_api_check_finds_each_kind_of_use():
    planted = """
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
from torch.utils.checkpoint import checkpoint
torch.ops.aten._grouped_mm(x)
dist._functional_collectives
getattr(t, "_local_tensor", t)
from torch.distributed.checkpoint import FileSystemWriter
class Writer(FileSystemWriter): pass
class Retrying(Writer): pass
Retrying(path, _extensions=[])
torch.nn.functional.silu(x)
x.__class__
"""
    uses = _private_torch_uses(planted)
    assert len(uses) == 6, uses
    own = "import torch\nself._cache = torch.zeros(1)\nhasattr(self, '_thread')\nLoaded(_hash=1)\nx.shape\n"
    assert _private_torch_uses(own) == []


# ---------------------------------------------------------------- callbacks see the run through RunState


def _run_state_members() -> set[str]:
    from plait.engine.callbacks import RunState

    return set(RunState.__annotations__) | {n for n in vars(RunState) if not n.startswith("_")}


def _run_reads(source: str) -> dict[str, set[str]]:
    """{Class.hook: the attributes it reads or calls on its `run` argument} for every method with a `run`
    parameter of every class in the source."""
    out: dict[str, set[str]] = {}
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and any(a.arg == "run" for a in fn.args.args):
                out[f"{cls.name}.{fn.name}"] = {
                    n.attr
                    for n in ast.walk(fn)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "run"
                }
    return out


def test_callbacks_touch_the_trainer_only_through_run_state():
    """No callback in plait reads a Trainer attribute that RunState does not declare."""
    allowed = _run_state_members()
    outside = {
        f"{path.relative_to(ROOT)}: {where}": sorted(reads - allowed)
        for path in sorted(ROOT.rglob("*.py"))
        for where, reads in _run_reads(path.read_text()).items()
        if reads - allowed
    }
    assert not outside, f"callbacks reading the trainer outside plait.engine.callbacks.RunState: {outside}"
    planted = "class C:\n    def after_step(self, run, step, result):\n        run.t.model\n        run._secret\n"
    assert _run_reads(planted) == {"C.after_step": {"t", "_secret"}} and "_secret" not in allowed
    assert {"cfg", "t", "state", "metrics", "withhold_step", "roll_back"} <= allowed
    # The trainer's own parts (loader, compile monitor, stop request, run lock, callback list, validation
    # split) are given to its own components when it builds them, not to every callback.
    trainers_own = {"loader", "compiler", "stop", "lock", "callbacks", "val_split", "val_loader", "model_fn"}
    assert not trainers_own & allowed, trainers_own & allowed


HOOKS = {
    "on_setup",
    "on_model",
    "on_start",
    "before_step",
    "should_step",
    "after_step",
    "after_eval",
    "after_checkpoint",
    "close",
    "on_end",
}


def _hooks_fired_with_run(source: str) -> list[str]:
    """Calls `<something>.<hook>(run, ...)`: a callback passing its run on to hooks (other callbacks')."""
    return [
        f"{ast.unparse(n.func)}:{n.lineno}"
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in HOOKS
        and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "run"
    ]  # fmt: skip


def test_only_the_trainer_fires_the_callbacks_hooks():
    """The loop owns its cadence: it fires every hook (through plait.engine.callbacks.Callbacks); no callback
    calls another's (Validation once fired after_eval, the checkpointing callback after_checkpoint), so the
    order of the callback list is not a contract between them."""
    fired = {
        f"{path.relative_to(ROOT)}": calls
        for path in sorted(ROOT.rglob("*.py"))
        if path.relative_to(ROOT).as_posix() != "engine/callbacks.py"
        and (calls := _hooks_fired_with_run(path.read_text()))
    }
    assert not fired, f"hooks fired outside the trainer: {fired}"
    planted = "class C:\n    def after_step(self, run, step, result):\n        run.callbacks.after_eval(run, step, 1)\n"
    assert _hooks_fired_with_run(planted) == ["run.callbacks.after_eval:3"]


MAX_FUNCTION_LINES = 60
"""A function longer than this is doing several jobs: split it (there is no exception today)."""
MAX_CLASS_LINES = 300
MAX_MODULE_LINES = 450
LONGER_ON_PURPOSE = "Longer than the house's 450 lines on purpose"
"""The words a module over MAX_MODULE_LINES opens with, followed by the reason (its docstring's second part)."""


def _sizes(source: str) -> list[tuple[str, int, int]]:
    """(what, lines, limit) of each function and class of a module over its limit, and of the module itself
    (unless its docstring gives the reason)."""
    tree = ast.parse(source)
    over = []
    for node in ast.walk(tree):
        lines = (getattr(node, "end_lineno", 0) or 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
            over.append((f"{node.lineno} {node.name}", lines, MAX_FUNCTION_LINES))
        elif isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
            over.append((f"{node.lineno} class {node.name}", lines, MAX_CLASS_LINES))
    lines = source.count("\n")
    if lines > MAX_MODULE_LINES and LONGER_ON_PURPOSE not in (ast.get_docstring(tree) or ""):
        over.append(("module", lines, MAX_MODULE_LINES))
    return over


def test_no_function_class_or_module_over_its_size():
    """No function over 60 lines, no class over 300, no module over 450 unless its docstring says why."""
    over = {f"{path.relative_to(ROOT)}:{what}": f"{n} > {limit}" for path in sorted(ROOT.rglob("*.py"))
            for what, n, limit in _sizes(path.read_text())}  # fmt: skip
    assert not over, f"over the size budget: {over}"
    body = "\n".join(f"    x = {i}" for i in range(61))
    planted = f'"""A module."""\ndef f():\n{body}\nclass C:\n' + "    y = 1\n" * 300 + "z = 1\n" * 100
    assert [(w, limit) for w, _, limit in _sizes(planted)] == [("2 f", 60), ("64 class C", 300), ("module", 450)]
    assert _sizes(f'"""A module.\n\n{LONGER_ON_PURPOSE}: one module for all."""\n' + "z = 1\n" * 500) == []


def _names_the_cli(source: str) -> bool:
    """A string in the code (not a comment or docstring) naming plait's command-line package: what a
    subprocess started as `python -m plait.cli` or `plait.cli.main` would hold."""
    tree = ast.parse(source)
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
    }  # fmt: skip
    return any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and "plait.cli" in n.value and id(n) not in docstrings
        for n in ast.walk(tree)
    )


def test_no_module_below_the_command_line_names_it():
    """Nothing in a layer starts the command line (`python -m plait.cli ...`), which the import check cannot see."""
    naming = [
        str(path.relative_to(ROOT))
        for path in sorted(ROOT.rglob("*.py"))
        if path.relative_to(ROOT).parts[0] not in ("cli", *TOP_FILES) and _names_the_cli(path.read_text())
    ]
    assert not naming, f"modules below cli/ that name plait.cli: {naming}"
    assert _names_the_cli('cmd = [sys.executable, "-m", "plait.cli", "fit"]')
    assert not _names_the_cli('"""Started by plait.cli.train."""\n# plait.cli')


MEASUREMENTS = ROOT.parents[1] / "docs" / "measurements.md"
TIMING = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|µs|us|s|min)\b")
MACHINE = re.compile(r"(?i)\b(?:H100|H200|A100|VM|EPYC|\d-core|this machine|this CPU|measured on)\b")
MEASUREMENT_REF = re.compile(r'docs/measurements\.md,\s+"([^"]+)"')


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment and each string statement (docstrings) in a file, newlines kept."""
    source = path.read_text()
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))
    return out


def _timings_beside_machines(paths) -> list[str]:
    found = []
    for path in paths:
        for line, text in _prose(path):
            flat = " ".join(text.split())
            if TIMING.search(flat) and MACHINE.search(flat):
                found.append(f"{path.name}:{line}: {flat[:100]}")
    return found


def test_one_machines_timings_live_in_docs_measurements_not_in_comments():
    """A time measured on one machine goes stale in a comment: it belongs in docs/measurements.md with the
    machine, the date and how to measure again; the comment keeps the reason and names the entry."""
    paths = sorted(ROOT.rglob("*.py"))
    assert not _timings_beside_machines(paths)
    headings = {row.split("|")[1].strip() for row in MEASUREMENTS.read_text().splitlines() if row.startswith("| ")}
    flat = {path: " ".join(re.sub(r"\n\s*#", " ", path.read_text()).split()) for path in paths}  # comments joined
    named = {m for text in flat.values() for m in MEASUREMENT_REF.findall(text)}
    assert named, "no comment names an entry of docs/measurements.md (the check reads nothing)"
    assert named <= headings, f"comments name entries docs/measurements.md lacks: {named - headings}"


def test_the_timing_check_finds_a_measured_comment(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Fast."""\n\n\ndef f():\n    # measured on an H200: 0.74 ms a chunk\n    return 1\n')
    good = tmp_path / "good.py"
    good.write_text('def f(timeout_s=30):\n    """Waits 30 s (torch\'s default) before giving up."""\n')
    assert _timings_beside_machines([bad]) == ["bad.py:5: # measured on an H200: 0.74 ms a chunk"]
    assert _timings_beside_machines([good]) == []


def test_renamed_collectives_go_through_one_module():
    """torch 2.13 warns at every call of the old names of the tensor-in, tensor-out collectives (8 warnings per
    `--nproc 8` run); plait.core.collectives picks this torch's name, and nothing else calls the old ones."""
    old = re.compile(r"\bdist\.(all_gather_into_tensor|reduce_scatter_tensor)\(")
    calls = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in ROOT.rglob("*.py")
        if path.name != "collectives.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if old.search(line)
    ]
    assert calls == [], calls
