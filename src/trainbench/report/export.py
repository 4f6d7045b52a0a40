"""`trainbench report FOLDER... --export tensorboard|mlflow DIR`: the runs of results folders (and the figures of
throughput measurements) written for the tools teams already watch. Each run becomes one TensorBoard run
(``DIR/<folder>/run_<i>``) or one MLflow run (experiment ``trainbench/<benchmark>``): its training loss, rate and
learning rate and its evals against samples trained (the step), at the times the run logged them; its result (time
to train, final metric, samples, compliance, status) and its config; the hardware and trainbench version it
recorded. A run already exported to DIR is passed by, so a growing results folder can be exported again.

Both libraries are optional extras (``pip install -e '.[tensorboard]'``, ``'.[mlflow]'``); only what the folder
holds as text, JSON and YAML is read, as the reports read it."""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainbench.errors import UserError
from trainbench.report import bench_report
from trainbench.report.compare import flatten
from trainbench.report.headline import Headline, for_bench, for_runs, read_config
from trainbench.report.plots import metrics
from trainbench.report.scoring import RunScore, metric_name, read_job, read_summary, score_folder
from trainbench.runfiles import RunFiles

TOOLS = ("tensorboard", "mlflow")
SERIES = {"loss": "train/loss", "samples_per_s": "train/samples_per_s", "lr": "train/lr"}


@dataclass
class Exported:
    """What an export did: runs written, runs passed by (already in DIR), runs not finished (left for a later export),
    folders that could not be read."""

    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Record:
    """One run (or one measurement) as the export writes it."""

    name: str  # <folder>/run_<i>, or <folder> for a measurement
    source: str  # the folder's absolute path and the run: what says it was exported already
    benchmark: str
    series: dict[str, list[tuple[int, float, int | None]]]  # tag: (samples, value, Unix ms or None)
    results: dict[str, float]
    text: dict[str, str]  # status, compliance, hardware, trainbench, ...
    config: str
    config_keys: dict[str, str]
    files: list[Path]  # the config and the run's MLPerf log, as artifacts
    start_ms: int | None = None
    stop_ms: int | None = None
    ok: bool = True
    finished: bool = True


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) else None  # fmt: skip


