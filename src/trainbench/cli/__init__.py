"""The `trainbench` command: the top parser, each command's subparser from its module (listing, data, run, bench,
results), and the dispatch to the command's handler."""

from __future__ import annotations

import argparse
import sys

from trainbench.cli import bench, data, listing, results, run
from trainbench.errors import Preempted, UserError


def _parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """The command line's parser; without ``benchmarks``, `prepare` names no benchmark (nothing imports them, nor
    torch: a request for help on anything but `prepare` needs none)."""
    p = argparse.ArgumentParser(
        prog="trainbench",
        description="MLPerf-Training-style benchmarks end to end: prepare data, train to target, "
        "log in the MLPerf format, check compliance.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    listing.add_list_parser(sub)
    data.add_prepare_parser(sub, p, benchmarks)
    run.add_run_parser(sub)
    bench.add_bench_parser(sub)
    run.add_submit_parser(sub)
    run.add_resubmit_parser(sub)
    results.add_report_parser(sub)
    results.add_package_parser(sub)
    data.add_convert_parser(sub)
    results.add_check_parser(sub)
    return p


COMMANDS = {
    "list": listing.cmd_list,
    "prepare": data.cmd_prepare,
    "run": run.cmd_run,
    "submit": run.cmd_submit,
    "resubmit": run.cmd_resubmit,
    "report": results.cmd_report,
    "package": results.cmd_package,
    "bench": bench.cmd_bench,
    "convert": data.cmd_convert,
    "check": results.cmd_check,
}


def _not_this_benchmarks(parser: argparse.ArgumentParser, benchmark: str, stray: list[str]) -> str:
    """One sentence for arguments ``prepare BENCHMARK`` does not take, naming the benchmarks whose option it is."""
    option = next((a.split("=", 1)[0] for a in stray if a.startswith("-")), None)
    if option is None:
        return f"trainbench prepare {benchmark} takes no argument {stray[0]!r} (its options: --help)"
    owners = [name for name, options in parser.prepare_options.items() if option in options]
    whose = f"an option of `prepare {' / '.join(owners)}`, not" if owners else "not an option"
    return f"{option} is {whose} of `trainbench prepare {benchmark}` (`--help` after it lists its options)"


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # Help, or the usage of a bare `trainbench`, is printed without importing the benchmarks (and torch, seconds).
    help_only = not words or (("-h" in words or "--help" in words) and words[:1] != ["prepare"])
    parser = _parser(benchmarks=not help_only)
    if parser.broken_hooks:
        from rich.markup import escape

        from trainbench.console import console

        wanted = words[1] if words[:1] == ["prepare"] and len(words) > 1 else None
        if wanted in parser.broken_hooks:
            console.print(f"[red]error:[/red] {escape(parser.broken_hooks[wanted])}")
            return 2
        for sentence in parser.broken_hooks.values():
            console.print(f"warning: {sentence}", style="yellow", markup=False)
    # key=value overrides may come before or after options; argparse leaves the later ones unparsed.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if args.command not in ("run", "submit", "bench") or "=" not in a or a.startswith("-")]
    if stray and args.command == "prepare":
        from rich.markup import escape

        from trainbench.console import console

        console.print(f"[red]error:[/red] {escape(_not_this_benchmarks(parser, args.benchmark, stray))}")
        return 2
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return COMMANDS[args.command](args)
    except Preempted as exc:
        from trainbench.console import console

        console.print(f"{exc}; continue with the same command plus resume=true")
        return Preempted.exit_code
    except UserError as exc:
        from rich.markup import escape

        from trainbench.console import console

        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    except KeyboardInterrupt:
        from trainbench.console import console

        console.print("interrupted (Ctrl-C)")
        return 130
    except OSError as exc:  # the machine refused: a full disk, a read-only or missing folder, a path that is a file
        from rich.markup import escape

        from trainbench.console import console

        where = f": {exc.filename}" if exc.filename else ""
        console.print(f"[red]error:[/red] {escape((exc.strerror or str(exc)) + where)}")
        return 1
