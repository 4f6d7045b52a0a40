"""The experts' rows cast to e4m3 outside a compiled block (the expert-parallel dispatch): how fast each way runs on
this GPU, against the GPU's copy bandwidth.

Ways timed, each on bf16 rows [rows, width] at gpt_oss_20b's widths (2,880: the experts' input and the down
projection's gradient; 5,760: the gate and up projection's gradient), the row count changing between calls as the
rows that arrive at a rank do:
- ``eager``: ``trainbench.families.decoder.moe_fp8._e4m3`` run by torch's eager kernels;
- ``compiled-all-dynamic``: the same function compiled with every dimension dynamic (the product's way before);
- ``product``: ``trainbench.families.decoder.moe_fp8._rows_e4m3(t, compiled=True)``, what the dispatch calls by
  default; ``product-kernel``: the same by one Triton pass a row (``distributed.expert_row_casts=kernel``);
- ``copy``: ``t.clone()`` (reads and writes 2 bytes an element: the bandwidth ceiling's yardstick);
- ``wire-send`` and ``wire-receive`` (width 2,880, what ``distributed.expert_exchange=fp8`` adds to each of its
  all-to-alls): the rows cast to e4m3 and their exponents before they leave, and rebuilt in bf16 where they arrive,
  by the exchange's Triton kernels (``moe_fp8._wire_cast``, ``_wire_uncast``: one pass a row); ``-compiled``: the
  same functions compiled for a fixed width with the rows dynamic (``_e4m3_with_exponent``, ``_from_e4m3``), the
  product's way; against them, what half the bytes save on the wire (printed beside).
Each way's bytes are its reads and writes at the least: 2 bytes an element read, 1 written, 4 a row's scale (the
wire's: 1 read and 2 written, or the reverse, and a byte a row).

    python perf/row_cast.py --out OUT/row_cast.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainbench.families.decoder import moe_fp8 as moe  # noqa: E402
from trainbench.families.planner import NODE_COLLECTIVE_BYTES_S  # noqa: E402

WIDTHS = (2880, 5760)
ROWS = (65_536, 65_920, 64_896, 66_304)  # about 2 x 8,192 tokens x 4 choices a rank, changing a little each call


def timed(fn, inputs: list, repeats: int) -> float:
    """Median milliseconds a call over ``repeats`` rounds of the inputs (after one untimed round)."""
    for t in inputs:
        fn(t)
    times = []
    for _ in range(repeats):
        for t in inputs:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(t)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: perf/row_cast.py times CUDA kernels and needs a GPU", file=sys.stderr)
        return 2

    def rows_cast(t: torch.Tensor):  # a code object of its own: dynamo keeps its graphs apart from the product's
        return moe._e4m3(t, -1)

    all_dynamic = torch.compile(rows_cast, dynamic=True)
    ways = {
        "eager": rows_cast,
        "compiled-all-dynamic": all_dynamic,
        "product": lambda t: moe._rows_e4m3(t, compiled=True),
        "product-kernel": lambda t: moe._rows_e4m3(t, compiled="kernel"),
        "copy": lambda t: t.clone(),
    }
    send = torch.compile(moe._e4m3_with_exponent, dynamic=False)
    receive = torch.compile(moe._from_e4m3, dynamic=False)

    def compiled_send(t: torch.Tensor):
        torch._dynamo.maybe_mark_dynamic(t, 0)
        return send(t)

    def compiled_receive(packed: tuple[torch.Tensor, torch.Tensor]):
        for part in packed:
            torch._dynamo.maybe_mark_dynamic(part, 0)
        return receive(*packed, torch.bfloat16)

    results = []
    for width in WIDTHS:
        inputs = [torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) for rows in ROWS]
        elements = sum(t.numel() for t in inputs) / len(inputs)
        for name, fn in ways.items():
            ms = timed(fn, inputs, args.repeats)
            moved = elements * 4 if name == "copy" else elements * 3 + elements / width * 4
            results.append(
                {
                    "way": name,
                    "width": width,
                    "rows": list(ROWS),
                    "ms": round(ms, 4),
                    "gb_per_s": round(moved / ms / 1e6, 1),
                }
            )
            print(f"{name:22s} width {width}: {ms:.3f} ms a call, {moved / ms / 1e6:,.0f} GB/s")
        if width != 2880:
            continue
        packed = [moe._e4m3_with_exponent(t) for t in inputs]
        for name, fn, data in (("wire-send", moe._wire_cast, inputs), ("wire-send-compiled", compiled_send, inputs),
                               ("wire-receive", lambda p: moe._wire_uncast(*p, torch.bfloat16), packed),
                               ("wire-receive-compiled", compiled_receive, packed)):  # fmt: skip
            ms = timed(fn, data, args.repeats)
            moved = elements * 3 + elements / width
            results.append({"way": name, "width": width, "rows": list(ROWS), "ms": round(ms, 4),
                            "gb_per_s": round(moved / ms / 1e6, 1)})  # fmt: skip
            print(f"{name:22s} width {width}: {ms:.3f} ms a call, {moved / ms / 1e6:,.0f} GB/s")
        for ranks in (2, 4, 8):  # the bytes FP8 saves on the wire, at the planner's rate for one node's NVLink
            saved = elements * (ranks - 1) / ranks / NODE_COLLECTIVE_BYTES_S * 1e3
            print(f"  on {ranks} GPUs half the bytes save {saved:.3f} ms an all-to-all of these rows")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
