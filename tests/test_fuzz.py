"""1,000 generated command lines (config overrides, options, benchmark names, paths) end in exit 0 or in one
error sentence: never a traceback. No line can train: the data folders they name do not exist."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainbench.benchmarks import BENCHMARKS
from trainbench.cli import main as cli_main
from trainbench.config import leaves

KEYS = sorted({k for b in BENCHMARKS.values() for p in ("tiny",) for k in leaves(b.config(p))})
LEAF_NAMES = sorted({k.rsplit(".", 1)[-1] for k in KEYS})
VALUES = st.one_of(
    st.sampled_from(["", "0", "1", "-1", "2", "64", "1e-3", "-1e-3", "nan", "inf", "1e400", "true", "false", "none",
                     "auto", "fixed", "packed", "bf16", "cuda", "cpu", "bucket", "/nonexistent/data", "a\nb", "é"]),
    st.integers(-(10**9), 10**9).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=10),
)  # fmt: skip
OVERRIDE = st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS + LEAF_NAMES + ["nokey", "data.", ".lr"]), VALUES)
OPTION = st.one_of(
    st.sampled_from(["--nproc", "--nexp", "--preset", "--config", "--system", "--nodes", "--time"]).flatmap(
        lambda o: st.tuples(st.just(o), st.one_of(VALUES, st.sampled_from(["tiny", "large", "local_cpu_1x2", "2"])))
    ),
    st.tuples(st.sampled_from(["--help-config", "--dry-run", "--bogus"])),
)
LINE = st.tuples(
    st.sampled_from(["run", "submit", "check", "report", "package", "convert", "list"]),
    st.sampled_from([*BENCHMARKS, "nope", ""]),
    st.lists(st.one_of(OVERRIDE, OPTION), max_size=5),
)


def flatten(line) -> list[str]:
    command, bench, parts = line
    args = [command, bench]
    for part in parts:
        args.extend([part] if isinstance(part, str) else part)
    if command in ("run", "submit"):
        args += ["data.dir=/nonexistent/trainbench-data"]  # last: whatever else the line says, nothing trains
    if command == "submit" and "--system" not in args:
        args += ["--system", "local_cpu_1x2"]
    return args


HERE = tempfile.mkdtemp(prefix="tb-fuzz-")


@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(line=LINE)
def test_every_generated_command_line_ends_in_a_sentence_never_a_traceback(line):
    args = flatten(line)
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(HERE)  # what a line writes (a dry run's folder) lands here
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli_main(args)
            except SystemExit as exc:  # argparse: usage and one "error:" line, exit 2
                code = exc.code
    finally:
        os.chdir(cwd)
    text = out.getvalue() + err.getvalue()
    assert "Traceback" not in text, (args, text)
    assert code in (0, 1, 2, 3), (args, code, text)
    if code == 2:
        errors = [ln for ln in text.splitlines() if "error:" in ln]
        assert len(errors) == 1, (args, text)
