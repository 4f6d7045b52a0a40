"""The `trainbench` command: list, prepare, run, check."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainbench.data.text import WIKI_DUMP_URL
from trainbench.errors import Preempted, UserError

EXAMPLES_RUN = """examples:
  trainbench run bert --preset tiny data.dir=data/bert-tiny
  trainbench run bert --preset tiny --nproc 2 --nexp 3 data.dir=data/bert-tiny optimizer.lr=3e-3
  trainbench run bert --preset large --config my_system.yaml init_checkpoint=model.ckpt-28252.pt
  trainbench run bert --preset tiny --help-config      (every key, its type, default and meaning)

overrides are key=value; a key is its dotted path (optimizer.lr) or, where unambiguous, its last part (lr).
"""


WIKI_DUMP = "enwiki-*-pages-articles*.xml.bz2; the latest is at " + WIKI_DUMP_URL
EXAMPLES_SUBMIT = """examples:
  trainbench submit bert --system dgxh100_8x8 --nexp 10 data.dir=/lustre/bert
  trainbench submit bert --system dgxh100_1x8 --nodes 2 --time 00:45:00 --dry-run data.dir=/data/bert
  trainbench submit bert --preset tiny --system local_cpu_1x2 data.dir=data/bert-tiny

systems: the YAML files in ./systems/ and the built-in ones (trainbench submit --system ? lists them).
"""
EXAMPLES_PREPARE = """examples:
  trainbench prepare bert --synthetic --preset tiny --out data/bert-tiny
  trainbench prepare bert --input enwiki-20200101-pages-articles-multistream.xml.bz2 \\
      --vocab vocab.txt --out data/bert-wiki
  trainbench prepare bert --input results4/ --vocab vocab.txt --out data/bert --formats fixed,varlength,packed
  trainbench prepare bert --input wikitext-2/ --train-vocab 8000 --num-shards 16 --eval-samples 1000 --out data/wt2

