"""``perf.plan=auto`` before any folder is made: the probe of this GPU (cached, or run in a process of its own) and
the machine's memory, handed to the benchmark's planner; the config that comes back has the layout keys set."""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainbench.benchmarks.base import Benchmark
from trainbench.config import RunConfig, save_config
from trainbench.distributed import resolve_device
from trainbench.errors import ConfigError, UserError
from trainbench.families.planner import GIB, BlockProbe, Resources, host_available_bytes
from trainbench.launch.local import run_to_end


def probe(bench: Benchmark, cfg: RunConfig, here: bool, say, run_cfg: RunConfig | None = None) -> dict:
    """This shape's probe: cached, else (``here``: this machine has the GPU the run uses) measured now in a process
    of its own and cached. ``run_cfg``: the run's config, whose keys that shape the probe the command that would
    cache it is given."""
    from trainbench.measure import probe as probing

    found = probing.cached(cfg)
    if found is not None:
        return found
    if not here:
        keys = "".join(f" {k}" for k in probing.shape_keys(run_cfg or cfg, bench.config(cfg.preset)))
        raise UserError(f"perf.plan=auto plans from a probe of the GPU the job runs on, and none is cached for "
                        f"{bench.name}/{cfg.preset} at this shape and software version: run `trainbench bench "
                        f"{bench.name} --preset {cfg.preset}{keys} --steps 1 --warmup 0` once on one of the "
                        f"system's nodes (it probes and caches in {probing.cache_dir()}), or set perf.plan=manual "
                        f"with the layout keys")  # fmt: skip
    say(f"probing {probing.probe_blocks(cfg)} blocks of {bench.name}/{cfg.preset} on this GPU for perf.plan=auto "
        f"(once per GPU model and software version; cached in {probing.cache_dir()})")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.yaml"
        save_config(cfg, config)
        code, data = _measured(str(config))
    if data is None:
        raise UserError(f"the layout probe of {bench.name}/{cfg.preset} failed (exit code {code}; see above); "
                        "set perf.plan=manual with the layout keys to run without it")  # fmt: skip
    probing.save(cfg, data)
    return data


def _measured(*args: str) -> tuple[int, Any]:
    """This module's :func:`main` with ``args`` in a process of its own (its GPU memory is freed when it ends): the
    exit code and the JSON it wrote (None where it wrote none)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        code = run_to_end([sys.executable, "-m", "trainbench.measure.plan", *args, str(out)], what="the layout probe")
        return code, json.loads(out.read_text()) if code == 0 and out.exists() else None


def block_probe(data: dict, ranks: int = 1) -> BlockProbe:
    """The probe's figures for a plan of ``ranks`` ranks a node: with the link's share a GPU keeps while that many
    copy at once, where it was measured."""
    found = BlockProbe(**{f.name: data[f.name] for f in dataclasses.fields(BlockProbe) if f.name in data})
    shared = data.get("shared_link", {}).get(str(ranks)) if ranks > 1 else None
    if shared is None:
        return found
    return dataclasses.replace(found, to_host_shared_bytes_s=shared[0], to_gpu_shared_bytes_s=shared[1])


def shared_link(bench: Benchmark, cfg: RunConfig, data: dict, here: bool, say) -> dict:
    """The probe ``data`` with the host link's rates one GPU keeps while the node's ``distributed.nproc`` GPUs copy at
    once (``shared_link``, by the count of GPUs): measured in a process of its own and cached with the probe where
    missing and this machine has the GPUs (``here``); as it is on one rank a node. Where the measurement fails, the
    plan counts one GPU's rates and says so."""
    ranks = cfg.distributed.nproc
    if ranks < 2 or not here or str(ranks) in data.get("shared_link", {}):
        return data
    say(f"measuring the host link with {ranks} GPUs copying at once for perf.plan=auto (cached with the probe)")
    code, rates = _measured("--link", str(ranks))
    if rates is None:
        say(f"the host link's measurement with {ranks} GPUs failed (exit code {code}; see above): the plan counts the "
            "link's rates of one GPU copying alone")  # fmt: skip
        return data
    data = data | {"shared_link": data.get("shared_link", {}) | {str(ranks): rates}}
    from trainbench.measure import probe as probing

    probing.save(bench.probe_config(cfg), data)
    return data


def resources(cfg: RunConfig, data: dict, here: bool) -> Resources:
    """One rank's share of the machine: the GPU as the probe found it (or as ``perf.gpu_memory_gib`` makes it), the
    host's memory (a job's: its node's, as the probe found it there) over the ranks of a node."""
    host = host_available_bytes() if here else data["host_available_bytes"]
    gpu, name = int(data["gpu_free_bytes"]), data["gpu_name"]
    if cfg.perf.gpu_memory_gib is not None:  # a GPU of that size, with what this one had taken (the context) taken
        gpu = min(gpu, int(cfg.perf.gpu_memory_gib * GIB) - (int(data["gpu_total_bytes"]) - gpu))
        name += f" (perf.gpu_memory_gib={cfg.perf.gpu_memory_gib:g})"
    return Resources(gpu_bytes=gpu, host_bytes=host // cfg.distributed.nproc,
                     gpus=cfg.distributed.world_size, gpu_name=name,
                     fp8=tuple(data["capability"]) >= (8, 9))  # fmt: skip


