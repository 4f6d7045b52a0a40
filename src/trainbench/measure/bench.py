"""`trainbench bench`: lay out a throughput measurement's folder and run it in this process, under torchrun or as a
Slurm job, at the model's depth or (``--blocks``) at truncated ones; each rank started for it runs this module
(``python -m trainbench.measure.bench RUN_DIR``); report/bench_report.py turns rank 0's figures into bench.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from trainbench.benchmarks.base import Benchmark
from trainbench.config import RunConfig, save_config
from trainbench.console import RunConsole
from trainbench.errors import ConfigError, UserError
from trainbench.launch.local import new_run_dir, preflight_device, run_to_end, torchrun_worker
from trainbench.launch.systems import System
from trainbench.resolve import absolute_paths, allocator_settings, load_run_config
from trainbench.runfiles import CONFIG, CONSOLE, other_ranks_error

REQUEST = "bench_request.json"
RAW = "bench_raw_{depth}.json"
KIND = "throughput measurement (trainbench bench): not a time-to-train result"
RANK = "trainbench.measure.bench"  # what each rank of a measurement runs (python -m): main below


def parse_blocks(text: str | None, layers: int, period: tuple[int, str] = (1, "")) -> list[int] | None:
    """``--blocks 2,6``: two or more truncated depths, each below the model's ``layers``, a multiple of the blocks'
    ``period`` (:meth:`Benchmark.block_period`) apart."""
    if text is None:
        return None
    try:
        depths = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise UserError(f"--blocks {text}: give block counts as integers, e.g. --blocks 2,6") from None
    if len(depths) < 2 or depths[0] < 1:
        raise UserError(f"--blocks {text}: give at least two different depths of 1 block or more, e.g. --blocks 2,6")
    if depths[-1] > layers:
        raise UserError(f"--blocks {text}: the model has {layers} blocks; give depths of at most {layers}")
    every, what = period
    if any((d - depths[0]) % every for d in depths):
        raise UserError(f"--blocks {text}: the model's blocks repeat every {every} ({what}), and depths that differ by "
                        "other than whole repeats would extrapolate from some kinds of block alone; give depths a "
                        f"multiple of {every} apart, e.g. --blocks {depths[0]},{depths[0] + every}")  # fmt: skip
    return depths


COMPARE = {"hf": (False, True), "hf-compiled": (True,)}  # --compare: HF's steps eager and/or compiled


def run_bench(bench: Benchmark, cfg: RunConfig, steps: int, warmup: int, blocks: str | None,
              compare: str | None = None, profile_steps: int = 2, system: System | None = None,
              command: list[str] | None = None, snapshot: bool = False, table_rows: int | None = None
              ) -> tuple[Path, dict, int | None, list[int] | None, dict]:  # fmt: skip
    """Measure, into a new results folder: in this process, under torchrun (``--nproc``), or as one Slurm job a depth
    on ``system`` (``command``: what the user typed, recorded in the job script). Returns the folder, rank 0's
    figures by depth measured, the model's depth, the truncated depths measured (None: the model's own) and the
    peers' figures (``compare="hf"``: HF's, eager and compiled, by depth; ``"hf-compiled"``: compiled only).
    ``table_rows``: every embedding table cut to at most that many rows (the figures are then of truncated tables)."""
    if table_rows is not None:
        if table_rows < 1:
            raise UserError(f"--table-rows must be at least 1, got {table_rows}")
        cfg = bench.family.tables_truncated(cfg, table_rows)
        bench.validate(cfg)
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    if warmup < 0:
        raise UserError(f"--warmup must be 0 or more, got {warmup}")
    if profile_steps < 0:
        raise UserError(f"--profile-steps must be 0 or more, got {profile_steps}")
    if cfg.resume:
        raise ConfigError("resume=true does not apply to trainbench bench: a measurement starts afresh")
    layers = bench.family.depth(cfg)
    depths = parse_blocks(blocks, layers, bench.family.block_period(cfg)) if layers is not None else None
    if blocks is not None and layers is None:
        raise UserError(f"--blocks: {bench.name}'s model has no blocks to truncate")
    if depths:
        bench.family.truncated(cfg, depths[0])  # a model that cannot be cut to these depths stops before any folder
    hf_peer = None
    if compare is not None:
        from trainbench.measure import compare_hf

        if compare not in COMPARE:
            raise UserError(f"--compare {compare}: the one peer trainbench measures is hf (transformers, peft, "
                            "diffusers), eager and compiled, or hf-compiled (compiled only)")  # fmt: skip
        if system is not None:
            raise UserError(f"--compare {compare} runs in this process: drop --system")
        hf_peer = compare_hf.require(bench, cfg)
    from trainbench.console import console
    from trainbench.measure.plan import planned

    if system is not None:
        cfg, plan = planned(bench, cfg, console.print, here=False)
        return _on_system(bench, cfg, steps, warmup, depths, layers, profile_steps, system, command or [], plan)
    allocator_settings(bench)
    device = preflight_device(cfg)
    unplanned, rows = cfg, None
    if depths and cfg.perf.plan == "auto":
        # Truncated: the whole model need not fit this GPU (that is what the depths are for). Each depth is planned
        # for its own blocks, all at the deepest's rows a micro-batch, which fit the shallower ones too: the rate
        # between depths is extrapolated, so they share their micro-batch. Before any folder, as below.
        rows = planned(bench, bench.family.truncated(cfg, max(depths)), console.print)[0].data.micro_batch_size
        plan = [f"perf.plan=auto: each depth measured is planned for its own blocks, all at {rows} row"
                f"{'s' if rows > 1 else ''} a micro-batch (the deepest's); the whole model is not planned"]  # fmt: skip
    else:
        cfg, plan = planned(bench, cfg, console.print)  # before any folder: a layout that cannot fit stops here
    run_dir = new_run_dir(cfg.output.results_dir, bench.name, f"{cfg.preset}-bench")
    save_config(cfg, run_dir / CONFIG)
    out = RunConsole(run_dir / CONSOLE)
    out.say(f"results folder: {run_dir} ({KIND})")
    if table_rows is not None:
        out.say(f"every embedding table truncated to at most {table_rows:,} rows (--table-rows): its figures are "
                "those of the truncated tables")  # fmt: skip
    for line in plan:
        out.say(line)
    raws, peers = {}, {}
    for depth in depths or [layers]:
        if depths:
            out.say(f"measuring {depth} of {layers} blocks")
        _request(run_dir, steps, warmup, depth, profile_steps, snapshot)
        run_cfg = _truncated(cfg, depth, layers, run_dir, unplanned, out, rows)
        if cfg.distributed.nproc == 1:
            from trainbench.distributed import init_distributed
            from trainbench.measure.throughput import measure

            info = init_distributed(device, cfg.distributed.backend, cfg.distributed.timeout_s)
            raw = measure(run_cfg, bench, run_dir, info, steps, warmup, profile_steps, snapshot)
            (run_dir / RAW.format(depth=depth)).write_text(json.dumps(raw, indent=2))
        else:
            _torchrun(run_cfg, run_dir, depth, out)
        raws[depth] = json.loads((run_dir / RAW.format(depth=depth)).read_text())
        out.say(_depth_line(raws[depth], depth))
        if hf_peer is not None:
            _compare_at(bench, run_cfg, hf_peer, steps, warmup, device, peers, depth, out, COMPARE[compare])
    return run_dir, raws, layers, depths, peers


def _depth_line(raw: dict, depth: int | None, name: str = "ours") -> str:
    """One measured depth's figures as they come in (the summary extrapolates once every depth is measured)."""
    at = f" at {depth} blocks" if depth else ""
    if "error" in raw:
        return f"  {name}{at}: {raw['error']}"
    step = raw["seconds"] / raw["steps"]
    peak = f", peak {raw['peak_memory_gib']:.1f} GiB" if raw.get("peak_memory_gib") is not None else ""
    return f"  {name}{at}: {step:.3f} s a step of {raw['samples_per_step']:g} samples{peak}"