an interrupted run continues with the same command plus --resume.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainbench",
        description="MLPerf-Training-style benchmarks end to end: prepare data, train to target, "
        "log in the MLPerf format, check compliance.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("list", help="list benchmarks and their presets", description="List benchmarks and presets.")

    prep = sub.add_parser(
        "prepare",
        help="write a benchmark's dataset to disk",
        description="Write a benchmark's dataset in the on-disk format its trainer reads: from raw text "
        "(--input) or synthetic (--synthetic).",
        epilog=EXAMPLES_PREPARE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prep.add_argument("benchmark", help="benchmark name (see `trainbench list`)")
    prep.add_argument("--out", required=True, help="output folder (train/, eval/, vocab.txt, manifest.json)")
    prep.add_argument("--seed", type=int, default=12345, help="random seed (default 12345, as MLPerf's)")
    prep.add_argument("--force", action="store_true", help="replace a folder that already holds other data")
    prep.add_argument("--eval-samples", type=int, help="eval samples (raw text: default 10000; synthetic: by preset)")
    prep.add_argument(
        "--num-shards", "--shards", dest="shards", type=int, help="training shards (raw text: default 4320)"
    )
    raw = prep.add_argument_group("from raw text")
    raw.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help=f"text files or folders: a Wikipedia dump ({WIKI_DUMP}), results4 files, or WikiText",
    )
    raw.add_argument("--input-format", default="auto", help="auto (default), wiki-xml, results4 or wikitext")
    raw.add_argument("--vocab", help="WordPiece vocab.txt (MLPerf: the uncased BERT vocabulary, 30,522 tokens)")
    raw.add_argument("--train-vocab", type=int, metavar="SIZE", help="train a vocabulary of SIZE tokens instead")
    raw.add_argument("--workers", type=int, default=0, help="worker processes (default: all cores)")
    raw.add_argument("--max-memory-gb", type=float, help="memory bound: fewer workers run when it is low")
    raw.add_argument("--chunk-mb", type=float, default=4.0, help="raw text per work unit in MB (default 4)")
    raw.add_argument(
        "--formats",
        default="fixed,varlength",
        help="comma list of fixed, varlength, bins (4-bin split by length), packed (default fixed,varlength)",
    )
    raw.add_argument("--eval-fraction", type=float, default=0.01, help="documents held out for eval (default 0.01)")
    raw.add_argument("--max-seq-length", type=int, default=512, help="tokens per sample (default 512)")
    raw.add_argument("--max-predictions", type=int, default=76, help="masked tokens per sample at most (default 76)")
    raw.add_argument("--masked-lm-prob", type=float, default=0.15, help="fraction of tokens masked (default 0.15)")
    raw.add_argument("--short-seq-prob", type=float, default=0.1, help="chance of a shorter target (default 0.1)")
    raw.add_argument("--dupe-factor", type=int, default=10, help="passes over the documents (default 10)")
    raw.add_argument("--max-per-pack", type=int, default=3, help="sequences per packed row at most (default 3)")
    raw.add_argument("--resume", action="store_true", help="continue an interrupted preparation in --out")
    raw.add_argument("--keep-work", action="store_true", help="keep the intermediate files (OUT/.work)")
    raw.add_argument("--no-progress", action="store_true", help="no progress bar")
    syn = prep.add_argument_group("synthetic")
    syn.add_argument(
        "--synthetic",
        action="store_true",
        help="generate seeded synthetic data with learnable structure (no download needed)",
    )
    syn.add_argument("--preset", default="tiny", help="preset whose shapes (seq length, vocab) the data takes")
    syn.add_argument("--train-samples", type=int, help="training samples (default: by preset)")
    llm = prep.add_argument_group("LLM benchmarks (gpt3, llama31_8b)")
    llm.add_argument("--source", metavar="C4_DIR", help="folder of C4 json(.gz) files (c4-train.*, c4-validation.*)")
    llm.add_argument("--tokenizer", metavar="tokenizer.json", help="HF tokenizer file used to tokenise --source")
    llm.add_argument("--eod-token", help="end-of-document token appended to each document (default: the tokenizer's)")
    llm.add_argument("--train-tokens", type=int, help="synthetic: training tokens (default 2,000,000)")

    run = sub.add_parser(
        "run",
        help="train a benchmark to its target and write MLPerf logs",
        description="Train a benchmark to its quality target; write the MLPerf log, "
        "metrics and config into a new results folder, then check the log's compliance.",
        epilog=EXAMPLES_RUN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("benchmark", help="benchmark name (see `trainbench list`)")
    run.add_argument("--preset", default="tiny", help="starting config (default: tiny)")
    run.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE.yaml",
        help="YAML file of overrides (nested or dotted keys); may repeat, applied in order",
    )
    run.add_argument("--nproc", type=int, help="processes on this node (GPUs or CPU ranks); >1 uses torchrun")
    run.add_argument("--nexp", type=int, default=1, help="experiments to run, seeds seed..seed+K-1 (default 1)")
    run.add_argument("--help-config", action="store_true", help="print every config key with its value and exit")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")

    subm = sub.add_parser(
        "submit",
        help="write an sbatch script for a system and submit it to Slurm",
        description="Write the sbatch script for BENCH on a system (systems/NAME.yaml), check the request "
        "against the cluster (sinfo), and submit it. The results folder holds the script, config and logs.",
        epilog=EXAMPLES_SUBMIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subm.add_argument("benchmark", help="benchmark name (see `trainbench list`)")
    subm.add_argument("--system", required=True, help="system name (systems/NAME.yaml or built in) or a YAML path")
    subm.add_argument("--preset", default="large", help="starting config (default: large)")
    subm.add_argument("--config", action="append", default=[], metavar="FILE.yaml", help="YAML overrides; may repeat")
    subm.add_argument("--nodes", type=int, help="nodes (default: the system's)")
    subm.add_argument("--time", help="time limit HH:MM:SS (default: the system's)")
    subm.add_argument("--nexp", type=int, default=1, help="experiments: a job array of K runs (default 1)")
    subm.add_argument("--dry-run", action="store_true", help="write and print the script; do not submit")
    subm.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")

    rep = sub.add_parser(
        "report",
        help="score a results folder and write report.html/report.md (two folders: compare them)",
        description="Score the runs of a results folder (time to train, samples, throughput, energy, "
        "compliance, the MLPerf olympic mean) and write report.md and a self-contained report.html with "
        "plots into it. Given two folders, compare them side by side (B/A).",
    )
    rep.add_argument("folders", nargs="+", metavar="RESULTS_DIR", help="one results folder, or two to compare")

    pkg = sub.add_parser(
        "package",
        help="lay a results folder out as an MLPerf submission package and run the package checker",
        description="Copy the MLPerf logs into <org>/results/<system>/<benchmark>/ and write "
        "<org>/systems/<system>.json, then run mlperf-logging's package checker on it.",
    )
    pkg.add_argument("folder", metavar="RESULTS_DIR")
    pkg.add_argument("--org", required=True, help="submitting organisation (a folder name)")
    pkg.add_argument("--system", required=True, help="system name (a folder name)")
    pkg.add_argument("--out", default="submission", help="where to write the package (default ./submission)")

    conv = sub.add_parser(
        "convert",
        help="convert a reference checkpoint to trainbench's format",
        description="Convert MLPerf's TensorFlow BERT checkpoint (needs `pip install 'trainbench[tf]'`) into a "
        "state dict for model.init_checkpoint. HF safetensors weights need no conversion.",
    )
    conv.add_argument("benchmark", help="benchmark name (bert)")
    conv.add_argument("--tf-checkpoint", required=True, help="checkpoint prefix, e.g. model.ckpt-28252")
    conv.add_argument("--out", required=True, help="output .pt file")

    check = sub.add_parser(
        "check",
        help="run mlperf-logging's compliance checker on finished runs",
        description="Check MLPerf logs with mlperf-logging's compliance checker.",
    )
    check.add_argument("path", help="a results folder (checks every result_*.txt) or one log file")
    check.add_argument("--ruleset", help="compliance ruleset (default: the benchmark's)")
    return p


def cmd_list(_args) -> int:
    from trainbench.benchmarks import BENCHMARKS

    rows = [[b.name, b.mlperf_name, ", ".join(b.presets), b.description] for b in BENCHMARKS.values()]
    _print_table("trainbench benchmarks", ["benchmark", "MLPerf name", "presets", "description"], rows)
    return 0


def cmd_prepare(args) -> int:
    if args.benchmark in ("gpt3", "llama31_8b"):
        return _prepare_llm(args)
    if args.benchmark != "bert":
        from trainbench.benchmarks import get_benchmark

        bench = get_benchmark(args.benchmark)  # an unknown name fails here with the list of known ones
        raise UserError(f"`trainbench prepare {bench.name}` is not available yet; `prepare bert` is")
    if args.synthetic == bool(args.input):
        raise UserError("give --input PATH (raw text) or --synthetic, one of the two")
    if args.input:
        return _prepare_bert_text(args)  # no torch import: workers start faster
    from trainbench.benchmarks import get_benchmark

    return _prepare_bert_synthetic(args, get_benchmark("bert"))


def _prepare_llm(args) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from trainbench.console import console
    from trainbench.data import prepare_llm as p

    if args.synthetic == bool(args.source):
        raise UserError("give --source C4_DIR (with --tokenizer) or --synthetic, one of the two")
    out = Path(args.out)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
               TimeRemainingColumn()]  # fmt: skip
    if args.synthetic:
        from trainbench.benchmarks import get_benchmark

        cfg = get_benchmark(args.benchmark).config(args.preset)
        spec = p.SyntheticLMSpec(vocab_size=cfg.model.vocab_size, train_tokens=args.train_tokens or 2_000_000,
                                 eval_tokens=200_000, seed=args.seed)  # fmt: skip
        if (out / "manifest.json").exists():
            if json.loads((out / "manifest.json").read_text()).get("spec") == spec.__dict__:
                console.print(f"{out} already holds this data set (manifest.json matches); nothing to do")
                return 0
            if not args.force:
                raise UserError(f"{out} already holds a different data set; choose another --out or add --force")
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("synthetic tokens", total=spec.train_tokens + spec.eval_tokens)
            m = p.prepare_synthetic_lm(out, spec, progress=lambda done, total: progress.update(task, completed=done))
        floor = m["loss_floor_nats"]
        console.print(
            f"wrote {spec.train_tokens:,} training and {spec.eval_tokens:,} eval tokens to {out} "
            f"(vocab {spec.vocab_size}; best possible log perplexity {floor:.3f})"
        )
        return 0
    if not args.tokenizer:
        raise UserError("--source needs --tokenizer tokenizer.json")
    workers = args.workers or p.default_workers()
    with Progress(*columns, console=console, transient=True, disable=args.no_progress) as progress:
        task = progress.add_task(f"tokenising with {workers} workers (MB of input)", total=None)

        def update(done, total):
            progress.update(task, completed=done / 1e6, total=total / 1e6)

        m = p.prepare_c4(Path(args.source), out, Path(args.tokenizer), workers, args.eod_token, progress=update)
    console.print(f"{m['documents']:,} documents, {m['tokens']:,} tokens into {out}/train and {out}/eval "
                  f"(EOD id {m['eod_id']}, vocab {m['vocab_size']})")  # fmt: skip
    return 0


