"""What reads a results folder: `trainbench report` (a report, a comparison, an index or an export), `package` (an
MLPerf submission package and its checker) and `check` (the compliance checker on finished logs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainbench.cli.common import print_table
from trainbench.errors import UserError


def add_report_parser(sub) -> None:
    rep = sub.add_parser(
        "report",
        help="report on a results folder (two: compare them; a folder of many: an index; or export them)",
        description="Score the runs of a results folder (time to train, samples, throughput, energy, "
        "compliance, the MLPerf olympic mean) and write report.md and a self-contained report.html with "
        "a headline card and plots into it. Given two folders, write an HTML page that compares them (their "
        "cards, the figures with B/A, their curves overlaid, what differs in their configs and machines). Given a "
        "folder of many run and bench folders, write each one's report and index.html linking them. With "
        "--export, write the runs' metrics, configs and results for TensorBoard or MLflow instead.",
        epilog="examples:\n  trainbench report results/20261123T101500Z-bert-tiny\n"
        "  trainbench report results/A results/B --out a_vs_b.html\n  trainbench report results/\n"
        "  trainbench report results/ --export tensorboard tb/      (then: tensorboard --logdir tb/)\n"
        "  trainbench report results/ --export mlflow mlruns/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("folders", nargs="+", metavar="RESULTS_DIR",
                     help="one results folder, two to compare, or a folder of many to index")  # fmt: skip
    rep.add_argument("--out", metavar="FILE", help="where to write a comparison's page (default: "
                     "compare_<A>_vs_<B>.html in the working folder)")  # fmt: skip
    rep.add_argument("--allow-different", action="store_true",
                     help="compare two folders of different benchmarks (refused without it)")  # fmt: skip
    rep.add_argument("--export", nargs=2, metavar=("TOOL", "DIR"),
                     help="write every run of the folders for TOOL (tensorboard: event files under DIR; mlflow: DIR "
                     "as MLflow's file store, or a tracking URI such as sqlite:///mlflow.db) instead of the "
                     "reports; a run already in DIR is passed by")  # fmt: skip


def add_package_parser(sub) -> None:
    pkg = sub.add_parser(
        "package",
        help="lay a results folder out as an MLPerf submission package and run the package checker",
        description="Copy the MLPerf logs into <org>/results/<system>/<benchmark>/, write "
        "<org>/systems/<system>.json from what the runs recorded of their nodes (a field nothing recorded stays "
        "empty and is named) and <org>/benchmarks/<benchmark>/implementations/trainbench-<version>/ (trainbench's "
        "source and the runs' resolved config), then run mlperf-logging's package checker on it.",
    )
    pkg.add_argument("folder", metavar="RESULTS_DIR")
    pkg.add_argument("--org", required=True, help="submitting organisation (a folder name)")
    pkg.add_argument("--system", required=True, help="system name (a folder name)")
    pkg.add_argument("--out", default="submission", help="where to write the package (default ./submission)")
    pkg.add_argument("--ruleset", help="ruleset of the package checker (default: the one the runs followed)")
    pkg.add_argument(
        "--system-desc",
        metavar="FILE.json",
        help="the system description's fields (systems/<system>.json) to use over what the runs recorded",
    )


def add_check_parser(sub) -> None:
    check = sub.add_parser(
        "check",
        help="run mlperf-logging's compliance checker on finished runs",
        description="Check MLPerf logs with mlperf-logging's compliance checker.",
    )
    check.add_argument("path", help="a results folder (checks every result_*.txt) or one log file")
    check.add_argument("--ruleset", help="compliance ruleset (default: the one the runs followed)")


def cmd_report(args) -> int:
    from trainbench.console import console
    from trainbench.report import bench_report, index
    from trainbench.report.render import score_table, write_report

    folders = [Path(f) for f in args.folders]
    for folder in folders:
        if not folder.is_dir():
            raise UserError(f"results folder {folder} does not exist")
    if args.export:
        return _export(args.export, folders)
    if len(folders) > 2:
        raise UserError("give one results folder to report on, two to compare, or a folder of many to index "
                        "(or --export them)")  # fmt: skip
    if args.out and len(folders) == 1:
        raise UserError("--out names a comparison's page: give two folders to compare with it")
    if len(folders) == 2:
        from trainbench.report import compare

        page, head, rows, other = compare.write(folders[0], folders[1], Path(args.out) if args.out else None,
                                         args.allow_different)  # fmt: skip
        measured = bench_report.is_bench(folders[0])
        print_table("comparison" + (" of throughput measurements" if measured else ""), head, rows)
        if other:
            console.print(f"note: {other}", markup=False)
        console.print(f"comparison: {page}")
        return 0
    folder = folders[0]
    if not index.is_results(folder) and index.results_under(folder):
        page, rows = index.write(folder)
        print_table(f"{len(rows)} folders under {folder}", ["folder", "benchmark", "date", "status", "figure"],
                     [[r.folder.relative_to(folder).as_posix(), *_index_cells(r)] for r in rows])  # fmt: skip
        console.print(f"index: {page}  (and each folder's report.html)")
        return 0
    if bench_report.is_bench(folder):
        md, page, result = bench_report.write(folder)
        print_table(bench_report.heading(result), ["figure", "value"], bench_report.rows(result))
        console.print(f"hardware: {bench_report.hardware_line(result)}", markup=False)
        console.print(f"report: {page}  (and {md.name})")
        return 0
    md, page, score, headline = write_report(folder)
    print_table(str(folder), *score_table(score))
    console.print(f"{headline.figure} — {headline.what}", markup=False)
    for label, text in headline.lines:
        console.print(f"  {label}: {text}", markup=False)
    console.print(f"report: {page}  (and {md.name})")
    return 0


def _index_cells(row) -> list[str]:
    h = row.headline
    if h is None:
        return ["", "", f"cannot be reported: {row.error}", ""]
    return [f"{h.benchmark}/{h.preset}", h.date, h.status, h.figure]


def _export(how: list[str], folders: list[Path]) -> int:
    from trainbench.console import console
    from trainbench.report import index
    from trainbench.report.export import export

    tool, dest = how
    pairs = []
    for folder in folders:
        if index.is_results(folder):
            pairs.append((folder, folder.resolve().name))
            continue
        under = index.results_under(folder)
        if not under:
            raise UserError(f"{folder} holds no runs and no run or bench folders; give the folder `trainbench run` or "
                            "`bench` printed, or the results folder above them")  # fmt: skip
        pairs += [(f, f.relative_to(folder).as_posix()) for f in under]
    done = export(tool, dest, pairs)
    unfinished = f", {len(done.unfinished)} not finished (left for a later export)" if done.unfinished else ""
    console.print(f"{tool}: {len(done.written)} run(s) written to {dest}, {len(done.skipped)} already there"
                  f"{unfinished}", markup=False)  # fmt: skip
    for failed in done.failed:
        console.print(f"warning: not exported: {failed}", markup=False)
    if tool == "tensorboard" and done.written:
        console.print(f"view them: tensorboard --logdir {dest}", markup=False)
    return 1 if done.failed else 0


def cmd_package(args) -> int:
    from trainbench.console import console
    from trainbench.report.bench_report import refuse
    from trainbench.report.package import check_package, empty_fields, make_package
    from trainbench.report.scoring import folder_benchmark
    from trainbench.runfiles import finished_logs

    refuse(Path(args.folder), "package")
    logs = finished_logs(Path(args.folder))
    if args.ruleset is not None and logs:
        _check_ruleset_for(logs[0], args.ruleset)
    package = make_package(Path(args.folder), Path(args.out), args.org, args.system, args.system_desc)
    root = package.root
    _, ruleset = folder_benchmark(Path(args.folder), logs)
    ruleset = args.ruleset or ruleset
    checked = check_package(root, ruleset, package.scaled_down)
    (root / "package_checker.log").write_text(checked.output)
    console.print(f"package: {root}")
    if package.required_runs is not None:
        short = package.runs < package.required_runs
        console.print(f"  runs: {package.runs} finished, of the {package.required_runs} a {package.benchmark} "
                      f"submission needs{' (run it with --nexp ' + str(package.required_runs) + ')' if short else ''}",
                      style="yellow" if short else None)  # fmt: skip
    for note in package.notes:
        console.print(f"  {note}", markup=False, style="yellow" if note.startswith("the runs") else None)
    console.print(f"  implementation: {package.implementation} (trainbench's source and the runs' config)",
                  markup=False)  # fmt: skip
    desc_path = root / "systems" / f"{args.system}.json"
    empty = empty_fields(json.loads(desc_path.read_text()))
    if empty:
        console.print(f"  {desc_path.name}: {len(empty)} field(s) nothing recorded, empty: {', '.join(empty)}; fill "
                      "them in a copy and pass it as --system-desc", style="yellow", markup=False)  # fmt: skip
    for line in checked.passed:
        console.print(f"  passed: {line}", style="green", markup=False)
    for line in checked.warnings:
        console.print(f"  warning: {line}", style="yellow", markup=False)
    for line in checked.beyond_scale:
        console.print(f"  failed, as a scaled-down preset must: {line} (its samples to converge are measured against "
                      f"the full {package.benchmark} model's reference convergence points)", markup=False)  # fmt: skip
    for line in checked.errors:
        console.print(f"  error: {line}", style="red", markup=False)
    if checked.crashed:
        console.print("  error: the package checker gave no verdict: it stopped with an error, or printed no result "
                      "line (see its log)", style="red")  # fmt: skip
    if not checked.ok:
        verdict = f"{len(checked.errors) + checked.crashed} error(s)"
    elif checked.beyond_scale:
        verdict = "SUCCESS except the RCP check a scaled-down preset cannot pass"
    else:
        verdict = "no errors"
    verdict += f", {len(checked.warnings)} warning(s)" if checked.warnings else ""
    console.print(f"mlperf-logging package checker (ruleset {ruleset}): {verdict}; log: {root / 'package_checker.log'}")
    return 0 if checked.ok else 1


def cmd_check(args) -> int:
    from trainbench.console import console
    from trainbench.mlperf import check_compliance
    from trainbench.report.scoring import folder_config
    from trainbench.runfiles import CONFIG, finished_logs, partial_logs

    path = Path(args.path)
    if path.is_dir():
        from trainbench.report.bench_report import refuse

        refuse(path, "check")
        logs = finished_logs(path)
        for p in partial_logs(path):
            console.print(f"{p.name}: run did not finish (no run_stop); not checked", style="yellow")
        if not logs:
            raise UserError(f"{path} holds no finished MLPerf log (result_*.txt)")
        config = path / CONFIG
        waived = frozenset()
        if config.exists():
            bench, cfg = folder_config(config)
            waived = bench.waived_checks(cfg)
        ruleset = args.ruleset or (bench.ruleset_of(cfg) if config.exists() else None)
    elif path.is_file():
        logs = [path]
        ruleset = args.ruleset
        waived = frozenset()
    else:
        raise UserError(f"{path} does not exist")
    if args.ruleset is not None:
        _check_ruleset_for(logs[0], args.ruleset)
    if ruleset is None:
        ruleset = _ruleset_from_log(logs[0])
    from trainbench.benchmarks import is_own
    from trainbench.mlperf import submission_benchmark
    from trainbench.report.scoring import log_events

    failures = 0
    for log in logs:
        own = is_own(submission_benchmark(log_events(log)))
        result = check_compliance(log, ruleset, waived=waived, own=own)
        failures += not result.ok
        console.print(f"{log}: {result.reason()} (ruleset {ruleset})", style="green" if result.ok else "red")
    return 1 if failures else 0


def _check_ruleset_for(log: Path, ruleset: str) -> None:
    """``--ruleset`` must be one mlperf-logging has and, for a benchmark trainbench knows, one it follows."""
    from trainbench.benchmarks import by_mlperf_name
    from trainbench.mlperf import require_installed, submission_benchmark
    from trainbench.report.scoring import log_events

    bench = by_mlperf_name(submission_benchmark(log_events(log)) or "")
    if bench is not None:
        bench.check_ruleset(ruleset, "--ruleset")
    else:
        require_installed(ruleset, "--ruleset")


def _ruleset_from_log(log: Path) -> str:
    from trainbench.benchmarks import ruleset_of
    from trainbench.mlperf import submission_benchmark
    from trainbench.report.scoring import log_events

    return ruleset_of(submission_benchmark(log_events(log)), log, "pass --ruleset")
