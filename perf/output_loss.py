"""The output layer over the vocabulary and its summed cross entropy, forward and backward, alone, at
gpt_oss_20b's shape (width 2,880, 201,088 words, 4 x 8,192 rows a micro-batch): each way's time, memory and values.

Ways, each through the product's own functions, the fp32 weight under bf16 autocast as the runs keep it, 4
micro-batches a step and the step's after-step work (the weight's casts made anew) between steps:
- ``bf16``: ``decoder.lm_loss`` compiled, as a run without ``model.output_precision=fp8``;
- ``torchao``: the same compiled loss through torchao's float8 layer (``fp8.train_blocks_in_fp8`` on the output layer),
  its weight cast once a step (``fp8.cast_weights_once_a_step``): ``model.output_precision=fp8`` as first built;
- ``fp8_output``: ``fp8_output.lm_loss_fp8`` with its casts once a step (``fp8_output.cache_output_casts``): the
  product's way now (its gradients taken in the forward, ``fp8_output.CHUNK_ROWS`` rows at a time).
Each way: milliseconds a micro-batch (median over the steps), peak memory above what the inputs and the weight hold,
its loss and gradients against ``bf16``'s. Then the product's two kernels alone (the log-sum-exp at several column
blocks, the gradient's casts at several tiles, a bf16 copy of the logits as the bandwidth's yardstick) and the kernel
table of one profiled step of ``fp8_output``.

    python perf/output_loss.py --out OUT/output_loss.json [--rows 32768]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from timing import cuda_ms  # noqa: E402  (perf/timing.py, beside this script)

from trainbench.families import fp8  # noqa: E402
from trainbench.families.decoder import fp8_output  # noqa: E402
from trainbench.families.decoder.model import lm_loss  # noqa: E402

MICRO_BATCHES = 4


class Head(nn.Module):
    """The output layer and the loss function, called as ``DecoderLM.forward`` calls them."""

    def __init__(self, width: int, vocab: int, loss_fn):
        super().__init__()
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.loss_fn = loss_fn

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(hidden, self.lm_head, targets)


def build(way: str, width: int, vocab: int):
    """The way's layer on CUDA (the same weights for every way) and what runs after each step."""
    torch.manual_seed(0)
    head = Head(width, vocab, fp8_output.lm_loss_fp8 if way == "fp8_output" else torch.compile(lm_loss, dynamic=False))
    after_step = lambda: None  # noqa: E731
    if way == "torchao":
        fp8.train_blocks_in_fp8(head, in_blocks=lambda name: name == "lm_head")
    head = head.cuda()
    nn.init.normal_(head.lm_head.weight, std=0.02)
    if way == "torchao":
        after_step = fp8.cast_weights_once_a_step(head)
    elif way == "fp8_output":
        after_step = fp8_output.cache_output_casts(head)
    return head, after_step


def measure(way: str, rows: int, width: int, vocab: int, steps: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The way's figures, and its first micro-batch's hidden-state gradient and first step's weight gradient."""
    head, after_step = build(way, width, vocab)
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = [torch.randn(1, rows, width, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)]
    targets = [torch.randint(0, vocab, (1, rows), device="cuda", generator=gen) for _ in range(2)]
    losses, times, grads = [], [], []

    def micro_batch(i: int) -> None:
        h = hidden[i % 2].requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = head(h, targets[i % 2])
        loss.backward()
        losses.append(loss.detach())

    for step in range(steps + 1):  # the first step compiles and is not timed
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        for i in range(MICRO_BATCHES):
            ms = cuda_ms(lambda i=i: micro_batch(i))
            times += [ms] if step else []
            grads += [hidden[0].grad.clone()] if step == 0 and i == 0 else []
        grads += [head.lm_head.weight.grad.clone()] if step == 0 else []
        for t in hidden:
            t.grad = None
        head.lm_head.weight.grad = None
        after_step()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    result = {"way": way, "ms_a_micro_batch": sorted(times)[len(times) // 2], "peak_gib_above_inputs": round(peak, 2),
              "loss": losses[0].item()}  # fmt: skip
    return result, grads[0], grads[1]


def kernels_alone(rows: int, vocab: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    out = [{"kernel": "bf16 copy of the logits", "ms": min(cuda_ms(logits.clone) for _ in range(5)),
            "bytes": 4 * logits.numel()}]  # fmt: skip
    for block in (1024, 2048, 4096, 8192):
        ms = min(cuda_ms(lambda b=block: fp8_output.rows_lse(logits, targets, block=b)) for _ in range(5))
        out.append({"kernel": "log-sum-exp", "block": block, "ms": ms, "bytes": 2 * logits.numel()})
    lse = fp8_output.rows_lse(logits, targets)[0]
    for tile in ((64, 64), (64, 128), (128, 64), (128, 128), (32, 256)):
        ms = min(cuda_ms(lambda t=tile: fp8_output.grad_casts(logits, lse, targets, tile=t)) for _ in range(5))
        out.append({"kernel": "gradient's casts", "tile": list(tile), "ms": ms, "bytes": 4 * logits.numel()})
    for r in out:
        r["tb_per_s"] = round(r["bytes"] / r["ms"] / 1e9, 2)
    return out


def profiled_step(rows: int, width: int, vocab: int) -> str:
    head, after_step = build("fp8_output", width, vocab)
    h = torch.randn(1, rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, vocab, (1, rows), device="cuda")
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            head(h, t).backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(MICRO_BATCHES):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                head(h, t).backward()
        after_step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--rows", type=int, default=32768, help="rows a micro-batch (micro-batch x sequence)")
    parser.add_argument("--width", type=int, default=2880)
    parser.add_argument("--vocab", type=int, default=201088)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ways", default="bf16,torchao,fp8_output", help="which ways, comma-separated (bf16 first)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: perf/output_loss.py times CUDA kernels and needs a GPU", file=sys.stderr)
        return 2
    ways, grads = [], {}
    for way in args.ways.split(","):
        result, grad, weight_grad = measure(way, args.rows, args.width, args.vocab, args.steps)
        grads[way] = grad.float(), weight_grad.float()
        torch.cuda.empty_cache()
        for i, name in enumerate(("hidden_grad_rel_to_bf16", "weight_grad_rel_to_bf16")):
            want = grads["bf16"][i]
            result[name] = float((grads[way][i] - want).norm() / want.norm())
        ways.append(result)
        print(json.dumps(result), flush=True)
    del grads
    torch.cuda.empty_cache()
    kernels = kernels_alone(args.rows, args.vocab)
    print(json.dumps(kernels, indent=1), flush=True)
    torch.cuda.empty_cache()
    table = profiled_step(args.rows, args.width, args.vocab)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": args.rows, "width": args.width,
                                    "vocab": args.vocab, "ways": ways, "kernels": kernels, "profile": table},
                                   indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