def _prepare_bert_text(args) -> int:
    from trainbench.console import console
    from trainbench.data.prepare_bert import Options, prepare

    spec_args = {
        "seed": args.seed,
        "max_seq_length": args.max_seq_length,
        "max_predictions": args.max_predictions,
        "masked_lm_prob": args.masked_lm_prob,
        "short_seq_prob": args.short_seq_prob,
        "dupe_factor": args.dupe_factor,
        "num_shards": 4320 if args.shards is None else args.shards,
        "eval_samples": 10000 if args.eval_samples is None else args.eval_samples,
        "eval_fraction": args.eval_fraction,
        "chunk_mb": args.chunk_mb,
        "formats": [f.strip() for f in args.formats.split(",") if f.strip()],
        "max_per_pack": args.max_per_pack,
    }
    opts = Options(
        workers=args.workers,
        max_memory_gb=args.max_memory_gb,
        resume=args.resume,
        force=args.force,
        keep_work=args.keep_work,
        progress=not args.no_progress,
    )
    m = prepare(args.input, args.out, args.vocab, spec_args, opts, args.train_vocab, args.input_format)
    st, inp = m["statistics"], m["input"]
    console.print(
        f"{inp['text_characters'] / 1e6:,.1f} MB of text ({inp['documents']:,} documents, {inp['tokens']:,} tokens) "
        f"-> {st['train_samples']:,} training samples in {m['spec']['num_shards']:,} shards and "
        f"{st['eval_samples']:,} eval samples, in {m['run']['seconds']:.1f} s with {m['run']['workers']} workers "
        f"({inp['text_characters'] / 1e6 / max(m['run']['seconds'], 1e-9):.2f} MB/s)"
    )
    console.print(
        f"mean length {st['mean_sequence_length']:.1f} tokens; by length {st['samples_by_length_bin']}; "
        f"masked {st['masked_fraction']:.4f}; random next {st['random_next_fraction']:.4f}"
    )
    console.print(f"data: {args.out}  (manifest: {Path(args.out) / 'manifest.json'})")
    return 0


