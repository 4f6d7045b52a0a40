"""The families' architecture files hold the architecture only: what a block keeps for its backward (activation
checkpointing, host offload) and the FP8 speed paths are applied from outside, by the placement."""

import ast
from pathlib import Path

import pytest

FAMILIES = Path(__file__).resolve().parents[1] / "src" / "trainbench" / "families"
ARCHITECTURE = sorted(FAMILIES.glob("*/model.py")) + [
    FAMILIES / "decoder" / "moe.py",
    FAMILIES / "decoder" / "gpt_oss.py",
]

# Modules an architecture file may not import (at module level or inside a function), and attributes it may not use.
FORBIDDEN_MODULES = ("torch.utils.checkpoint", "torchao", "trainbench.families.fp8",
                     "trainbench.families.decoder.offload", "trainbench.families.decoder.memory",
                     "trainbench.families.decoder.moe_fp8", "trainbench.families.decoder.fp8_output")  # fmt: skip
FORBIDDEN_ATTRIBUTES = {"checkpoint", "saved_tensors_hooks", "_scaled_grouped_mm", "float8_e4m3fn", "float8_e5m2"}


def imports(tree: ast.AST, path: Path) -> set[str]:
    """Every module ``tree`` imports, and every name it imports from one, as dotted names."""
    out = set()
    package = ".".join(path.relative_to(FAMILIES.parent.parent).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                )
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def offences(source: str, path: Path) -> list[str]:
    """What of the forbidden modules and attributes ``source`` (the text of the file at ``path``) imports or uses."""
    tree = ast.parse(source)
    found = [name for name in imports(tree, path) if name.startswith(FORBIDDEN_MODULES)]
    found += [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in FORBIDDEN_ATTRIBUTES]
    found += [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in FORBIDDEN_ATTRIBUTES]
    return sorted(set(found))


@pytest.mark.parametrize("path", ARCHITECTURE, ids=lambda p: str(p.relative_to(FAMILIES)))
def test_an_architecture_file_imports_no_checkpointing_offload_or_fp8(path):
    assert path.exists()
    found = offences(path.read_text(), path)
    assert found == [], f"{path.relative_to(FAMILIES)} holds what the placement applies from outside: {found}"


def test_the_check_finds_checkpointing_offload_and_fp8_code():
    """The check itself: each kind of import and use that the architecture files must not hold is found."""
    where = FAMILIES / "decoder" / "sample.py"
    cases = {
        "from torch.utils.checkpoint import checkpoint\n": "torch.utils.checkpoint",
        "def f():\n    from trainbench.families.decoder.offload import recompute_from_host\n":
            "trainbench.families.decoder.offload",
        "from . import moe_fp8\n": "trainbench.families.decoder.moe_fp8",
        "from .memory import run_from_outside\n": "trainbench.families.decoder.memory",
        "from trainbench.families.fp8 import E4M3\n": "trainbench.families.fp8",
        "y = torch._scaled_grouped_mm(a, b)\n": "_scaled_grouped_mm",
        "x = torch.utils.checkpoint.checkpoint(f, x)\n": "checkpoint",
        "with torch.autograd.graph.saved_tensors_hooks(p, u):\n    pass\n": "saved_tensors_hooks",
    }  # fmt: skip
    for source, expected in cases.items():
        assert expected in offences(source, where), (source, offences(source, where))
    assert offences("import torch\nfrom .moe import MoE\nx = torch.bmm(a, b)\n", where) == []
