"""Entry point of each torchrun process: ``python -m trainbench.launch.worker RUN_DIR INDEX``."""

from __future__ import annotations

import sys
from pathlib import Path

from trainbench.console import console
from trainbench.errors import UserError
from trainbench.launch.local import experiment_config, load_run_config
from trainbench.train.distributed import init_distributed, resolve_device, shutdown
from trainbench.train.loop import train


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir, index = Path(argv[0]), int(argv[1])
    bench, cfg = load_run_config(run_dir / "config.yaml")
    cfg = experiment_config(cfg, index)
    info = init_distributed(resolve_device(cfg.device), cfg.distributed.backend)
    assert info.world_size == cfg.distributed.nproc, "torchrun's WORLD_SIZE differs from distributed.nproc"
    try:
        train(cfg, bench, run_dir, index, info)
    except UserError as exc:
        if info.is_main:
            console.print(f"[red]error:[/red] {exc}")
        return 1
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