def bench_of(cfg: RunConfig) -> Benchmark:
    from trainbench.benchmarks import get_benchmark

    return get_benchmark(cfg.benchmark)


def _request(run_dir: Path, steps: int, warmup: int, depth: int | None, profile_steps: int,
             snapshot: bool = False) -> None:  # fmt: skip
    """What every rank of the next measurement reads (:func:`rank`)."""
    request = {"steps": steps, "warmup": warmup, "depth": depth, "profile_steps": profile_steps, "snapshot": snapshot}
    (run_dir / REQUEST).write_text(json.dumps(request))


def _truncated(cfg: RunConfig, depth: int | None, layers: int | None, run_dir: Path, unplanned: RunConfig | None = None,
               out: RunConsole | None = None, rows: int | None = None) -> RunConfig:  # fmt: skip
    """The config measured at ``depth`` blocks, saved beside the folder's own where it is not the model's depth; under
    perf.plan=auto planned again for that depth (from ``unplanned``, the config before any plan), at ``rows`` a
    micro-batch where given. The benchmark says what a block is
    (:meth:`~trainbench.benchmarks.base.Benchmark.truncated`)."""
    if depth == layers:
        return cfg
    bench = bench_of(cfg)
    if unplanned is not None and unplanned.perf.plan == "auto" and out is not None:
        from trainbench.measure.plan import planned

        truncated, lines = planned(bench, bench.family.truncated(unplanned, depth), out.say)
        if rows is not None and truncated.data.micro_batch_size != rows:
            truncated = bench.with_layout(truncated, {"data.micro_batch_size": rows})
            lines[:1] = [f"{lines[0]} (measured at {rows} a micro-batch, as the deepest)"] if lines else []
        for line in lines[:1]:
            out.say(f"at {depth} blocks: {line}")
    else:
        truncated = bench.family.truncated(cfg, depth)
    save_config(truncated, run_dir / f"config_{depth}_blocks.yaml")
    return truncated


