"""The report of a throughput measurement's folder (`trainbench bench`): its figures, plainly labelled as a throughput
measurement, never a time-to-train result; two such folders side by side. `check` and `package` refuse one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from trainbench.benchmarks.base import Benchmark
from trainbench.config import RunConfig
from trainbench.errors import UserError
from trainbench.runfiles import CONFIG

BENCH = "bench.json"


def is_bench(folder: Path) -> bool:
    return (Path(folder) / BENCH).is_file()


def refuse(folder: Path, what: str) -> None:
    """One sentence where ``folder`` is a throughput measurement's, which ``what`` (check, package) cannot take."""
    if is_bench(folder):
        raise UserError(f"{folder} is a throughput measurement (trainbench bench), not a run: it has no MLPerf log to "
                        f"{what}")  # fmt: skip


def read(folder: Path) -> dict[str, Any]:
    """bench.json, with every field the report and the comparison read of the kind they read it as."""
    from trainbench.report.scoring import read_record

    path = Path(folder) / BENCH
    if not path.is_file():
        raise UserError(f"{path} cannot be read (no such file)")
    result = read_record(path, BENCH_FIELDS, whole=True, required=("kind", "benchmark", "preset", "figures", "ranks",
                                                                  "device"))  # fmt: skip
    forecast = result.get("forecast")
    if forecast is not None and "none" not in forecast:
        missing = next((k for k in ("step_seconds", "tokens_per_s_per_rank", "miss", "split_s") if k not in forecast),
                       None)  # fmt: skip
        odd = next((k for k, v in forecast.get("split_s", {}).items() if not isinstance(v, (int, float))
                    or isinstance(v, bool)), None)  # fmt: skip
        if missing or odd:
            said = f"field forecast.{missing} is missing" if missing else f"forecast.split_s.{odd} should be a number"
            raise UserError(f"{path}: {said}; restore the file from the run, or remove it")
    if result.get("projection") is not None:
        read_record(path, BENCH_FIELDS, required=("ruleset", "global_batch_size"))
        if not isinstance(result["projection"].get("minutes"), (int, float)):
            raise UserError(f"{path}: field projection.minutes is missing; restore the file from the run, or remove it")
    return result


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


FIGURES = (
    ("tokens/s", "tokens_per_s"),
    ("tokens/s per rank", "tokens_per_s_per_rank"),
    ("tokens/s per node", "tokens_per_s_per_node"),
    ("samples/s", "samples_per_s"),
    ("step (s)", "step_seconds"),
    ("MFU", "mfu"),
    ("peak memory (GiB)", "peak_memory_gib"),
    ("energy per token (J)", "energy_joules_per_token"),
    ("eval (s per sample)", "eval_seconds_per_sample"),
)
# Figures of some models alone, shown where the measurement has them
SOME_FIGURES = (
    ("table lookups/s", "lookups_per_s"),
    ("peak memory at the model's depth, on the line (GiB)", "peak_memory_gib_at_depth"),
    ("the GPU's memory (GiB)", "gpu_memory_gib"),
    ("peak memory held by the allocator (GiB)", "peak_reserved_gib"),
    ("allocator retries in the timed steps (memory pressure)", "allocator_retries"),
)


# Of a GPU's whole memory, what a run's allocated peak can reach: the CUDA context, NCCL's buffers and the caching
# allocator's blocks reserved but not allocated take the rest. The whole flux1 on 2 H200 (reduced once a step) failed
# an allocation at 130.8 GiB allocated of 139.8 (93.6 %), where the line through 1 and 2 blocks said 135.5; the 8B's
# 125.1 (89.5 %) ran (docs/performance.md).
ALLOCATABLE_SHARE = 0.9
FITS = {"no": "no: more than the GPU's memory", "maybe": f"may not: more than {ALLOCATABLE_SHARE * 100:.0f} % of it",
        "yes": "yes"}  # fmt: skip


def whole_model_fits(result: dict[str, Any]) -> str | None:
    """Whether the GPU holds the peak on the line at the model's depth (an extrapolated bench's
    ``peak_memory_gib_at_depth`` against its ``gpu_memory_gib``): "no" above the GPU's memory, "maybe" above
    :data:`ALLOCATABLE_SHARE` of it, "yes" below; None without both figures."""
    whole, gpu = result.get("peak_memory_gib_at_depth"), result.get("gpu_memory_gib")
    if whole is None or gpu is None:
        return None
    return "no" if whole > gpu else "maybe" if whole > ALLOCATABLE_SHARE * gpu else "yes"


