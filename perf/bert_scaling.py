"""BERT-large data-parallel scaling on one node, through `trainbench run` itself.

Prepares packed data from WikiText-2 with MLPerf's vocab (`trainbench prepare bert`), then trains the large preset
on packed rows with the speed switches on (compiled model, fused LAMB), 48 rows per GPU per step (96 in the `_b96`
configurations) and no accumulation (two micro-batches of 48 per step in the `_48x2` ones): on 1 GPU, then on N GPUs
with DDP (global batch 48 x N rows): plain (the compiled graph split at the DDP buckets), as one compiled graph that
all-reduces after backward (the trainer's choice on one node), with bucket-wise clipping, with the all-reduce in
bf16, with bf16 and 100 MB buckets, with NCCL held to 8 thread blocks (fewer SMs taken from backward), with NCCL's
Simple or LL128 protocol, with other garbage-collection and prefetch settings; and N independent one-GPU runs at
once (no communication at all: what the node gives when every GPU trains alone). Throughput is read from each run's
metrics.jsonl: samples/s per logging interval, the first intervals (compilation) left out.

    python perf/bert_scaling.py --out OUT --gpus 4 [--steps 80] [--data DIR] [--only NAME ...] [--profile]

Writes OUT/bert_scaling.json: samples/s and steps/s for each configuration, the scaling efficiency (N-GPU samples/s
divided by N times the 1-GPU samples/s at the same rows per GPU) and the step scaling efficiency (N-GPU steps/s
divided by 1-GPU steps/s, that is packed rows/s against N times one GPU's: it does not move with the number of
sequences per row, which differs between intervals by a few per cent). With --profile every run records steps 40-42
on every rank, and the report carries each rank's timeline (compute, exposed communication, idle per step; see
trainbench.train.profiling.timeline); rank 0's Chrome trace of each run is OUT/<config>_trace.json.gz.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainbench.telemetry import window_summary  # noqa: E402


def prepare(work: Path, data: Path) -> Path:
    prepared = work / "wikitext"
    if (prepared / "manifest.json").exists():
        return prepared
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    text = "".join((data / "text" / "wikitext-2" / n).read_text() for n in ("valid.txt", "test.txt"))
    for c in range(4):
        (corpus / f"wiki.{c}.txt").write_text(text)
    run([sys.executable, "-m", "trainbench", "prepare", "bert", "--input", str(corpus), "--vocab",
         str(data / "bert" / "vocab.txt"), "--out", str(prepared), "--num-shards", "8", "--eval-samples", "256",
         "--eval-fraction", "0.05", "--formats", "fixed,packed", "--no-progress"])  # fmt: skip
    return prepared


def env_with_src() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run(cmd: list[str], ok: tuple[int, ...] = (0,), env: dict[str, str] | None = None) -> None:
    print("+", " ".join(f"{k}={v}" for k, v in (env or {}).items()), " ".join(cmd), flush=True)
    code = subprocess.run(cmd, env=env_with_src() | (env or {})).returncode
    if code not in ok:
        raise SystemExit(f"exit code {code}: {' '.join(cmd)}")


def train_command(gpus: int, prepared: Path, results: Path, steps: int, extra: list[str], rows_per_gpu: int = 48,
                  profile: bool = False, accumulation: int = 1) -> list[str]:  # fmt: skip
    rows = rows_per_gpu * accumulation * gpus
    return [
        sys.executable, "-m", "trainbench", "run", "bert", "--preset", "large", "--nproc", str(gpus),
        f"data.dir={prepared}", "data.layout=packed", f"global_batch_size={rows}", f"micro_batch_size={rows_per_gpu}",
        "eval_samples=256", "eval.every_samples=100000000", f"schedule.max_samples={rows * steps}",
        "perf.compile=true", "log_every_steps=10", "progress=false", "telemetry_hz=1", "model.hidden_dropout=0.0",
        "model.attention_dropout=0.0", f"output.results_dir={results}", *extra,
    ] + (["profile=true", "profile_start_step=40", "profile_steps=3"] if profile else [])  # fmt: skip


def read_run(results: Path) -> dict:
    (run_dir,) = [d for d in results.iterdir() if d.is_dir()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in metrics if "samples_per_s" in m]
    rates = [m["samples_per_s"] for m in timed]
    # The first 30 steps hold the compilation and the first CUDA allocations. A profiled run also loses the
    # intervals of steps 41-60: the profiled steps, the trace's export and the collection of its objects.
    profiled = bool(list(run_dir.glob("profile_0_*")))

    def kept(m: dict) -> bool:
        return m["step"] > 30 and not (profiled and 40 < m["step"] <= 60)

    steady_rows = [m for m in timed if kept(m)]
    steady = [m["samples_per_s"] for m in steady_rows]
    # Packed rows per second (steps per second times rows per step): unlike samples/s it does not move with how
    # many sequences the interval's rows happen to hold, so it is the steadier measure of the step time.
    pairs = zip(timed, timed[1:], strict=False)
    steps_per_s = [(b["step"] - a["step"]) * 1000 / (b["time_ms"] - a["time_ms"]) for a, b in pairs if kept(b)]
    outcome = json.loads((run_dir / "run_0.json").read_text())
    out = {
        "samples_per_s": statistics.median(steady),
        "samples_per_s_intervals": rates,
        "steps_per_s": statistics.median(steps_per_s),
        "steps_per_s_intervals": steps_per_s,
        "peak_memory_gib": outcome["peak_memory_gib"],
        "run_dir": str(run_dir),
    }
    # power, SM clock, throttle reasons and energy of each busy GPU over the timed intervals
    out["gpus_while_timed"] = window_summary(run_dir, steady_rows[0]["time_ms"] - 10_000, steady_rows[-1]["time_ms"])
    timelines = sorted(run_dir.glob("profile_0_*timeline.json"))
    if timelines:
        out["timelines"] = {p.name: json.loads(p.read_text()) for p in timelines}
    return out


def attention_of(extra: list[str]) -> str:
    """The packed-row attention kernel a configuration asks for (`auto` unless it names one)."""
    return next((o.split("=", 1)[1] for o in extra if o.startswith("model.packed_attention=")), "auto")


def train(name: str, gpus: int, rows: int, prepared: Path, out: Path, steps: int, extra: list[str],
          env: dict[str, str], profile: bool, accumulation: int = 1) -> dict:  # fmt: skip
    results = out / name
    shutil.rmtree(results, ignore_errors=True)  # an earlier call's run of the same name in the same --work
    cmd = train_command(gpus, prepared, results, steps, extra, rows, profile, accumulation)
    run(cmd, ok=(0, 1), env=env)  # 1: no target
    shape = {"rows_per_gpu": rows, "accumulation": accumulation, "rows_per_step": rows * accumulation * gpus,
             "attention": attention_of(extra)}  # fmt: skip
    return {"config": name, "gpus": gpus} | shape | read_run(results)


def train_apart(name: str, gpus: int, rows: int, prepared: Path, out: Path, steps: int, extra: list[str],
                env: dict[str, str], profile: bool) -> dict:  # fmt: skip
    """``gpus`` independent one-GPU runs at once, one per GPU: the node's throughput without any communication
    (what DDP would reach if the all-reduce cost nothing), so power, clocks and the host are shared as under DDP."""
    procs = []
    shutil.rmtree(out / name, ignore_errors=True)
    for i in range(gpus):
        cmd = train_command(1, prepared, out / name / str(i), steps, extra, rows, profile)
        print("+", f"CUDA_VISIBLE_DEVICES={i}", " ".join(cmd), flush=True)
        procs.append(subprocess.Popen(cmd, env=env_with_src() | env | {"CUDA_VISIBLE_DEVICES": str(i)}))
    if any(p.wait() not in (0, 1) for p in procs):
        raise SystemExit(f"{name}: a run failed")
    runs = [read_run(out / name / str(i)) for i in range(gpus)]
    return {
        "config": name,
        "gpus": gpus,
        "rows_per_gpu": rows,
        "rows_per_step": rows,
        "samples_per_s": sum(r["samples_per_s"] for r in runs),
        "samples_per_s_per_run": [r["samples_per_s"] for r in runs],
        "peak_memory_gib": max(r["peak_memory_gib"] for r in runs),
        "run_dir": runs[0]["run_dir"],
    } | ({"timelines": runs[0]["timelines"]} if "timelines" in runs[0] else {})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--work", type=Path, default=Path("/tmp/tb-scaling"))
    p.add_argument("--only", nargs="*", help="run only these configurations (and the 1-GPU runs they compare with)")
    p.add_argument("--reference", type=float, help="1-GPU samples/s at 48 rows measured before: skip that run")
    p.add_argument("--profile", action="store_true", help="profile steps 40-42 of every run on every rank")
    p.add_argument("--no-one-gpu", action="store_true", help="with --only: no 1-GPU runs to compare with")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prepared = prepare(args.work, args.data)
    report = {"runs": []}
    n = args.gpus
    bf16 = "distributed.grad_reduce_dtype=bf16"
    # The compiled DDP graph split at the buckets (all-reduce overlapping backward; the default before
    # `overlap_compiled=auto`, which all the plain `_ddp` configurations measure), or one graph (auto's choice
    # on one node).
    split, one_graph = "distributed.overlap_compiled=true", "distributed.overlap_compiled=false"
    # name, GPUs, rows per GPU per micro-batch, overrides, environment[, micro-batches per step]
    configs = [
        ("1gpu", 1, 48, [], {}),
        (f"{n}x1gpu_apart", n, 48, [], {}),
        (f"{n}gpu_ddp", n, 48, [split], {}),
        (f"{n}gpu_ddp_bucket_clip", n, 48, [split, "optimizer.clip=bucket"], {}),
        (f"{n}gpu_ddp_bf16_reduce", n, 48, [split, bf16], {}),
        (f"{n}gpu_ddp_bf16_bucket100", n, 48, [split, bf16, "distributed.bucket_cap_mb=100"], {}),
        # NCCL's all-reduce kernels run on SMs that backward's GEMMs then lack: hold them to 8 thread blocks.
        (f"{n}gpu_ddp_ctas8", n, 48, [split], {"NCCL_MIN_CTAS": "1", "NCCL_MAX_CTAS": "8"}),
        # NCCL's protocol, which it picks by message size and platform; Simple moves the most bytes per flag.
        (f"{n}gpu_ddp_simple", n, 48, [split], {"NCCL_PROTO": "Simple"}),
        (f"{n}gpu_ddp_ll128", n, 48, [split], {"NCCL_PROTO": "LL128"}),
        ("1gpu_b96", 1, 96, [], {}),
        (f"{n}gpu_ddp_b96", n, 96, [split], {}),
        (f"{n}gpu_ddp_b96_simple", n, 96, [split], {"NCCL_PROTO": "Simple"}),
        # Two micro-batches of 48 rows per step (DDP all-reduces once per step, after the second): the
        # accumulation MLPerf configurations take on one node, 1x8x48x2 on 8 H100.
        ("1gpu_48x2", 1, 48, [], {}, 2),
        # One compiled graph (no split at bucket boundaries): more fusion, every all-reduce after backward.
        (f"{n}gpu_ddp_48x2_one_graph", n, 48, [one_graph], {}, 2),
        (f"{n}gpu_ddp_48x2", n, 48, [split], {}, 2),
        (f"{n}gpu_ddp_48x2_one_graph_bf16", n, 48, [one_graph, bf16], {}, 2),
        # One graph reduces nothing during backward: fewer, larger all-reduces after it.
        (f"{n}gpu_ddp_48x2_one_graph_bucket400", n, 48, [one_graph, "distributed.bucket_cap_mb=400"], {}, 2),
        # The packed-row attention kernel named outright (the others take auto's: cudnn where the cuDNN frontend
        # is installed, else varlen flash attention; each run's console log says which)
        ("1gpu_48x2_varlen", 1, 48, ["model.packed_attention=varlen"], {}, 2),
        ("1gpu_48x2_cudnn", 1, 48, ["model.packed_attention=cudnn"], {}, 2),
        (f"{n}gpu_ddp_one_graph", n, 48, [one_graph], {}),
        # Garbage collection: Python's automatic collection (the trainer's default until gc_every_steps), with
        # the default prefetch of 2 steps and with 16; and collection at fixed steps (the default now).
        (f"{n}gpu_ddp_autogc", n, 48, [split, "perf.gc_every_steps=0"], {}),
        (f"{n}gpu_ddp_autogc_prefetch16", n, 48, [split, "perf.gc_every_steps=0", "data.prefetch=16"], {}),
        (f"{n}gpu_ddp_gc50", n, 48, [split, "perf.gc_every_steps=50"], {}),
    ]
    wanted = set(args.only or [c[0] for c in configs])

    # each N-GPU run is compared with the 1-GPU run of its shape (rows per micro-batch, micro-batches per step)
    # and attention kernel
    def shape_of(config: tuple) -> tuple[int, int, str]:
        return config[2], config[5] if len(config) > 5 else 1, attention_of(config[3])

    one_gpu = {shape_of(c): c[0] for c in configs if c[1] == 1}
    for c in configs:
        name, gpus = c[:2]
        if name in wanted and not (args.only and args.no_one_gpu) and gpus > 1 and not name.endswith("_apart"):
            if not (shape_of(c) == (48, 1, "auto") and args.reference is not None):
                wanted.add(one_gpu[shape_of(c)])
    if args.only and args.reference is None and not args.no_one_gpu:
        wanted.add("1gpu")
    for name, gpus, rows, extra, env, *accumulation in configs:
        if name not in wanted:
            continue
        measure = train_apart if name.endswith("_apart") else train
        report["runs"].append(measure(name, gpus, rows, prepared, args.work / "runs", args.steps, extra, env,
                                      args.profile, *accumulation))  # fmt: skip
        (args.out / "bert_scaling.json").write_text(json.dumps(report, indent=1))
        print(json.dumps({k: v for k, v in report["runs"][-1].items() if k != "timelines"}), flush=True)
        trace = Path(report["runs"][-1]["run_dir"]) / "profile_0_trace.json"
        if trace.exists():
            with open(trace, "rb") as src, gzip.open(args.out / f"{name}_trace.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)

    def shape(r: dict) -> tuple[int, int, str]:
        return r["rows_per_gpu"], r.get("accumulation", 1), r.get("attention", "auto")

    one = {shape(r): r["samples_per_s"] for r in report["runs"] if r["gpus"] == 1}
    one_steps = {shape(r): r["steps_per_s"] for r in report["runs"] if r["gpus"] == 1 and "steps_per_s" in r}
    if args.reference is not None:
        one[48, 1, "auto"] = args.reference
    for r in report["runs"]:
        if r["gpus"] > 1 and shape(r) in one:
            r["scaling_efficiency"] = r["samples_per_s"] / (r["gpus"] * one[shape(r)])
        if r["gpus"] > 1 and shape(r) in one_steps and "steps_per_s" in r:
            # N GPUs each take the rows one GPU takes a step: the ratio of step rates is the rows/s efficiency
            r["step_scaling_efficiency"] = r["steps_per_s"] / one_steps[shape(r)]
    (args.out / "bert_scaling.json").write_text(json.dumps(report, indent=1))
    print(
        json.dumps(
            {r["config"]: [r.get("scaling_efficiency"), r.get("step_scaling_efficiency")] for r in report["runs"]}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
