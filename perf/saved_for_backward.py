"""What a compiled llama block in FP8 keeps from its forward for its backward: one ``Block`` of the decoder at the
given width, its linear layers in torchao's float8 training (``fp8.train_blocks_in_fp8``), compiled through
AOTAutograd with the min-cut partitioner that Inductor uses (its forward and backward left as graphs, not compiled
to kernels, so it runs on the CPU), with the weights cast in every call (torchao's way) and once a step
(``fp8.cast_weights_once_a_step``). For each way, every tensor the backward graph takes from the forward: those
that are the block's own inputs (weights, casts made beforehand: held anyway) and those the forward computed (held
per micro-batch until its backward).

    python perf/saved_for_backward.py --out OUT/saved.json [--width 4096 --ffn 14336 --heads 32 --kv-heads 8
        --rows 1 --seq 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainbench.families import fp8  # noqa: E402
from trainbench.families.decoder.model import Block, DecoderConfig, rope_tables  # noqa: E402


def saved(cfg: DecoderConfig, rows: int, seq: int, once: bool) -> list[dict]:
    """The tensors the backward of one compiled FP8 block takes from its forward, each with its bytes."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    torch.manual_seed(0)
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([Block(cfg)])
    fp8.train_blocks_in_fp8(root)
    rope = rope_tables(cfg, seq, torch.device("cpu"))
    root.forward = lambda x: root.model.layers[0](x, rope)
    if once:
        fp8.cast_weights_once_a_step(root, compiled=False)
    found = []

    def backward_graph(gm: torch.fx.GraphModule, inputs) -> torch.fx.GraphModule:
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if node.op != "placeholder" or not isinstance(value, torch.Tensor) or node.name.startswith("tangents"):
                continue
            found.append({"name": node.name, "input": node.name.startswith("primals"), "dtype": str(value.dtype),
                          "shape": list(value.shape), "bytes": value.numel() * value.element_size()})  # fmt: skip
        return gm

    def backend(gm: torch.fx.GraphModule, example):
        return aot_module_simplified(gm, example, fw_compiler=lambda g, _: g, bw_compiler=backward_graph,
                                     partition_fn=min_cut_rematerialization_partition)  # fmt: skip

    root.model.layers[0].compile(backend=backend, dynamic=False)
    x = torch.randn(rows, seq, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = root(x)
    out.float().sum().backward()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336, help="the MLP's width")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    try:
        import torchao  # noqa: F401
    except ImportError:
        print(
            "error: perf/saved_for_backward.py needs torchao: pip install -e '.[fp8]' in trainbench's clone",
            file=sys.stderr,
        )
        return 2
    cfg = DecoderConfig(vocab_size=256, hidden_size=args.width, num_layers=1, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, intermediate_size=args.ffn, max_seq_length=args.seq,
                        fused_qkv=True)  # fmt: skip
    result = {"width": args.width, "ffn": args.ffn, "rows": args.rows, "seq": args.seq, "torch": torch.__version__}
    for way, once in (("per_call", False), ("once_a_step", True)):
        tensors = saved(cfg, args.rows, args.seq, once)
        computed = sum(t["bytes"] for t in tensors if not t["input"])
        result[way] = {"computed_mib": computed / 2**20, "tensors": tensors}
        print(f"{way:12s} the forward's own tensors kept for the backward: {computed / 2**20:8.2f} MiB")
        for t in tensors:
            if not t["input"] and t["dtype"] == "torch.float8_e4m3fn":
                print(f"    {t['name']:14s} {t['dtype']} {t['shape']} {t['bytes'] / 2**20:.2f} MiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
