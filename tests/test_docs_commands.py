"""Every `trainbench` command in the README, docs/ and the `--help` examples, as written, with placeholders given
tiny stand-ins (DIR, results folders, a YAML file).

Commands that need only this machine run whole: list, --help-config, prepare from synthetic data and from
WikiText-2, check and report on a finished run, submit --dry-run on the local system. Commands that need what CI
has not got (the training itself, 8 GPUs, a Slurm cluster, the Wikipedia dump, C4) run through argument parsing,
the config, its validation and the system file, up to the launch, which a stand-in records; prepare from a
dataset CI has not got parses its arguments only. A word with a `*` is expanded in the sandbox, as the shell would.

The README's quick start is also checked as a whole: it follows `make demo` (whose folders it names), puts the
`trainbench` that `make demo` installed on PATH before its first command, and runs as typed in bash after what
`make demo` leaves (the whole suite's tier).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from trainbench import cli
from trainbench.benchmarks import BENCHMARKS, register, registry, unregister

SHARED = REPO.parent / "shared" / "data"


def documented() -> list[tuple[str, str]]:
    """(where, command line) of every documented command."""
    sources = {p.relative_to(REPO).as_posix(): p.read_text() for p in [REPO / "README.md", *REPO.glob("docs/*.md")]}
    sources |= {
        "trainbench run --help": cli.run.EXAMPLES_RUN,
        "trainbench submit --help": cli.run.EXAMPLES_SUBMIT,
        "trainbench prepare --help": cli.data.EXAMPLES_PREPARE,
        "trainbench bench --help": cli.bench.EXAMPLES_BENCH,
    }
    sources |= {f"trainbench prepare {b.name} --help": b.prepare_examples for b in BENCHMARKS.values()}
    found = []
    for where, text in sources.items():
        lines = iter(text.replace("\\\\\n", "\\\n").splitlines())
        for line in lines:
            line = line.strip()
            if not line.startswith("trainbench ") or line.startswith("trainbench COMMAND"):
                continue
            while line.endswith("\\"):
                line = line[:-1] + " " + next(lines).strip()
            line = re.split(r"\s+#\s|\s{2,}\(", line)[0].strip()  # a trailing comment or "(every key ...)"
            found.append((where, line))
    return found


COMMANDS = documented()
# DIR is the data folder of the benchmark the command names: data/<benchmark>-tiny, prepared in the sandbox for bert
# and for the example package's ctr_tiny (docs/extending.md).
PLACEHOLDERS = {"<the new run folder>": "finished"}
NEEDS_DATA_CI_HAS_NOT = ("enwiki-", "results4/", "--source", " ... ")


def expand(word: str) -> list[str]:
    """A word of a command as the shell passes it on: a pattern with `*` becomes the paths it matches, in order."""
    return (sorted(glob.glob(word)) or [word]) if "*" in word else [word]


@pytest.fixture(scope="module")
def example_benchmark(ctr_site):
    """The example package's benchmark (examples/ctr_benchmark), installed and registered in this process as its
    entry point registers it in a fresh one."""
    sys.path.insert(0, str(ctr_site))
    from trainbench_ctr import CtrBenchmark

    registered = "ctr_tiny" not in registry()
    if registered:
        register(CtrBenchmark(), origin="trainbench-ctr 0.1.0, entry point ctr_tiny")
    yield
    if registered:
        unregister("ctr_tiny")
    sys.path.remove(str(ctr_site))


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, tiny_data, converged, example_benchmark):
    """A working directory holding what the documented commands name, as tiny stand-ins."""
    root = tmp_path_factory.mktemp("docs")
    (root / "data").mkdir()
    os.symlink(tiny_data, root / "data" / "bert-tiny")
    for name in ("finished", "20261121T224453Z-bert-tiny"):
        shutil.copytree(converged, root / "results" / name)
    for name in ("system.yaml", "my_system.yaml"):
        (root / name).write_text("output:\n  submission_platform: 8xH200\n")
    if (SHARED / "text" / "wikitext-2").is_dir():
        shutil.copytree(SHARED / "text" / "wikitext-2", root / "wikitext-2")
    return root


def test_the_docs_hold_the_commands_users_copy():
    text = " ".join(c for _, c in COMMANDS)
    assert len(COMMANDS) >= 30 and "--nproc 2" in text and "submit" in text and "--input wikitext-2/" in text


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[f"{w}: {c}"[:90] for w, c in COMMANDS])
def test_a_documented_command_runs_as_written(where, command, sandbox, monkeypatch, capsys):
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    words = shlex.split(command)
    named = words[2] if len(words) > 2 and words[1] in ("prepare", "run", "submit") else "bert"
    command = command.replace("DIR", f"data/{named}-tiny")
    monkeypatch.chdir(sandbox)
    args = [match for word in shlex.split(command)[1:] for match in expand(word)]
    launched = []

    def launch(bench, cfg, nexp=1, given=None, plan=None):  # the training: recorded, not run
        launched.append((bench.name, cfg))
        if cfg.output.run_dir and not Path(cfg.output.run_dir).exists():  # a later command reads the folder it names
            shutil.copytree(sandbox / "results" / "finished", cfg.output.run_dir)
        from trainbench.distributed import available_slots
        from trainbench.launch.local import preflight

        here = cfg.data.dir and Path(cfg.data.dir).is_dir() and cfg.distributed.nproc <= available_slots("cpu")
        if here and not cfg.resume:
            preflight(bench, cfg)  # the data it names is here, and the processes fit: check them as a run would
        return sandbox / "results" / "finished", []

    def submit(bench, cfg, system, nexp, dry_run, command_line, chain=1, plan=None):  # a cluster: recorded, not asked
        launched.append((bench.name, cfg))
        return sandbox / "results" / "finished", "#!/bin/bash\n", None

    def resubmit(run_dir, time_limit=None):  # a cluster and a submitted folder: recorded, not asked
        launched.append(("resubmit", run_dir))
        return [0], "1"

    monkeypatch.setattr("trainbench.launch.local.run_experiments", launch)
    monkeypatch.setattr("trainbench.launch.slurm.resubmit", resubmit)
    if "--dry-run" not in args or "local_cpu_1x2" not in args:
        monkeypatch.setattr("trainbench.launch.slurm.submit", submit)
    if any(marker in command for marker in NEEDS_DATA_CI_HAS_NOT):  # the options parse, as written
        args = shlex.split(command.replace(" ... ", " --input corpus --out data/out "))[1:]
        parsed, extra = cli._parser().parse_known_args(args)
        assert parsed.command == "prepare" and not extra, extra
        return
    if args[0] == "bench":  # a GPU's measurement at full size: its options and config are built and checked only
        from trainbench.config import parse_key_values
        from trainbench.resolve import build_config

        parsed, extra = cli._parser().parse_known_args(args)
        preset = parsed.preset or registry()[parsed.benchmark].full_preset
        bench, cfg = build_config(parsed.benchmark, preset, parsed.config,
                                  parse_key_values([*parsed.overrides, *extra]))  # fmt: skip
        assert parsed.steps >= 1 and bench.name == parsed.benchmark
        return
    if "wikitext-2" in command and not (sandbox / "wikitext-2").exists():
        pytest.skip("WikiText-2 is read from ../shared/data, absent here")
    if "--export" in args:  # an optional extra (`make` installs both)
        tool = args[args.index("--export") + 1]
        pytest.importorskip(tool, reason=f"{tool} is not installed (pip install -e '.[{tool}]')")
    code = run_cli(*args)
    out = capsys.readouterr().out
    assert "error:" not in out and "Traceback" not in out, out
    assert code == 0 or (code == 1 and args[0] == "run" and launched), (code, out)
    if args[0] in ("run", "submit", "resubmit") and "--help-config" not in args:
        assert launched, f"{command} did not reach the launch"


def quick_start() -> list[str]:
    """The lines of the README's quick start (its first bash block), comments dropped."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [re.split(r"\s+#\s", line)[0].strip() for line in block.splitlines() if line.strip()]