def rows(result: dict[str, Any]) -> list[list[str]]:
    out = [[label, _num(result.get(key))] for label, key in FIGURES]
    out += [[label, _num(result[key])] for label, key in SOME_FIGURES if result.get(key) is not None]
    if (fits := whole_model_fits(result)) is not None:
        out.append(["the whole model in this layout on the GPU, by the line", FITS[fits]])
    if result.get("forecast"):
        out.append(["several GPUs against one", forecast_line(result["forecast"])])
    p = result.get("projection")
    out.append(["projected time to train (min)", _num(p["minutes"]) if p else "-"])
    prof = result.get("profile")
    if prof:
        if prof.get("note"):
            out.append([f"step's split: {prof['figures']}", prof["note"]])
        out += [[f"step: {name} (ms, profiled)", _num(prof["split_ms"].get(f"{key}_ms"))] for name, key in SPLIT]
        out += [[f"GPU time: {kind} (ms a step)", _num(ms)] for kind, ms in prof["by_kind_ms"].items()]
        out += [[f"GPU time by part: {part} (ms a step)", _num(ms)] for part, ms in prof.get("by_part_ms", {}).items()]
    return out


def _bench_fields() -> dict[str, Any]:
    from trainbench.report.scoring import NUMBER, ListOf

    return {"kind": str, "benchmark": str, "preset": str, "figures": str, "ranks": int, "device": str,
            "blocks": int, "blocks_measured": ListOf(int), "ruleset": str, "global_batch_size": int,
            "projection": {"minutes": NUMBER}, "projection_none": str,
            "profile": {"split_ms": dict, "by_kind_ms": dict},
            "forecast": {"none": str, "step_seconds": NUMBER, "tokens_per_s_per_rank": NUMBER, "miss": NUMBER,
                         "split_s": dict, "one_gpu_measured_at": str},
            **{key: NUMBER for _, key in FIGURES + SOME_FIGURES}}  # fmt: skip


BENCH_FIELDS = _bench_fields()

# The step's split from the profiled steps (train/profiling.timeline): what the console and the report show.
SPLIT = (("window", "window"), ("compute", "compute"), ("exposed communication", "comm_exposed"), ("idle", "idle"))


def split_line(prof: dict[str, Any]) -> str:
    """One line of the profiled step: its split and its largest kinds of GPU time."""
    split = ", ".join(f"{name} {prof['split_ms'][f'{key}_ms']:.1f}" for name, key in SPLIT)
    kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in list(prof["by_kind_ms"].items())[:5])
    parts = ", ".join(f"{part} {ms:.1f}" for part, ms in prof.get("by_part_ms", {}).items())
    line = f"step ({prof['figures']}, ms): {split}; GPU time by kind: {kinds}"
    return line + (f"; by part: {parts}" if parts else "") + (f" ({prof['note']})" if prof.get("note") else "")


def heading(result: dict[str, Any]) -> str:
    blocks = result.get("blocks_measured")
    how = result["figures"] + (f" from {', '.join(map(str, blocks))} of {result['blocks']} blocks" if blocks else "")
    return (f"{result['benchmark']}/{result['preset']} on {result['ranks']} x {result['device']}: "
            f"{result['kind']}; figures {how}")  # fmt: skip


def hardware_line(result: dict[str, Any]) -> str:
    """The machine the measurement ran on as its rank 0 recorded it, and the trainbench that measured."""
    from trainbench.report.headline import for_bench

    headline = for_bench(Path("."), result)
    return f"{headline.hardware}; {headline.version}"


def write(folder: Path) -> tuple[Path, Path, dict[str, Any]]:
    """report.md and report.html of a measurement's folder."""
    folder = Path(folder)
    result = read(folder)
    config = (folder / CONFIG).read_text(errors="replace") if (folder / CONFIG).exists() else ""
    body = rows(result)
    projection = result.get("projection")
    if projection:
        notes = [
            f"Projection: the reference convergence points of ruleset {result['ruleset']} at global batch "
            f"{result['global_batch_size']}, the measured rate and eval time; a projection, not a result."
        ]
    else:
        from trainbench.report.projection import NONE_UNSAID

        why = result.get("projection_none") or NONE_UNSAID
        notes = [f"No projection: {why}."]
    from trainbench.report.page import md_fence, md_text

    hardware = f"Hardware: {hardware_line(result)}"
    fence = md_fence(config)
    md = [f"# {md_text(heading(result))}", "", md_text(hardware), "", "| figure | value |", "| --- | --- |"]
    md += [f"| {md_text(a)} | {md_text(b)} |" for a, b in body]
    md += ["", *map(md_text, notes), "", "## Config", "", f"{fence}yaml", config.rstrip(), fence, ""]
    md_path = folder / "report.md"
    md_path.write_text("\n".join(md))
    from trainbench.report.headline import card_html, for_bench
    from trainbench.report.page import document, esc, table

    paragraphs = "".join(f"<p>{esc(n)}</p>" for n in notes)
    page = document(heading(result), f"<h1>{esc(heading(result))}</h1>{card_html(for_bench(folder, result))}"
                                     f"<p>{esc(hardware)}</p>{table(['figure', 'value'], body)}{paragraphs}"
                                     f"<h2>Config</h2><pre>{esc(config)}</pre>")  # fmt: skip
    html_path = folder / "report.html"
    html_path.write_text(page)
    return md_path, html_path, result