def planned(bench: Benchmark, cfg: RunConfig, say, here: bool = True) -> tuple[RunConfig, list[str]]:
    """The config with the layout ``perf.plan=auto`` chose and the lines saying why (nothing to do for
    ``perf.plan=manual`` or a resumed run, whose saved config holds its plan). ``here``: the run's GPUs are on
    this machine (else, as for a Slurm job, only a cached probe can be used)."""
    if cfg.perf.plan != "auto" or cfg.resume:
        return cfg, []
    if not bench.family.plans_layout:
        raise ConfigError(f"perf.plan=auto: {bench.name} has no layout to plan (its keys are used as given); "
                          "set perf.plan=manual")  # fmt: skip
    if (resolve_device(cfg.device) if here else cfg.device) == "cpu":
        return cfg, [f"perf.plan=auto: no GPU here, nothing to plan ({bench.name}'s layout keys as given)"]
    data = shared_link(bench, cfg, probe(bench, bench.probe_config(cfg), here, say, cfg), here, say)
    ranks = cfg.distributed.nproc
    p = block_probe(data, ranks)
    planned_cfg, lines = bench.plan_layout(cfg, resources(cfg, data, here), p)
    return planned_cfg, lines + [f"  probe: {data['gpu_name']}, a block keeps {data['kept_bytes'] / GIB:.2f} GiB, "
                                 f"forward {data['forward_s'] * 1e3:.1f} ms, backward {data['backward_s'] * 1e3:.1f} "
                                 f"ms{_clock(data)}; host link {data['to_host_bytes_s'] / 1e9:.0f} GB/s out, "
                                 f"{data['to_gpu_bytes_s'] / 1e9:.0f} GB/s back{_busy(data)}"
                                 f"{_shared(p, ranks)}{_device_copies(data, ranks)}"]  # fmt: skip


def _clock(data: dict) -> str:
    """The SM clock and power the probe's timed steps ran at, where sampled: a step of the whole model may run at a
    lower clock (a power cap), and then slower than planned; the seconds of steps run before them, where set; and the
    blocks of its model, where the probe says (older ones built 2)."""
    mhz, watts = data.get("sm_clock_mhz"), data.get("power_w")
    said = [f"at {mhz:,.0f} MHz, {watts:.0f} W"] if mhz and watts else []
    if data.get("sustained_s"):  # perf.probe_sustained_s
        said.append(f"after {data['sustained_s']:g} s of steps")
    if data.get("blocks"):  # perf.probe_blocks
        said.append(f"{data['blocks']} blocks a step")
    return f" ({', '.join(said)})" if said else ""


def _busy(data: dict) -> str:
    """The link's rates while a step runs, which the plan charges, where the probe measured them."""
    out, back = data.get("to_host_busy_bytes_s"), data.get("to_gpu_busy_bytes_s")
    if not out or not back:
        return ""
    return f" idle, {out / 1e9:.0f} and {back / 1e9:.0f} GB/s while a step runs (the plan's)"


def _device_copies(data: dict, ranks: int) -> str:
    """The GPU's own copy rate, which FSDP2's copies are charged at, on more than one rank where it was measured."""
    rate = data.get("device_copy_bytes_s")
    return f"; the GPU's memory copies {rate / 1e9:,.0f} GB/s (FSDP2's are charged at it)" if rate and ranks > 1 else ""


def _shared(p: BlockProbe, ranks: int) -> str:
    """The link's rates with the node's GPUs copying at once, where the plan scales its rates by them."""
    if p.to_host_shared_bytes_s is None or p.to_gpu_shared_bytes_s is None:
        return ""
    return (f"; with {ranks} GPUs copying at once {p.to_host_shared_bytes_s / 1e9:.0f} and "
            f"{p.to_gpu_shared_bytes_s / 1e9:.0f} GB/s each, idle (the plan's rates scaled by that share)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``CONFIG OUT``: probe the config's model on GPU 0 (measure/probe.py) and write the figures to OUT (JSON).
    ``--link N OUT``: the host link's rates one GPU keeps while N GPUs copy at once (measure/probe.link_rates), as a
    JSON pair (to the host, back)."""
    import torch

    from trainbench.console import console
    from trainbench.measure.probe import link_rates, measure, probe_blocks
    from trainbench.resolve import allocator_settings, load_run_config

    argv = sys.argv[1:] if argv is None else argv
    if argv[0] == "--link":
        gpus = min(int(argv[1]), torch.cuda.device_count())
        Path(argv[2]).write_text(json.dumps(list(link_rates(gpus=gpus))) + "\n")
        return 0
    bench, cfg = load_run_config(Path(argv[0]))
    allocator_settings(bench)
    try:
        data = measure(cfg, bench)
    except torch.OutOfMemoryError:
        console.print(f"error: {probe_blocks(cfg)} blocks of {bench.name}/{cfg.preset} do not fit this GPU at this "
                      "shape: set perf.probe_blocks lower (2 at least)")  # fmt: skip
        return 1
    except UserError as exc:
        console.print(f"error: {exc}")
        return 1
    Path(argv[1]).write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