def _prepare_bert_synthetic(args, bench) -> int:
    from rich.progress import Progress

    from trainbench.benchmarks.bert import SYNTHETIC_SIZES
    from trainbench.console import console
    from trainbench.data.synthetic_bert import SyntheticSpec, prepare_synthetic

    cfg = bench.config(args.preset)
    sizes = dict(SYNTHETIC_SIZES[args.preset])
    for key, value in (
        ("num_train_samples", args.train_samples),
        ("num_eval_samples", args.eval_samples),
        ("num_shards", args.shards),
    ):
        if value is not None:
            if value < 1:
                raise UserError(f"--{key.removeprefix('num_').replace('_', '-')} must be at least 1, got {value}")
            sizes[key] = value
    spec = SyntheticSpec(
        seq_length=cfg.data.seq_length,
        max_predictions=cfg.data.max_predictions,
        vocab_size=cfg.model.vocab_size,
        seed=args.seed,
        **sizes,
    )
    out = Path(args.out)
    manifest = out / "manifest.json"
    if manifest.exists():
        existing = json.loads(manifest.read_text()).get("spec")
        if existing == spec.__dict__:
            console.print(f"{out} already holds this data set (manifest.json matches); nothing to do")
            return 0
        if not args.force:
            raise UserError(f"{out} already holds a different data set; choose another --out or add --force")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"writing {spec.num_shards} shards", total=spec.num_shards + 1)
        written = prepare_synthetic(out, spec, progress=lambda done, total: progress.update(task, completed=done))
    console.print(
        f"wrote {written['train_samples']:,} training samples in {spec.num_shards} shards and "
        f"{written['eval_samples']:,} eval samples to {out} (seq {spec.seq_length}, "
        f"{spec.max_predictions} predictions, vocab {spec.vocab_size})"
    )
    return 0