def _on_system(bench, cfg, steps, warmup, depths, layers, profile_steps, system, command, plan):
    """Each depth as one Slurm job of ``system``'s nodes and ranks, one after the other."""
    from trainbench.launch.slurm import bench_job, check_cluster, check_container, check_mpi

    check_container(system)
    check_cluster(system)
    check_mpi(system)
    run_dir = new_run_dir(cfg.output.results_dir, bench.name, f"{cfg.preset}-bench-{system.name}").resolve()
    cfg = absolute_paths(cfg)
    cfg = dataclasses.replace(
        cfg,
        device=system.device,
        distributed=dataclasses.replace(cfg.distributed, nproc=system.ranks_per_node, nodes=system.nodes),
        output=dataclasses.replace(cfg.output, run_dir=str(run_dir), progress=False),
    )
    bench.validate(cfg)  # at the job's world size
    save_config(cfg, run_dir / CONFIG)
    out = RunConsole(run_dir / CONSOLE)
    out.say(f"results folder: {run_dir} ({KIND}) on {system.name}: {system.nodes} x {system.ranks_per_node} ranks")
    for line in plan:
        out.say(line)
    raws = {}
    for depth in depths or [layers]:
        if depths:
            out.say(f"measuring {depth} of {layers} blocks")
        _request(run_dir, steps, warmup, depth, profile_steps)
        run_cfg = _truncated(cfg, depth, layers, run_dir)
        bench_job(system, run_cfg, run_dir, command, out.say, f'{RANK} "$RUN_DIR"')
        raw = run_dir / RAW.format(depth=depth)
        if not raw.exists():
            logs = sorted(run_dir.glob("slurm-bench-*.out"), key=lambda p: p.stat().st_mtime)
            tail = logs[-1].read_text(errors="replace").strip().splitlines()[-3:] if logs else []
            said = other_ranks_error(run_dir, f"bench{depth}")
            raise UserError(f"the measurement's job ended without figures{f' ({logs[-1]})' if logs else ''}"
                            + (": " + " / ".join(tail) if tail else "") + (f"; {said}" if said else ""))  # fmt: skip
        raws[depth] = json.loads(raw.read_text())
    return run_dir, raws, layers, depths, {}


