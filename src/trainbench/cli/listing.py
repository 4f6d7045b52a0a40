"""`trainbench list`: the registered benchmarks, their presets and rulesets."""

from __future__ import annotations

from trainbench.cli.common import print_table


def add_list_parser(sub) -> None:
    sub.add_parser("list", help="list benchmarks and their presets", description="List benchmarks and presets.")


def cmd_list(_args) -> int:
    from trainbench.benchmarks import BUILT_IN, ENTRY_POINTS, ORIGINS, PLUGIN_ERRORS, registry
    from trainbench.console import console

    rows = [[b.name, b.mlperf_name, ", ".join(b.presets), b.description] for b in registry().values()]
    print_table("trainbench benchmarks", ["benchmark", "MLPerf name", "presets", "description"], rows)
    rulesets = "; ".join(f"{b.name} {', '.join(b.rulesets)}" for b in registry().values())
    console.print(f"mlperf-logging rulesets, the default first (--ruleset): {rulesets}", markup=False)
    origins = "; ".join(f"{name} ({origin})" for name, origin in ORIGINS.items() if origin != BUILT_IN)
    console.print(f"not built in (installed packages declare them as {ENTRY_POINTS} entry points): {origins or 'none'}",
                  markup=False)  # fmt: skip
    for error in PLUGIN_ERRORS:
        console.print(error, style="yellow", markup=False)
    return 0
