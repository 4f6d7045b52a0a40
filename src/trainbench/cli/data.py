"""`trainbench prepare` (a benchmark's data set on disk, each benchmark's options its own) and `trainbench convert`
(a reference checkpoint into trainbench's format)."""

from __future__ import annotations

import argparse

EXAMPLES_PREPARE = """examples:
  trainbench prepare bert --synthetic --preset tiny --out data/bert-tiny
  trainbench prepare bert --input wikitext-2/ --train-vocab 8000 --num-shards 16 --eval-samples 1000 --out data/wt2
  trainbench prepare llama31_8b --source c4/en --tokenizer tokenizer.json --out data/c4
  trainbench prepare llama2_70b_lora --synthetic --preset tiny --out data/lora-tiny

each benchmark's own options: trainbench prepare BENCHMARK --help
"""


def add_prepare_parser(sub, top: argparse.ArgumentParser, benchmarks: bool) -> None:
    """`prepare BENCHMARK`, one subparser a registered benchmark (none without ``benchmarks``): on ``top``,
    ``prepare_options`` (each benchmark's options) and ``broken_hooks`` (benchmark -> what its hook raised)."""
    prep = sub.add_parser(
        "prepare",
        help="write a benchmark's dataset to disk",
        description="Write a benchmark's dataset in the on-disk format its trainer reads: from its source "
        "(each benchmark's own options: trainbench prepare BENCHMARK --help) or synthetic (--synthetic).",
        epilog=EXAMPLES_PREPARE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The options every benchmark's preparation takes, documented once; each benchmark adds its own.
    parent = argparse.ArgumentParser(add_help=False)
    common = parent.add_argument_group("every benchmark's options")
    common.add_argument("--out", required=True, help="output folder (its data files and manifest.json)")
    common.add_argument("--seed", type=int, default=12345, help="random seed (default 12345, as MLPerf's)")
    common.add_argument("--force", action="store_true", help="replace a folder that already holds other data")
    common.add_argument("--no-progress", action="store_true", help="no progress bar")
    common.add_argument(
        "--synthetic",
        action="store_true",
        help="generate seeded synthetic data with learnable structure (no download needed)",
    )
    common.add_argument("--preset", default="tiny", help="preset whose shapes (sequence length, vocabulary) the "
                        "synthetic data takes (default tiny)")  # fmt: skip
    benches = prep.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    top.prepare_options = {}  # each benchmark's options: one that another benchmark owns is refused by name
    top.broken_hooks = {}  # benchmark -> the sentence of what its add_prepare_arguments raised
    for bench in _registered(benchmarks):
        # A hook of a plugin that raises (or adds an option every benchmark has) must break its own preparation
        # alone: tried on a parser of its own first, then added.
        trial = argparse.ArgumentParser(prog=f"trainbench prepare {bench.name}", parents=[parent], add_help=False)
        try:
            bench.add_prepare_arguments(trial)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit too: argparse exits on a clash of options
            top.broken_hooks[bench.name] = _hook_failure(bench.name, "add_prepare_arguments", e)
            continue
        own = benches.add_parser(
            bench.name,
            parents=[parent],
            help=str(bench.description),
            description=f"trainbench prepare {bench.name}: {bench.description}.",
            epilog=bench.prepare_examples if isinstance(bench.prepare_examples, str) else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        bench.add_prepare_arguments(own)
        top.prepare_options[bench.name] = {o for action in own._actions for o in action.option_strings}


def _registered(wanted: bool) -> list:
    """The registered benchmarks, or none where not ``wanted`` (then nothing imports them, nor torch)."""
    if not wanted:
        return []
    from trainbench.benchmarks import registry

    return list(registry().values())


def _hook_failure(name: str, hook: str, e: BaseException) -> str:
    """One sentence for a benchmark's hook that raised, naming where the benchmark comes from."""
    from trainbench.benchmarks import ORIGINS, plugin_failure

    return (f"benchmark {name} ({ORIGINS.get(name, 'registered in this process')}) is left out of `trainbench "
            f"prepare`: its {hook} failed: {plugin_failure(e)}")  # fmt: skip


def cmd_prepare(args) -> int:
    from trainbench.benchmarks import get_benchmark

    return get_benchmark(args.benchmark).prepare(args)


def add_convert_parser(sub) -> None:
    conv = sub.add_parser(
        "convert",
        help="convert a reference checkpoint to trainbench's format",
        description="Convert MLPerf's TensorFlow BERT checkpoint (needs TensorFlow: `pip install -e '.[tf]'` in "
        "trainbench's clone) into a state dict for model.init_checkpoint. HF safetensors weights need no conversion.",
    )
    conv.add_argument("benchmark", help="benchmark name (bert)")
    conv.add_argument("--tf-checkpoint", required=True, help="checkpoint prefix, e.g. model.ckpt-28252")
    conv.add_argument("--out", required=True, help="output .pt file")


def cmd_convert(args) -> int:
    from trainbench.benchmarks import get_benchmark

    return get_benchmark(args.benchmark).convert(args)