def _compare_at(bench, cfg, hf_peer, steps, warmup, device, peers, depth, out, ways: tuple[bool, ...]) -> None:
    """HF's steps at ``depth`` (``ways``: compiled or not), after ours has let go of the GPU."""
    import gc

    import torch

    from trainbench.measure import compare_hf

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    for compiled in ways:
        name = f"hf_{'compiled' if compiled else 'eager'}"
        out.say(f"measuring {name} ({hf_peer}){f' at {depth} blocks' if depth else ''}")
        peers.setdefault(name, {})[depth] = compare_hf.measure(bench, cfg, compiled, steps, warmup,
                                                               torch.device(device, 0) if device == "cuda"
                                                               else torch.device("cpu"))  # fmt: skip
        out.say(_depth_line(peers[name][depth], depth, name))


def _torchrun(cfg: RunConfig, run_dir: Path, depth: int, out: RunConsole) -> None:
    """One depth measured by ``nproc`` ranks under torchrun. Rank 0 writes the figures after the timed steps' last
    collective, so every rank had done those steps: a rank that fails after that (on its way out, a thread of its own
    at interpreter exit) does not undo them."""
    cmd, env = torchrun_worker(cfg.distributed.nproc, str(run_dir), module=RANK)
    code = run_to_end(cmd, env, f"the measurement at {depth} blocks under torchrun")
    written = (run_dir / RAW.format(depth=depth)).exists()
    if code != 0 and written:
        out.say(f"torchrun exited with code {code} after rank 0 had written the figures at {depth} blocks (every "
                "rank's timed steps done): a rank failed after them; the figures stand", style="yellow")  # fmt: skip
        return
    if code != 0 or not written:
        said = other_ranks_error(run_dir, f"bench{depth}")
        raise UserError(f"the measurement failed under torchrun (exit code {code}){'; ' + said if said else ''}; "
                        f"see the messages above and {run_dir / CONSOLE}")  # fmt: skip


def rank(run_dir: Path) -> int:
    """One rank of a throughput measurement that torchrun or srun started: the depth its request names; rank 0 writes
    the figures."""
    from trainbench.distributed import init_distributed, resolve_device, shutdown
    from trainbench.launch.worker import bind_cpus, say_error
    from trainbench.measure.throughput import measure

    request = json.loads((run_dir / REQUEST).read_text())
    depth = request["depth"]
    config = run_dir / f"config_{depth}_blocks.yaml"
    bench, cfg = load_run_config(config if config.exists() else run_dir / CONFIG)
    allocator_settings(bench)
    info = init_distributed(resolve_device(cfg.device), cfg.distributed.backend, cfg.distributed.timeout_s)
    ended = False
    try:
        bind_cpus(info)
        raw = measure(
            cfg,
            bench,
            run_dir,
            info,
            request["steps"],
            request["warmup"],
            request["profile_steps"],
            request.get("snapshot", False),
        )
        if info.is_main:
            (run_dir / RAW.format(depth=depth)).write_text(json.dumps(raw, indent=2))
        ended = True
    except UserError as exc:
        say_error(exc, info, run_dir, f"bench{depth}")
        return 1
    finally:
        shutdown(drain=ended)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``RUN_DIR``: one rank of the measurement in RUN_DIR (torchrun's or Slurm's environment)."""
    import sys

    from trainbench.train.duties import StopSignal

    StopSignal.install_early()
    argv = sys.argv[1:] if argv is None else argv
    return rank(Path(argv[0]))


if __name__ == "__main__":
    from trainbench.distributed import leave

    leave(main())  # never through Python's finalization: see leave()