def cmd_run(args) -> int:
    from trainbench.config import describe, parse_key_values
    from trainbench.console import console
    from trainbench.launch.local import build_config, run_experiments

    overrides = parse_key_values(args.overrides)
    if args.nproc is not None:
        overrides["distributed.nproc"] = str(args.nproc)
    if args.help_config:
        _, cfg = build_config(args.benchmark, args.preset, args.config, {})
        console.print(f"config keys of {args.benchmark} --preset {args.preset}:\n{describe(cfg)}")
        return 0
    bench, cfg = build_config(args.benchmark, args.preset, args.config, overrides)
    run_dir, records = run_experiments(bench, cfg, args.nexp)
    ok = all(r.outcome and r.outcome["status"] == "success" and r.compliance and r.compliance.ok for r in records)
    finished = [r.outcome for r in records if r.outcome]
    if finished:
        times = ", ".join(f"{o['time_to_train_min']:.3f}" for o in finished)
        console.print(f"time to train (minutes): {times}")
    console.print(f"results: {run_dir}  (summary: {run_dir / 'summary.json'})")
    return 0 if ok else 1


def cmd_submit(args) -> int:
    import dataclasses

    from trainbench.config import parse_key_values
    from trainbench.console import console
    from trainbench.launch.local import build_config
    from trainbench.launch.slurm import submit
    from trainbench.launch.systems import fit_micro_batch, load_system

    system = load_system(args.system)
    changes = {}
    if args.nodes is not None:
        changes["nodes"] = args.nodes
    if args.time is not None:
        changes["time"] = args.time
    if changes:
        system = dataclasses.replace(system, **changes)
        system.validate()
    overrides = parse_key_values(args.overrides)
    overrides.setdefault("device", system.device)
    bench, cfg = build_config(args.benchmark, args.preset, args.config, overrides)
    cfg = fit_micro_batch(cfg, system)
    command = ["trainbench", *(sys.argv[1:] if sys.argv[1:2] == ["submit"] else ["submit", args.benchmark])]
    run_dir, script, job_id = submit(bench, cfg, system, args.nexp, args.dry_run, command)
    layout = system.naming(cfg.data.global_batch_size, cfg.data.micro_batch_size)
    if args.dry_run:
        console.print(script, markup=False, highlight=False)
        console.print(
            f"dry run: {layout} on {system.name}; script written to {run_dir / 'submit.sbatch'}, not submitted"
        )
    else:
        console.print(
            f"submitted job {job_id}: {bench.name}/{cfg.preset}, {layout} on {system.name}, "
            f"{args.nexp} run(s); results: {run_dir}"
        )
    return 0


def _print_table(title: str, head: list[str], rows: list[list[str]]) -> None:
    from rich.table import Table

    from trainbench.console import console

    table = Table(title=title)
    for h in head:
        table.add_column(h)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def cmd_report(args) -> int:
    from trainbench.console import console
    from trainbench.report.render import compare, score_table, write_report

    if len(args.folders) > 2:
        raise UserError("give one results folder to report on, or two to compare")
    for folder in args.folders:
        if not Path(folder).is_dir():
            raise UserError(f"results folder {folder} does not exist")
    if len(args.folders) == 2:
        _print_table("comparison", *compare(Path(args.folders[0]), Path(args.folders[1])))
        return 0
    md, page, score = write_report(Path(args.folders[0]))
    _print_table(str(args.folders[0]), *score_table(score))
    if score.score_min is not None:
        console.print(f"score: {score.score_min:.3f} minutes ({score.reason})")
    else:
        console.print(f"no valid score: {score.reason}")
    console.print(f"report: {page}  (and {md.name})")
    return 0


