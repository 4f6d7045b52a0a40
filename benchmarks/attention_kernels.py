"""Attention kernels for BERT-large's packed rows on this GPU: forward and backward time, and agreement.

Packed rows are built from the synthetic MLPerf-like length mix of `bert_throughput.py` (25 % of samples
uniform in [470, 512] tokens, 75 % uniform in [16, 370]) with the project's packer (LPFHP) at 3 and at 6
sequences per row at most. 48 rows of 512 tokens, 16 heads of 64, bf16. For each packing, times one
attention call of a BERT-large layer, forward and forward + backward (median of CUDA-event timings), with:

- `flash_varlen`: flash attention over variable-length sequences (`aten._flash_attention_forward`, FA2), what
  the trainer runs now (`model.packed_attention=varlen`);
- `cudnn_varlen`: cuDNN's fused attention over the same ragged sequences (`aten._cudnn_attention_forward`
  with cumulative offsets, eager: ATen has no fake kernel for it, so it does not compile);
- `flash_varlen_dropout` and `cudnn_varlen_dropout`: the same at attention dropout 0.1 (time only);
- `flex`: FlexAttention with the document block mask, compiled;
- `cudnn_dense_nomask` and `flash_dense_nomask`: every row as one 512-token sequence, no mask. They do more
  work than the packed kernels (all 512 x 512 scores); they show each kernel's raw speed at this shape.

Outputs and input gradients of every packed kernel are compared with the dense-mask SDPA result in fp32.

    python benchmarks/attention_kernels.py --out OUT

Writes OUT/attention_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from fp8_gemm import bench  # noqa: E402

from trainbench.data.packing import lpfhp  # noqa: E402
from trainbench.models.bert import document_mask, varlen_attention, varlen_segments  # noqa: E402

ROWS, SEQ, HEADS, DIM = 48, 512, 16, 64


def packed_sequence_ids(per_row: int, seed: int = 0) -> np.ndarray:
    """sequence_ids [ROWS, SEQ] of the first ROWS packs of a synthetic-mix plan (1, 2, ... then 0 padding)."""
    rng = np.random.default_rng(seed)
    n = 20000
    lengths = np.where(rng.random(n) < 0.25, rng.integers(470, 513, n), rng.integers(16, 371, n))
    plan = lpfhp(np.bincount(lengths, minlength=SEQ + 1), SEQ, per_row)
    packs = [p for p, count in plan for _ in range(count)]
    packs = [packs[i] for i in rng.permutation(len(packs))[:ROWS]]
    ids = np.zeros((ROWS, SEQ), np.int64)
    for r, pack in enumerate(packs):
        ends = np.cumsum(pack)
        for s, (lo, hi) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends, strict=True)):
            ids[r, lo:hi] = s + 1
    return ids


def cudnn_varlen(q, k, v, segments, dropout_p: float) -> torch.Tensor:
    """cuDNN's fused attention over ragged sequences, called through ATen (eager, ATen's own autograd; it has no
    fake kernel, so it does not compile)."""
    cu, n = segments.cu_seqlens, segments.max_len
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, n, n, True, dropout_p, False, False)[0]


def as_rows(t: torch.Tensor) -> torch.Tensor:  # [tokens, heads, dim] -> [rows, heads, seq, dim]
    return t.view(ROWS, SEQ, HEADS, DIM).transpose(1, 2)


def from_rows(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(ROWS * SEQ, HEADS, DIM)


def kernels_for(seq_ids: torch.Tensor, per_row: int, flex) -> dict:
    """name -> attention(q, k, v) on [tokens, heads, dim], for the packed rows ``seq_ids``."""
    segments = varlen_segments(seq_ids, per_row)
    block_mask = document_mask(seq_ids)

    def dense(backend):
        def run(q, k, v):
            with torch.nn.attention.sdpa_kernel(backend):
                return from_rows(F.scaled_dot_product_attention(as_rows(q), as_rows(k), as_rows(v)))

        return run

    return {
        "flash_varlen": lambda q, k, v: varlen_attention(q, k, v, segments, 0.0),
        "cudnn_varlen": lambda q, k, v: cudnn_varlen(q, k, v, segments, 0.0),
        "flash_varlen_dropout": lambda q, k, v: varlen_attention(q, k, v, segments, 0.1),
        "cudnn_varlen_dropout": lambda q, k, v: cudnn_varlen(q, k, v, segments, 0.1),
        "flex": lambda q, k, v: from_rows(flex(as_rows(q), as_rows(k), as_rows(v), block_mask=block_mask)),
        "cudnn_dense_nomask": dense(torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
        "flash_dense_nomask": dense(torch.nn.attention.SDPBackend.FLASH_ATTENTION),
    }


def measure(name: str, fn, q, k, v, grad, ref, ref_grads, real) -> dict:
    """Agreement with the fp32 reference at real tokens (packed kernels without dropout), and median times."""
    row = {"kernel": name}
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*ins)
    out.backward(grad)
    if not name.endswith(("nomask", "dropout")):
        row["out_max_err"] = float((out.detach().float() - ref)[real].abs().max())
        row["grad_q_max_err"] = float((ins[0].grad.float() - ref_grads[0])[real].abs().max())
        row["grad_v_max_err"] = float((ins[2].grad.float() - ref_grads[2])[real].abs().max())
        row["ref_out_max"] = float(ref[real].abs().max())
        row["ref_grad_q_max"] = float(ref_grads[0][real].abs().max())

    def fwd():
        with torch.no_grad():
            fn(*ins)

    row["forward_ms"] = bench(fwd)
    row["forward_backward_ms"] = bench(lambda: fn(*ins).backward(grad))
    row["per_step_ms_24_layers"] = 24 * row["forward_backward_ms"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cudnn": torch.backends.cudnn.version(), "runs": []}  # fmt: skip
    flex = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)
    for per_row in (3, 6):
        seq_ids = torch.from_numpy(packed_sequence_ids(per_row)).cuda()
        dense_mask = (seq_ids[:, None, :, None] == seq_ids[:, None, None, :]).contiguous()
        q, k, v = (torch.randn(ROWS * SEQ, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        grad = torch.randn_like(q)
        # fp32 reference: dense-mask SDPA on the same inputs
        ref_in = [t.float().requires_grad_() for t in (q, k, v)]
        ref = from_rows(F.scaled_dot_product_attention(*(as_rows(t) for t in ref_in), attn_mask=dense_mask))
        ref.backward(grad.float())
        ref_grads = [t.grad for t in ref_in]
        real = (seq_ids > 0).flatten()  # compare at real tokens (padding attends to padding in every kernel)
        fill = float(real.float().mean())
        for name, fn in kernels_for(seq_ids, per_row, flex).items():
            try:
                row = measure(name, fn, q, k, v, grad, ref.detach(), ref_grads, real)
            except Exception as e:  # a kernel this build cannot run is a result, not a crash
                row = {"kernel": name, "error": f"{type(e).__name__}: {e}"[:500]}
            row.update(per_row=per_row, fill=fill)
            print(json.dumps(row), flush=True)
            results["runs"].append(row)
            (args.out / "attention_kernels.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
