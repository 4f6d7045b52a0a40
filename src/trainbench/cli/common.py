"""What the commands share: a table on the console, the arguments that pick a run's config."""

from __future__ import annotations


def print_table(title: str, head: list[str], rows: list[list[str]]) -> None:
    """A rich table of ``rows`` under ``head``, its cells shown as text."""
    from rich.table import Table
    from rich.text import Text

    from trainbench.console import console

    # Cells are data (a plugin's description, a results folder's values): shown as text, never read as markup.
    table = Table(title=Text(str(title)))
    for h in head:
        table.add_column(Text(str(h)))
    for row in rows:
        table.add_row(*(Text(str(cell)) for cell in row))
    console.print(table)


def add_config_arguments(parser, config_help: str = "YAML overrides; may repeat") -> None:
    """The arguments every command that builds a run's config takes beside its benchmark and preset: ``--config``
    files of overrides, applied in order, then ``key=value`` overrides (the last positional)."""
    parser.add_argument("--config", action="append", default=[], metavar="FILE.yaml", help=config_help)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