def _ms(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None and 0 <= number < 1e14 else None


def records(folder: Path, name: str) -> list[Record]:
    """The runs of a results folder (or its measurement) as records."""
    config, loaded = read_config(folder)
    keys = flatten(loaded)
    if bench_report.is_bench(folder):
        result = bench_report.read(folder)
        headline = for_bench(folder, result)
        figures = {key: v for _, key in bench_report.FIGURES if (v := _number(result.get(key))) is not None}
        if result.get("projection"):
            figures["projected_minutes"] = float(result["projection"]["minutes"])
        results = {f"bench/{k}": v for k, v in figures.items()}
        files = [p for p in (folder / "bench.json", folder / "config.yaml") if p.is_file()]
        return [Record(name, f"{folder.resolve()}#bench", result["benchmark"], {}, results, _text(headline), config,
                       keys, files)]  # fmt: skip
    score, summary = score_folder(folder), read_summary(folder)
    headline = for_runs(folder, score, summary, read_job(folder))
    metric = metric_name(summary)
    rows = metrics(folder, metric)
    out = []
    for run in score.runs:
        mine = [r for r in rows if (r.get("run") or 0) == run.index and _number(r.get("samples")) is not None]
        series = {tag: [(int(r["samples"]), v, _ms(r.get("time_ms"))) for r in mine
                        if (v := _number(r.get(key))) is not None]
                  for key, tag in [*SERIES.items(), (metric, f"eval/{metric}")]}  # fmt: skip
        files = [p for p in (folder / "config.yaml", RunFiles(folder, run.index).log) if p.is_file()]
        out.append(Record(f"{name}/run_{run.index}", f"{folder.resolve()}#run_{run.index}", headline.benchmark,
                          {k: v for k, v in series.items() if v}, _results(run, metric), _text(headline, run), config,
                          keys, files, _ms(run.start_ms), _stop_ms(run), run.counts,
                          run.status != "unfinished"))  # fmt: skip
    return out


def _stop_ms(run: RunScore) -> int | None:
    if run.start_ms is None or run.time_to_train_min is None:
        return None
    return _ms(run.start_ms + run.time_to_train_min * 60_000)


def _results(run: RunScore, metric: str) -> dict[str, float]:
    values = {"result/time_to_train_min": run.time_to_train_min, f"result/final_{metric}": run.final_metric,
              "result/samples": run.samples, "result/train_samples_per_s": run.train_samples_per_s,
              "result/energy_kwh": (run.energy or {}).get("total_kwh"),
              "result/compliant": 1.0 if run.compliant else 0.0}  # fmt: skip
    return {k: v for k, raw in values.items() if (v := _number(raw)) is not None}


def _text(headline: Headline, run: RunScore | None = None) -> dict[str, str]:
    out = {"benchmark": headline.benchmark, "preset": headline.preset}
    if run is not None:
        out |= {"status": run.status, "compliance": "pass" if run.compliant else "fail",
                "compliance_reason": " ".join(run.compliance_reason.split())}  # fmt: skip
    out |= {{"trainbench": "version"}.get(label, label): text for label, text in headline.lines
            if label in ("hardware", "trainbench")}  # fmt: skip
    return out | {"folder_headline": f"{headline.figure}: {headline.what}"}


def folders_named(folders: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
    """The folders and the names they are exported under; two of one name are refused in one sentence."""
    seen: dict[str, Path] = {}
    for folder, name in folders:
        if name in seen:
            raise UserError(f"{seen[name]} and {folder} would both be exported as {name!r}: export them one at a time "
                            "to different folders")  # fmt: skip
        seen[name] = folder
    return folders


def export(tool: str, dest: str, folders: list[tuple[Path, str]]) -> Exported:
    """Every run of ``folders`` ((folder, name) pairs) written to ``dest`` for ``tool``."""
    if tool not in TOOLS:
        raise UserError(f"--export {tool!r}: give one of {', '.join(TOOLS)}")
    writer = _tensorboard(dest) if tool == "tensorboard" else _mlflow(dest)
    done = Exported()
    for folder, name in folders_named(folders):
        try:
            found = records(folder, name)
        except UserError as exc:
            if len(folders) == 1:
                raise
            done.failed.append(f"{folder}: {exc}")
            continue
        for record in found:
            if not record.finished:  # exported once it has ended: a run already in DIR is not written again
                done.unfinished.append(record.name)
                continue
            (done.written if writer(record) else done.skipped).append(record.name)
    return done


def _tensorboard(dest: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("--export tensorboard needs the tensorboard package: pip install -e '.[tensorboard]' in "
                        "trainbench's clone (or pip install tensorboard)") from None  # fmt: skip
    root = Path(dest)

    def write(record: Record) -> bool:
        logdir = root / record.name
        if logdir.is_dir() and any(logdir.glob("events.out.tfevents.*")):
            return False
        writer = SummaryWriter(log_dir=str(logdir))
        try:
            for tag, points in record.series.items():
                for step, value, ms in points:
                    writer.add_scalar(tag, value, step, walltime=None if ms is None else ms / 1000)
            last = max((p[0] for pts in record.series.values() for p in pts), default=0)
            for tag, value in record.results.items():
                writer.add_scalar(tag, value, last, walltime=None if record.stop_ms is None else record.stop_ms / 1000)
            result = "\n".join(f"- **{k}**: {_md(v)}" for k, v in record.text.items())
            writer.add_text("result", result, last)
            writer.add_text("config", "\n".join("    " + line for line in record.config.splitlines()), 0)
        finally:
            writer.close()
        return True

    return write


def _md(text: str) -> str:
    """Text shown, not rendered, by TensorBoard's Markdown (it sanitises HTML; links and emphasis are escaped)."""
    return re.sub(r"([\\`*_\[\]<>#|])", r"\\\1", text)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """The variables set for the export where the user has not set them, as they were afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if before[k] is None})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)


def tracking_uri(dest: str) -> str:
    """An MLflow tracking URI (``sqlite:///...``, ``http://...``) as given; a folder as its file store's URI."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", dest):
        return dest
    return Path(dest).resolve().as_uri()


def _mlflow(dest: str):
    try:
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise UserError("--export mlflow needs MLflow: pip install -e '.[mlflow]' in trainbench's clone (or pip "
                        "install mlflow-skinny)") from None  # fmt: skip
    uri = tracking_uri(dest)
    # A folder is MLflow's file store, which MLflow 3 keeps in maintenance mode behind this variable; and the
    # export sends nothing anywhere (MLflow's usage telemetry is off unless the user turned it on).
    env = {"MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    with _environ(**env):
        try:
            client = MlflowClient(tracking_uri=uri)
        except MlflowException as exc:
            raise UserError(f"MLflow cannot open {uri}: {' '.join(str(exc).split())[:300]}") from None
    experiments: dict[str, str] = {}
    exported: dict[str, set[str]] = {}

    def experiment(benchmark: str) -> str:
        name = f"trainbench/{benchmark}"
        if name not in experiments:
            found = client.get_experiment_by_name(name)
            experiments[name] = found.experiment_id if found else client.create_experiment(name)
            runs = client.search_runs([experiments[name]], max_results=50_000)
            exported[name] = {r.data.tags.get("trainbench.source") for r in runs}
        return experiments[name]

    def write(record: Record) -> bool:
        with _environ(**env):
            exp = experiment(record.benchmark)
            if record.source in exported[f"trainbench/{record.benchmark}"]:
                return False
            tags = {"trainbench.source": record.source, "mlflow.note.content": _note(record),
                    **{f"trainbench.{k}": v[:5000] for k, v in record.text.items()}}  # fmt: skip
            run = client.create_run(exp, start_time=record.start_ms, tags=tags, run_name=record.name)
            run_id = run.info.run_id
            stamp = record.start_ms or 0
            points = [Metric(tag, value, ms if ms is not None else stamp, step)
                      for tag, pts in record.series.items() for step, value, ms in pts]  # fmt: skip
            last = max((m.step for m in points), default=0)
            points += [Metric(tag, value, record.stop_ms or stamp, last) for tag, value in record.results.items()]
            params = [Param(_key(k), v[:6000]) for k, v in record.config_keys.items()]
            for i in range(0, len(points), 1000):
                client.log_batch(run_id, metrics=points[i : i + 1000])
            for i in range(0, len(params), 100):
                client.log_batch(run_id, params=params[i : i + 100])
            for path in record.files:
                client.log_artifact(run_id, str(path))
            client.set_terminated(run_id, "FINISHED" if record.ok else "FAILED", end_time=record.stop_ms)
            exported[f"trainbench/{record.benchmark}"].add(record.source)
        return True

    return write


def _key(key: str) -> str:
    """A config key as MLflow takes a parameter's name (letters, digits, _ - . space /)."""
    return re.sub(r"[^\w\-. /]", "_", key)[:250] or "_"


def _note(record: Record) -> str:
    return "\n".join(f"- **{k}**: {_md(v)}" for k, v in record.text.items())