def compare(a: Path, b: Path) -> tuple[list[str], list[list[str]]]:
    """Two measurements side by side, with the ratio B/A of each figure."""
    ra, rb = read(a), read(b)
    out = []
    for label, key in FIGURES:
        va, vb = ra.get(key), rb.get(key)
        ratio = vb / va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else None
        out.append([label, _num(va), _num(vb), _num(ratio, 3)])
    return ["", f"A: {Path(a).name}", f"B: {Path(b).name}", "B/A"], out


# Dense bf16 peak TFLOP/s of one GPU by its name, the MFU denominator NVIDIA uses for its MLPerf figures.
BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "GH200": 989.4, "B200": 2250.0, "A100": 312.0}


def peak_tflops(gpu_name: str | None) -> float | None:
    for key, value in BF16_PEAK_TFLOPS.items():
        if gpu_name and key in gpu_name:
            return value
    return None


def at_depth(values: dict[int | None, float], layers: int | None) -> float:
    """The value at the model's depth: measured there, or on the straight line through the shallowest and the
    deepest truncated depths measured."""
    if layers in values:
        return values[layers]
    lo, hi = min(values), max(values)
    return values[lo] + (values[hi] - values[lo]) / (hi - lo) * (layers - lo)


def compared(peers: dict[str, dict[int | None, dict]], layers: int | None, samples_per_step: float, per_sample: int,
             ours_step_s: float) -> dict[str, Any]:  # fmt: skip
    """Each peer's (HF's) figures at the model's depth, as ours are taken, and ours over its rate in samples a second
    (a peer without packed rows takes more steps for the same samples)."""
    out = {}
    for name, by_depth in peers.items():
        failed = next((r["error"] for r in by_depth.values() if "error" in r), None)
        if failed:
            out[name] = {"error": failed}
            continue
        step_s = at_depth({d: r["seconds"] / r["steps"] for d, r in by_depth.items()}, layers)
        theirs = by_depth[max(by_depth)].get("samples_per_step", samples_per_step) / step_s
        out[name] = {"step_seconds": step_s, "samples_per_s": theirs, "tokens_per_s": theirs * per_sample,
                     "ours_over_it": samples_per_step / ours_step_s / theirs,
                     "peak_memory_gib": by_depth[max(by_depth)]["peak_memory_gib"]}  # fmt: skip
    return out


def _by_part(profiles: dict[int, dict], layers: int | None) -> dict[str, Any]:
    """``by_part_ms`` at the model's depth, where every depth's profile has it (an older trainbench's do not)."""
    if any("by_part_ms" not in p for p in profiles.values()):
        return {}
    parts = {k for p in profiles.values() for k in p["by_part_ms"]}
    at = {k: at_depth({d: p["by_part_ms"].get(k, 0.0) for d, p in profiles.items()}, layers) for k in parts}
    return {"by_part_ms": dict(sorted(at.items(), key=lambda kv: -kv[1]))}


