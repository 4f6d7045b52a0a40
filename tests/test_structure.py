"""The layout of src/: data flows one way (prepare/data -> benchmark -> train loop -> MLPerf log/telemetry files ->
report), no module imports from a layer above its own, the loop never names a benchmark, and every function of the
training loop fits on one screen."""

import ast
from pathlib import Path

import pytest
from conftest import REPO

from trainbench.benchmarks import BENCHMARKS

SRC = Path(__file__).resolve().parents[1] / "src" / "trainbench"

# Lowest first. A module may import from its own layer and the ones before it.
LAYERS = [
    {"errors", "config", "console", "version"},  # what everything shares
    {"distributed", "mlperf", "runfiles", "telemetry", "node"},  # process groups, MLPerf log lines, run-file names,
    # sampler, what a node is
    {"data", "families", "optim", "convert"},  # on-disk formats, model families (architecture, placement, speed),
    # optimizers
    {"benchmarks"},  # the benchmark interface and the definitions
    {"resolve"},  # from a preset, YAML files and overrides (or a saved config.yaml) to the config a run trains with
    {"train"},  # the one training loop
    {"launch"},  # in-process, torchrun and Slurm launch
    {"measure"},  # throughput (`trainbench bench`), the layout probe and plan, the HF peers: the loop's step, timed
    {"report"},  # scores, reports and packages read from results folders
    {"cli", "__main__"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules():
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts == ("__init__",):
            continue
        yield path, parts[0]


def imported_packages(path: Path) -> set[str]:
    """The top-level trainbench packages or modules ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainbench."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("trainbench.")}
    return found


def test_every_module_has_a_layer():
    assert {top for _, top in modules()} <= set(LAYER), "a new top-level module needs a place in LAYERS"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [
        f"{path.relative_to(SRC)} ({top}, layer {LAYER[top]}) imports {dep} (layer {LAYER[dep]})"
        for path, top in modules()
        for dep in imported_packages(path)
        if LAYER[dep] > LAYER[top]
    ]
    assert not upward, "\n".join(upward)


def literal_strings(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_no_benchmark_name_is_a_literal_outside_the_benchmark_definitions():
    """The CLI, the loop, launch and report reach a benchmark through the registry. families/ is exempt: an
    architecture may be named after its model family (the decoder's ``arch`` "gpt3")."""
    names = {b.name for b in BENCHMARKS.values()} | {b.mlperf_name for b in BENCHMARKS.values()}
    names |= {b.ruleset for b in BENCHMARKS.values()}
    found = [
        f"{path.relative_to(SRC)}:{line}: {value!r}"
        for path, top in modules()
        if top not in ("benchmarks", "families")
        for line, value in literal_strings(path)
        if value in names
    ]
    assert not found, "\n".join(found)


SCREEN = 50  # lines


# The loop, and the measurements that run its step (they left train/ for measure/, the rule with them).
ON_ONE_SCREEN = sorted((SRC / "train").glob("*.py")) + [SRC / "measure" / f"{name}.py" for name in
                                                        ("probe", "throughput", "compare_hf")]  # fmt: skip


@pytest.mark.parametrize("path", ON_ONE_SCREEN, ids=lambda p: p.relative_to(SRC).as_posix())
def test_every_function_of_the_training_loop_fits_on_one_screen(path):
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > SCREEN
    ]
    assert not long, long


def test_the_loop_never_asks_which_benchmark_it_runs():
    """train/ imports only the Benchmark interface, and never compares a benchmark's name or tests its class: what
    differs between benchmarks is asked of the interface."""
    for path in (SRC / "train").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainbench.benchmarks"):
                assert node.module == "trainbench.benchmarks.base", f"{path.name}:{node.lineno} imports {node.module}"
            if isinstance(node, ast.Compare):
                text = ast.unparse(node)
                assert ".name" not in text and "mlperf_name" not in text, f"{path.name}:{node.lineno}: {text}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                assert "Benchmark" not in ast.unparse(node), f"{path.name}:{node.lineno}: {ast.unparse(node)}"


def test_make_test_fails_on_a_file_ruff_format_would_change(tmp_path):
    """`make test` runs `make lint` first, and lint checks formatting as well as the rules: run on a copy of the
    Makefile and the ruff settings, with one file formatted by hand."""
    import shutil
    import subprocess
    import sys

    if shutil.which("make") is None:
        pytest.skip("make is not installed here")
    planned = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True).stdout
    assert "ruff format --check src tests examples perf" in planned and "ruff check src tests examples perf" in planned
    for folder in ("src", "tests", "examples", "perf"):
        (tmp_path / folder).mkdir()
    shutil.copy(REPO / "Makefile", tmp_path)
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    stamp = tmp_path / "installed"
    stamp.touch()  # newer than pyproject.toml: nothing to install
    lint = ["make", "-s", "lint", f"VENV={Path(sys.executable).parent.parent}", f"STAMP={stamp}"]
    (tmp_path / "examples" / "tidy.py").write_text("values = [1, 2, 3]\n")
    assert subprocess.run(lint, cwd=tmp_path, capture_output=True, text=True).returncode == 0
    (tmp_path / "examples" / "untidy.py").write_text("values = [1,2,\n    3]\n")  # lint-clean, not formatted
    failed = subprocess.run(lint, cwd=tmp_path, capture_output=True, text=True)
    assert failed.returncode != 0 and "untidy.py" in failed.stdout + failed.stderr, failed.stdout + failed.stderr


# -- the model families (src/trainbench/families/) ----------------------------------------------------------------
FAMILIES = SRC / "families"
# What a family's placement and speed paths are made of: the recipe (benchmarks/) never imports them, nor does an
# architecture file. Modules by their last name, in any family's package or beside them.
PLACEMENT_AND_SPEED = {"placement", "lora_placement", "data_parallel", "fp8", "fp8_output", "moe_fp8", "offload",
                       "memory", "triton_kernels", "glu_kernel", "attention_kernel", "embedding_rows",
                       "planner"}  # fmt: skip
ARCHITECTURE = sorted(p for p in FAMILIES.rglob("*.py") if p.name in ("model.py", "moe.py", "gpt_oss.py", "lora.py"))
# Kernels an architecture file still calls itself, each with where it is chosen, until its family's placement hands
# it in from outside: a new entry needs a reason here.
ARCHITECTURE_KERNELS = {
    ("encoder/model.py", "cudnn_attention"): "BERT picks its packed attention's kernel at each call, by "
    "model.packed_attention and by what the call allows (autocast, gradients, dropout in training or not)",
}


def imported_modules(path: Path) -> set[str]:
    """Every trainbench module ``path`` imports (dotted, below ``trainbench.``), at module level or in functions; a
    ``from trainbench.x import y`` counts ``x.y`` too (y may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainbench."):
            base = node.module.removeprefix("trainbench.")
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("trainbench.") for a in node.names if a.name.startswith("trainbench.")}
    return found


def test_benchmarks_never_import_a_placement_or_a_speed_path():
    """A benchmark is the recipe: it names its family and asks it for the model; placement, FP8, offload, kernels and
    the layout planner are the family's."""
    found = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in sorted((SRC / "benchmarks").glob("*.py"))
        for name in imported_modules(path)
        if name.startswith("families.") and name.rsplit(".", 1)[-1] in PLACEMENT_AND_SPEED
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", ARCHITECTURE, ids=lambda p: str(p.relative_to(FAMILIES)))
def test_architecture_files_import_neither_placement_nor_speed_paths(path):
    """families/*/model.py and the decoder's layers are architecture only: checkpointing, host offload, FP8 and
    placement are applied from outside by the family's placement (torch.utils.checkpoint included)."""
    where = str(path.relative_to(FAMILIES))
    names = imported_modules(path)
    text = path.read_text()
    found = [n for n in names if n.rsplit(".", 1)[-1] in PLACEMENT_AND_SPEED | {"cudnn_attention", "glu_kernel"}
             and (where, n.rsplit(".", 1)[-1]) not in ARCHITECTURE_KERNELS]  # fmt: skip
    found += ["torch.utils.checkpoint"] if "torch.utils.checkpoint" in text else []
    assert not found, f"{where} imports {found}"


def test_the_loop_never_asks_which_family_it_runs():
    """train/ reaches the model through ``benchmark.family`` and the ModelFamily interface only: it imports no family's
    package and never tests a family's class or name."""
    for path in (SRC / "train").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainbench.families"):
                assert node.module == "trainbench.families.base", f"{path.name}:{node.lineno} imports {node.module}"
            if isinstance(node, ast.Compare):
                assert "family.name" not in ast.unparse(node), f"{path.name}:{node.lineno}: {ast.unparse(node)}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "hasattr"):
                text = ast.unparse(node)
                assert "Family" not in text and "family" not in text, f"{path.name}:{node.lineno}: {text}"


def test_every_benchmark_names_a_model_family():
    from trainbench.families.base import ModelFamily

    for bench in BENCHMARKS.values():
        assert isinstance(bench.family, ModelFamily), f"{bench.name}.family is {bench.family!r}"


def test_the_offload_key_is_read_in_the_decoder_family_alone():
    """``perf.offload_blocks`` (and its companion ``offload_recomputed_inputs``) is read where the decoder's blocks are
    placed and planned, nowhere else: the recipe names it only to say it has no effect."""
    readers = sorted({
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("offload_blocks", "offload_recomputed_inputs")
    })  # fmt: skip
    outside = [r for r in readers if not r.startswith("families/")]
    assert readers and not outside, f"read outside families/: {outside}"


def module_imports() -> dict[str, set[str]]:
    """Each module of src/trainbench (dotted, below ``trainbench.``) with the modules of src/trainbench it imports, at
    module level or inside functions (``from trainbench.x import y`` counts ``x.y`` where that is a module)."""
    names = {".".join(p.relative_to(SRC).with_suffix("").parts): p for p in SRC.rglob("*.py")}
    names = {n.removesuffix(".__init__"): p for n, p in names.items()}
    return {
        name: {m for m in imported_modules(path) if m in names and m != name and not name.startswith(m + ".")}
        for name, path in names.items()
    }


def test_no_two_modules_import_each_other_through_any_path():
    """No import cycle between files (one would make the layers a lie inside a package, and the order of imports
    matter): a depth-first search over every module's imports finds no way back to where it started."""
    graph, state, cycles = module_imports(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "\n".join(cycles)
