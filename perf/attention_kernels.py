"""Attention kernels for BERT-large's packed rows on this GPU: forward and backward time, and agreement.

Packed rows are built from a synthetic MLPerf-like length mix (25 % of samples
uniform in [470, 512] tokens, 75 % uniform in [16, 370]) with the project's packer (LPFHP) at 3 and at 6
sequences per row at most. 48 rows of 512 tokens, 16 heads of 64, bf16. For each packing, times one
attention call of a BERT-large layer, forward and forward + backward (median of CUDA-event timings). Every
kernel starts from the fused QKV projection's output, [tokens, 3, heads, 64], as the model has it, so the
times include splitting it into query, key and value (and stacking their gradients back) where a kernel needs
that. The kernels:

- `flash_varlen`: flash attention over variable-length sequences (`aten._flash_attention_forward`, FA2), the
  trainer's default (`model.packed_attention=varlen`);
- `cudnn_frontend_varlen`: cuDNN's fused attention over the same sequences, built with the cuDNN frontend
  (`model.packed_attention=cudnn`): it reads query, key and value in place from the projection and writes
  their gradients into one tensor (needs the `nvidia-cudnn-frontend` package; reported as an error without);
- `cudnn_varlen`: cuDNN's fused attention over the same ragged sequences (`aten._cudnn_attention_forward`
  with cumulative offsets, eager: ATen has no fake kernel for it, so it does not compile);
- `flash_varlen_dropout`, `cudnn_frontend_varlen_dropout` and `cudnn_varlen_dropout`: the same at attention
  dropout 0.1 (time only);
- `flex`: FlexAttention with the document block mask, compiled;
- `cudnn_dense_nomask` and `flash_dense_nomask`: every row as one 512-token sequence, no mask. They do more
  work than the packed kernels (all 512 x 512 scores); they show each kernel's raw speed at this shape.

Outputs and input gradients of every packed kernel are compared with the dense-mask SDPA result in fp32.

    python perf/attention_kernels.py --out OUT

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
sys.path.insert(0, str(REPO / "perf"))

from fp8_gemm import bench  # noqa: E402

from trainbench.data.packing import lpfhp  # noqa: E402
from trainbench.families.cudnn_attention import cudnn_segments, cudnn_varlen_attention  # noqa: E402
from trainbench.families.encoder.model import document_mask, varlen_attention, varlen_segments  # noqa: E402

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
    """name -> attention(qkv) on [tokens, 3, heads, dim] -> [tokens, heads, dim], for the packed rows
    ``seq_ids``."""
    segments = varlen_segments(seq_ids, per_row)
    block_mask = document_mask(seq_ids)
    cudnn_segs = None

    def dense(backend):
        def run(qkv):
            with torch.nn.attention.sdpa_kernel(backend):
                return from_rows(F.scaled_dot_product_attention(*(as_rows(t) for t in qkv.unbind(1))))

        return run

    def cudnn_frontend(dropout_p):
        def run(qkv):
            nonlocal cudnn_segs
            cudnn_segs = cudnn_segs or cudnn_segments(*segments, HEADS * DIM)
            return cudnn_varlen_attention(qkv, cudnn_segs, dropout_p)

        return run

    return {
        "flash_varlen": lambda qkv: varlen_attention(*qkv.unbind(1), segments, 0.0),
        "cudnn_frontend_varlen": cudnn_frontend(0.0),
        "cudnn_varlen": lambda qkv: cudnn_varlen(*qkv.unbind(1), segments, 0.0),
        "flash_varlen_dropout": lambda qkv: varlen_attention(*qkv.unbind(1), segments, 0.1),
        "cudnn_frontend_varlen_dropout": cudnn_frontend(0.1),
        "cudnn_varlen_dropout": lambda qkv: cudnn_varlen(*qkv.unbind(1), segments, 0.1),
        "flex": lambda qkv: from_rows(flex(*(as_rows(t) for t in qkv.unbind(1)), block_mask=block_mask)),
        "cudnn_dense_nomask": dense(torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
        "flash_dense_nomask": dense(torch.nn.attention.SDPBackend.FLASH_ATTENTION),
    }


def measure(name: str, fn, qkv, grad, ref, ref_grads, real) -> dict:
    """Agreement with the fp32 reference at real tokens (packed kernels without dropout), and median times."""
    row = {"kernel": name}
    qkv = qkv.detach().clone().requires_grad_()
    out = fn(qkv)
    out.backward(grad)
    if not name.endswith(("nomask", "dropout")):
        row["out_max_err"] = float((out.detach().float() - ref)[real].abs().max())
        for i, part in enumerate("qkv"):
            row[f"grad_{part}_max_err"] = float((qkv.grad[:, i].float() - ref_grads[i])[real].abs().max())
        row["ref_out_max"] = float(ref[real].abs().max())
        row["ref_grad_q_max"] = float(ref_grads[0][real].abs().max())
    if name.endswith("dropout"):  # dropout zeroes about p of the probabilities: the output moves, stays finite
        row["finite"] = bool(torch.isfinite(out).all() and torch.isfinite(qkv.grad).all())
        row["out_mean_abs_change"] = float((out.detach().float() - ref)[real].abs().mean())

    def fwd():
        with torch.no_grad():
            fn(qkv)

    row["forward_ms"] = bench(fwd)
    row["forward_backward_ms"] = bench(lambda: fn(qkv).backward(grad))
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
        qkv = torch.randn(ROWS * SEQ, 3, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(ROWS * SEQ, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        # fp32 reference: dense-mask SDPA on the same inputs
        ref_in = [t.float().requires_grad_() for t in qkv.unbind(1)]
        ref = from_rows(F.scaled_dot_product_attention(*(as_rows(t) for t in ref_in), attn_mask=dense_mask))
        ref.backward(grad.float())
        ref_grads = [t.grad for t in ref_in]
        real = (seq_ids > 0).flatten()  # compare at real tokens (padding attends to padding in every kernel)
        fill = float(real.float().mean())
        for name, fn in kernels_for(seq_ids, per_row, flex).items():
            try:
                row = measure(name, fn, qkv, grad, ref.detach(), ref_grads, real)
            except Exception as e:  # a kernel this build cannot run is a result, not a crash
                row = {"kernel": name, "error": f"{type(e).__name__}: {e}"[:500]}
            row.update(per_row=per_row, fill=fill)
            print(json.dumps(row), flush=True)
            results["runs"].append(row)
            (args.out / "attention_kernels.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