def profile_at_depth(raws: dict[int, dict], layers: int | None, depths: list[int] | None) -> dict[str, Any] | None:
    """The profiled steps' split (compute, exposed communication, idle) and GPU time by kind of kernel, ms a step, at
    the model's depth (``depths``: extrapolated, and a block's share of each kind beside it); None where a depth
    was not profiled (a CPU, or --profile-steps 0)."""
    profiles = {d: r.get("profile") for d, r in raws.items()}
    if not profiles or any(p is None for p in profiles.values()):
        return None
    split_keys = [k for k in profiles[max(profiles)]["split"] if k.endswith("_ms")]
    kinds = sorted({k for p in profiles.values() for k in p["by_kind_ms"]})
    deepest = profiles[max(profiles)]
    out: dict[str, Any] = {
        "figures": "extrapolated" if depths else "measured",
        "split_ms": {k: at_depth({d: p["split"][k] for d, p in profiles.items()}, layers) for k in split_keys},
        "by_kind_ms": dict(
            sorted(
                ((k, at_depth({d: p["by_kind_ms"].get(k, 0.0) for d, p in profiles.items()}, layers)) for k in kinds),
                key=lambda kv: -kv[1],
            )
        ),  # fmt: skip
        **_by_part(profiles, layers),
        "kernels": deepest["kernels"],
        "kernels_at_blocks": max(profiles) if depths else layers,
        "traces": [p["trace"] for _, p in sorted(profiles.items())],
    }
    split = out["split_ms"]
    if split.get("idle_ms", 0.0) < 0:  # extrapolated: the host's waits shrink as the GPU's work grows with the blocks,
        # and a straight line through two depths takes them below zero (a window shorter than the GPU's busy time)
        split["idle_ms"], split["window_ms"] = 0.0, split["busy_ms"]
    if depths:
        lo, hi = min(profiles), max(profiles)
        negative = sorted(k.removesuffix("_ms") for table in (split, out["by_kind_ms"], out.get("by_part_ms", {}))
                          for k, ms in table.items() if ms < 0)  # fmt: skip
        if negative:  # a shallow depth's profile out of line with the others (a collective that waited on a slower
            # rank): the line through them says nothing at the model's depth, so the deepest profile is shown as it is
            return out | {
                "figures": f"measured at {hi} blocks",
                "split_ms": {k: deepest["split"][k] for k in split_keys},
                "by_kind_ms": dict(sorted(deepest["by_kind_ms"].items(), key=lambda kv: -kv[1])),
                **_by_part({hi: deepest}, hi),
                "note": f"not extrapolated to {layers} blocks: the line through {lo} and {hi} blocks' profiles gave a "
                f"negative {', '.join(dict.fromkeys(negative))}",
            }  # fmt: skip
        out["block_by_kind_ms"] = {k: (profiles[hi]["by_kind_ms"].get(k, 0.0) - profiles[lo]["by_kind_ms"].get(k, 0.0))
                                   / (hi - lo) for k in kinds}  # fmt: skip
    return out


def forecast_at_depth(raws: dict[int, dict], layers: int | None, tokens_per_step: float,
                      step_s: float) -> dict[str, Any] | None:  # fmt: skip
    """The forecast from one GPU (measure/forecast.py) at the model's depth, as the step is taken: its step, its
    split, the rate a GPU it gives (``tokens_per_step`` a GPU) and the measured rate over it less one (``miss``);
    ``{"none": why}`` where a depth had none; None where no depth was forecast (one GPU, a CPU)."""
    forecasts = [r.get("forecast") for r in raws.values()]
    if not any(forecasts):
        return None
    if not all(f and "step_s" in f for f in forecasts):
        return {"none": next((f["none"] for f in forecasts if f and "none" in f), "a depth was not forecast")}
    deepest = raws[max(raws)]["forecast"]
    forecast_s = at_depth({d: r["forecast"]["step_s"] for d, r in raws.items()}, layers)
    split = {k: at_depth({d: r["forecast"]["split_s"].get(k, 0.0) for d, r in raws.items()}, layers)
             for k in deepest["split_s"]}  # fmt: skip
    return {"step_seconds": forecast_s, "tokens_per_s_per_rank": tokens_per_step / forecast_s, "split_s": split,
            "miss": forecast_s / step_s - 1, "one_gpu_measured_at": deepest["one_gpu"]["measured_at"]}  # fmt: skip


def forecast_line(f: dict[str, Any]) -> str:
    """bench.json's forecast in a sentence."""
    from trainbench.measure.forecast import split_text

    if "none" in f:
        return f"no forecast from one GPU: {f['none']}"
    return (f"forecast from one GPU's step: {f['tokens_per_s_per_rank']:,.0f} tokens/s a GPU, {f['step_seconds']:.3f} "
            f"s a step ({split_text(f['split_s'])}); measured {f['miss']:+.1%} against it")  # fmt: skip