def make_variable(name: str) -> str:
    """A variable's default in the Makefile (``NAME ?= value``)."""
    return re.search(rf"^{name}\s*\??=\s*(\S+)", (REPO / "Makefile").read_text(), re.M).group(1)


def test_the_quick_start_follows_make_demo_and_puts_its_trainbench_on_path():
    lines = quick_start()
    assert lines[0] == "make demo", lines
    venv = make_variable("VENV")
    activate = f"source {venv}/bin/activate"
    first = next(i for i, line in enumerate(lines) if line.startswith("trainbench "))
    assert activate in lines[:first], f"the quick start runs {lines[first]!r} before `{activate}`"
    assert "$(BIN)/trainbench prepare" in (REPO / "Makefile").read_text()  # make demo's trainbench is .venv/bin's
    text = " ".join(lines)
    data, results = make_variable("DEMO_DATA"), make_variable("DEMO_RESULTS")
    assert f"{results}/*-bert-tiny/" in text and data == "data/bert-tiny", (data, results)
    readme = (REPO / "README.md").read_text()
    before = readme.split(activate, 1)[0]
    assert not re.search(r"^trainbench ", before, re.M), "a command before the README says how to reach trainbench"


def test_no_document_or_message_installs_trainbench_by_its_name_on_the_package_index():
    # The name on the package index is another project's: extras install from the clone (pip install -e '.[fp8]').
    files = [REPO / "README.md", REPO / "Makefile", *REPO.glob("docs/**/*.md"), *REPO.glob("src/**/*.py"),
             *REPO.glob("perf/*.py"), *REPO.glob("containers/*")]  # fmt: skip
    bare = re.compile(r"pip install\s+(-\S+\s+)*['\"]?trainbench\b")
    found = [f"{f.relative_to(REPO)}: {m.group(0)}" for f in files if f.is_file() for m in bare.finditer(f.read_text())]
    assert not found, found


@pytest.mark.full
def test_the_quick_start_runs_as_typed_after_make_demo(tmp_path, tiny_data, converged):
    venv = Path(sys.prefix)
    if venv == Path(sys.base_prefix) or not (venv / "bin" / "activate").exists():
        pytest.skip("the tests do not run in a virtual environment: no .venv/bin/activate to stand for make demo's")
    if not (venv / "bin" / "trainbench").exists():
        pytest.skip(f"{venv} has no trainbench command (pip install -e . there makes it)")
    # What `make demo` leaves in a fresh clone: .venv, the tiny data, one finished run in results/.
    (tmp_path / "data").mkdir()
    os.symlink(tiny_data, tmp_path / "data" / "bert-tiny")
    shutil.copytree(converged, tmp_path / "results" / converged.name)
    os.symlink(venv, tmp_path / make_variable("VENV"))
    script = "\n".join(["set -euo pipefail", *quick_start()[1:]])
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"{converged.name}/result_0.txt: SUCCESS" in proc.stdout.replace("\n", "")
    assert (tmp_path / "results" / "lora-tiny" / "report.html").exists()