def cmd_package(args) -> int:
    from trainbench.console import console
    from trainbench.report.package import check_package, make_package

    root = make_package(Path(args.folder), Path(args.out), args.org, args.system)
    summary = Path(args.folder) / "summary.json"
    ruleset = json.loads(summary.read_text()).get("ruleset", "5.0.0") if summary.exists() else "5.0.0"
    code, output = check_package(root, ruleset)
    (root / "package_checker.log").write_text(output)
    errors = [ln.removeprefix("ERROR - ").strip() for ln in output.splitlines() if ln.startswith("ERROR")]
    passed = [ln.removeprefix("INFO - ").strip() for ln in output.splitlines() if "checker passed" in ln]
    console.print(f"package: {root}")
    for line in passed:
        console.print(f"  passed: {line}", style="green")
    for line in errors:
        console.print(f"  error: {line}", style="red", markup=False)
    verdict = "no errors" if not errors and code == 0 else f"{len(errors)} error(s)"
    console.print(f"mlperf-logging package checker (ruleset {ruleset}): {verdict}; log: {root / 'package_checker.log'}")
    return 0 if not errors and code == 0 else 1


def cmd_convert(args) -> int:
    from trainbench.console import console
    from trainbench.convert import convert_bert

    if args.benchmark != "bert":
        raise UserError(f"`trainbench convert {args.benchmark}` is not available; `convert bert` is")
    state = convert_bert(args.tf_checkpoint, args.out)
    params = sum(t.numel() for t in state.values())
    console.print(
        f"wrote {args.out}: {len(state)} tensors, {params / 1e6:.2f}M parameters; "
        f"use it with model.init_checkpoint={args.out}"
    )
    return 0


def cmd_check(args) -> int:
    from trainbench.console import console
    from trainbench.launch.local import load_run_config
    from trainbench.mlperf import check_compliance

    path = Path(args.path)
    if path.is_dir():
        logs = sorted(path.glob("result_*.txt"))
        partial = sorted(path.glob("result_*.txt.partial"))
        for p in partial:
            console.print(f"{p.name}: run did not finish (no run_stop); not checked", style="yellow")
        if not logs:
            raise UserError(f"{path} holds no finished MLPerf log (result_*.txt)")
        config = path / "config.yaml"
        waived = frozenset()
        if config.exists():
            bench, cfg = load_run_config(config)
            waived = bench.waived_checks(cfg)
        ruleset = args.ruleset or (bench.ruleset if config.exists() else None)
    elif path.is_file():
        logs = [path]
        ruleset = args.ruleset
        waived = frozenset()
    else:
        raise UserError(f"{path} does not exist")
    if ruleset is None:
        from trainbench.benchmarks import BENCHMARKS

        ruleset = _ruleset_from_log(logs[0], BENCHMARKS)
    failures = 0
    for log in logs:
        result = check_compliance(log, ruleset, waived=waived)
        failures += not result.ok
        console.print(f"{log}: {result.reason()} (ruleset {ruleset})", style="green" if result.ok else "red")
    return 1 if failures else 0


def _ruleset_from_log(log: Path, benchmarks) -> str:
    for line in log.read_text().splitlines():
        if '"submission_benchmark"' in line:
            name = json.loads(line.split(":::MLLOG", 1)[1])["value"]
            for b in benchmarks.values():
                if b.mlperf_name == name:
                    return b.ruleset
    raise UserError(f"{log}: no known submission_benchmark in the log; pass --ruleset")


COMMANDS = {
    "list": cmd_list,
    "prepare": cmd_prepare,
    "run": cmd_run,
    "submit": cmd_submit,
    "report": cmd_report,
    "package": cmd_package,
    "convert": cmd_convert,
    "check": cmd_check,
}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # key=value overrides may come before or after options; argparse leaves the later ones unparsed.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if args.command not in ("run", "submit") or "=" not in a or a.startswith("-")]
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
        return 130


if __name__ == "__main__":
    sys.exit(main())