def summarise(bench: Benchmark, cfg: RunConfig, raws: dict[int, dict], layers: int | None,
              depths: list[int] | None, peers: dict[str, dict] | None = None) -> dict[str, Any]:  # fmt: skip
    """bench.json: the figures at the model's depth, measured or (``depths``) extrapolated from the truncated ones by
    a straight line of step time against blocks."""
    from trainbench.measure.bench import KIND
    from trainbench.report.projection import project, why_none

    last = raws[max(raws)]
    device = last["device"]  # as rank 0 saw it: a Slurm job's GPUs are not those where bench started
    ranks = cfg.distributed.world_size
    per_sample = bench.family.tokens_per_sample(cfg)
    gbs = cfg.data.global_batch_size
    step_s = at_depth({d: r["seconds"] / r["steps"] for d, r in raws.items()}, layers)
    eval_s = at_depth({d: r["eval_seconds_per_sample"] for d, r in raws.items()}, layers)
    measured = "extrapolated" if depths else "measured"
    samples_per_step = last.get("samples_per_step", gbs)  # a packed row holds several samples
    samples_per_s = samples_per_step / step_s
    flops = bench.family.flops_per_sample(cfg)
    peak = peak_tflops(device)
    result: dict[str, Any] = {
        "kind": KIND,
        "benchmark": bench.name,
        "preset": cfg.preset,
        "figures": measured,
        "blocks": layers,
        "blocks_measured": sorted(raws) if depths else None,
        "ranks": ranks,
        "device": device,
        "global_batch_size": gbs,
        "samples_per_step": samples_per_step,
        "step_seconds": step_s,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * per_sample,
        "samples_per_s_per_rank": samples_per_s / ranks,
        "tokens_per_s_per_rank": samples_per_s * per_sample / ranks,
        # a recommender's: the embedding-table rows read a second (None for a model without tables)
        "lookups_per_s": samples_per_s * lookups if (lookups := bench.family.lookups_per_sample(cfg)) else None,
        "nodes": cfg.distributed.nodes,
        "tokens_per_s_per_node": samples_per_s * per_sample / cfg.distributed.nodes,
        "mfu": flops * samples_per_s / ranks / (peak * 1e12) if flops and peak else None,
        "peak_memory_gib": last["peak_memory_gib"],
        # the caching allocator at the deepest measured depth: its peak held and every rank's retries (an older
        # trainbench's raw figures have neither)
        "peak_reserved_gib": last.get("peak_reserved_gib"),
        "allocator_retries": last.get("allocator_retries"),
        "eval_seconds_per_sample": eval_s,
        "energy_joules_per_token": None,
        "steps": last["steps"],
        "warmup": last["warmup"],
        "compare": compared(peers, layers, samples_per_step, per_sample, step_s) if peers else None,
        "profile": profile_at_depth(raws, layers, depths),
        "router": last.get("router"),  # a mixture of experts' tokens per expert (the deepest measured depth's)
        "gpus": last.get("gpus") or None,  # the deepest measured depth's: power, SM clock, throttle reasons
        "system": last.get("system"),  # the machine rank 0 ran on (CPU, GPUs, trainbench's version)
        "raw": {str(d): r for d, r in sorted(raws.items())},
    }
    result["forecast"] = forecast_at_depth(raws, layers, samples_per_step * per_sample / ranks, step_s)
    # The peak on the same line as the step's time: whether the whole model would fit the GPU that the shallow depths
    # fit (its parameters' and optimizer state's share grows with the blocks).
    peaks = {d: r.get("peak_memory_gib") for d, r in raws.items()}
    if depths and len(peaks) > 1 and None not in peaks.values():
        result["peak_memory_gib_at_depth"] = at_depth(peaks, layers)
        if last.get("gpu_memory_gib") is not None:
            result["gpu_memory_gib"] = last["gpu_memory_gib"]
    if not depths and "energy_joules" in last:  # the energy of rank 0's node over the tokens its ranks trained
        node_share = min(1.0, cfg.distributed.nproc / ranks)
        tokens = samples_per_step * last["steps"] * per_sample * node_share
        result["energy_joules_per_token"] = last["energy_joules"] / tokens
    ruleset = bench.ruleset_of(cfg)
    # Only the full model's rate says anything of the reference convergence points' samples to target.
    full_size = bench.mlperf and not bench.scaled_down(cfg)
    projection = project(bench.name, gbs, samples_per_s, eval_s * last["eval_samples"], ruleset) if full_size \
        else None  # fmt: skip
    result["ruleset"] = ruleset
    result["projection"] = dataclasses.asdict(projection) | {"minutes": projection.minutes} if projection else None
    result["projection_none"] = None if projection else why_none(bench.name, gbs, ruleset, bench.scaled_down(cfg))
    return result


def save(folder: Path, result: dict[str, Any]) -> None:
    (Path(folder) / BENCH).write_text(json.dumps(result, indent=2) + "\n")
