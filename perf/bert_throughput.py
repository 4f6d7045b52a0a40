"""BERT-large training throughput on one GPU: HF transformers against trainbench, on the same batches.

One process, one GPU, bf16 autocast, micro-batch 48, seq 512, LAMB for every model (the same optimizer cost):

1. the bf16 matmul peak of this GPU (8192^3 GEMMs), the denominator of MFU;
2. batches with a real length distribution: `trainbench prepare bert` on WikiText-2 with MLPerf's vocab and
   settings (fixed rows, and packed rows from the same samples);
3. batches with a documented synthetic length histogram meant to resemble MLPerf's Wikipedia data, about
   half of the 512 positions padding (Krell et al. 2021 report ~50 % padding for Wikipedia at 512): 25 % of
   samples uniform in [470, 512] tokens, 75 % uniform in [16, 370] (mean about 268);
4. for each: HF BertForPreTraining (torch.compile; its MLM head over all positions, as HF computes it),
   trainbench's BERT eager and compiled (MLM head at the masked positions only), compiled with the trainer's 4
   length bins (global batch 768 sorted, 16 micro-batches each cut to its bin), and on packed rows: compiled,
   with the fused (compiled) LAMB, with CUDA graphs, and with 96 rows per step, with FlexAttention document masks
   or varlen flash attention; at most 6 sequences per packed row instead of 3 (`packed6`, fuller rows), with 48,
   96 and 144 rows per step, with the residual stream in bf16 (`_bf16res`: model.low_precision_residual=true, the
   trainer's default) or in fp32 (every other configuration of ours, as they were measured before that default);
   with cuDNN's attention for the packed rows (`_cudnn_`: model.packed_attention=cudnn) against varlen flash
   attention, with dropout 0 and 0.1; compiled with max-autotune (`_autotune`: Triton GEMM templates against
   cuBLAS) or with every generated kernel's block sizes tuned by coordinate descent (`_tuned`); with the
   encoder's linear layers in FP8 (`_fp8*`: torchao's float8 training, tensorwise, rowwise, and rowwise with the
   weight gradient in bf16; `pip install torchao`); and with the large preset's dropout (0.1), where
   FlexAttention cannot run: the dense-mask SDPA path against varlen flash attention (which has dropout in its
   kernel); and varlen with the loss as it was before it stopped making the host wait (`ours_packed_varlen_index_loss`);
5. a profile of the packed varlen configuration: every GPU kernel's time and share (kernels_*.csv).

Reported per configuration: samples/s, real (non-pad) tokens/s, model TFLOP/s on real tokens and MFU against
the measured peak, peak memory, and the ratio to HF.

    python perf/bert_throughput.py --out OUT [--steps 20] [--data .bench-data]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainbench.models.bert import BertConfig, BertForPreTraining  # noqa: E402
from trainbench.optim.lamb import Lamb, param_groups  # noqa: E402
from trainbench.train.profiling import bf16_matmul_peak_tflops  # noqa: E402

MICRO = 48
SEQ = 512
PRED = 76
AUTOTUNE = "max-autotune-no-cudagraphs"
TUNED = "coordinate-descent"  # Inductor's default mode, each generated kernel's block sizes tuned by measurement
FP8_TW, FP8_ROW, FP8_GW_HP = "tensorwise", "rowwise", "rowwise_with_gw_hp"  # torchao's float8 recipes


def train_flops(cfg: BertConfig, lengths: np.ndarray, predictions: int) -> float:
    """Forward + backward FLOPs of the useful work: encoder on real tokens (attention within each
    sequence), MLM head at the masked positions, NSP head. 3x the forward's multiply-adds x 2."""
    h, i, layers, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    tokens = float(lengths.sum())
    dense = 2 * tokens * layers * (4 * h * h + 2 * h * i)
    attention = 2 * layers * 2 * h * float((lengths.astype(np.float64) ** 2).sum())
    head = 2 * predictions * (h * h + h * v)
    return 3 * (dense + attention + head)


def load_prepared(folder: Path, layout: str) -> dict[str, np.ndarray]:
    import h5py

    sub = "train" if layout == "fixed" else "train_packed"
    arrays: dict[str, list] = {}
    for path in sorted((folder / sub).glob("*.hdf5")):
        with h5py.File(path) as f:
            for k in f:
                arrays.setdefault(k, []).append(f[k][()])
    return {k: np.concatenate(v) for k, v in arrays.items()}


def synthetic_fixed(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    full = rng.random(n) < 0.25
    lengths = np.where(full, rng.integers(470, 513, n), rng.integers(16, 371, n))
    ids = rng.integers(1000, 30000, (n, SEQ))
    cols = np.arange(SEQ)
    mask = (cols < lengths[:, None]).astype(np.int64)
    len_a = np.maximum(1, lengths // 2 - 1)
    segment = ((cols >= len_a[:, None] + 2) & (cols < lengths[:, None])).astype(np.int64)
    k = np.minimum(PRED, np.maximum(1, np.round(lengths * 0.15).astype(int)))
    positions = np.zeros((n, PRED), np.int64)
    for r in range(n):
        positions[r, : k[r]] = np.sort(rng.choice(np.arange(1, lengths[r] - 1), k[r], replace=False))
    return {
        "input_ids": ids * mask,
        "input_mask": mask,
        "segment_ids": segment,
        "masked_lm_positions": positions,
        "masked_lm_ids": rng.integers(1000, 30000, (n, PRED)) * (positions > 0),
        "next_sentence_labels": rng.integers(0, 2, n),
    }


def pack_fixed(batch: dict[str, np.ndarray], per_pack: int = 3) -> dict[str, np.ndarray]:
    """Packed rows from fixed rows with the project's packer (LPFHP, at most ``per_pack`` per row)."""
    from trainbench.data.packing import instances_from_fixed, pack, packed_predictions

    columns = packed_predictions(SEQ, PRED, 0.15, per_pack)
    return pack(instances_from_fixed(batch), SEQ, per_pack, columns, np.random.default_rng(0))


def convert_linears_to_fp8(model: torch.nn.Module, recipe: str) -> int:
    """Swap the encoder's linear layers (QKV, attention output, both feed-forward layers) for torchao's FP8
    ones with ``recipe``; returns how many. The weights, their gradients and LAMB stay fp32."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = ("qkv", "attn_out", "ffn_in", "ffn_out")
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn.rsplit(".", 1)[-1] in names, config=config)
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def batches(arrays: dict[str, np.ndarray], steps: int, micro: int) -> list[dict[str, torch.Tensor]]:
    n = len(arrays["input_ids"])
    out = []
    for s in range(steps):
        rows = np.arange(s * micro, (s + 1) * micro) % n
        out.append({k: torch.from_numpy(v[rows]).long().cuda(non_blocking=True) for k, v in arrays.items()})
    return out


def binned_batches(shard_dir: Path, global_batches: int) -> list[dict[str, torch.Tensor]]:
    """Micro-batches as the trainer makes them with data.length_bins=4 (one rank, GBS 768 = 16 x 48):
    each global batch sorted by length and cut into 16 micro-batches, each trimmed to its bin's edge."""
    from trainbench.data.bert_hdf5 import TrainBatches, find_shards

    shards = find_shards(shard_dir, "training data", SEQ, PRED)
    it = iter(TrainBatches(shards, 0, 16 * MICRO, MICRO, 0, 1, 0, "fixed", 4))
    return [{k: torch.from_numpy(v).cuda() for k, v in mb.items()} for _ in range(global_batches) for mb in next(it)]


def time_model(name: str, step_fn, model, data: list, warmup: int, cfg: BertConfig, peak: float,
               fused_lamb: bool = False, profile_to: Path | None = None) -> dict:  # fmt: skip
    optimizer = Lamb(param_groups(model, 0.01), lr=1e-4, weight_decay=0.01, fused=fused_lamb)
    torch.cuda.reset_peak_memory_stats()
    for b in data[:warmup]:
        step_fn(model, b)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for b in data[warmup:]:
        step_fn(model, b)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    timed = data[warmup:]
    steps = len(timed)
    if "sequence_ids" in timed[0]:
        seq_ids = np.concatenate([b["sequence_ids"].cpu().numpy() for b in timed])
        lengths = np.concatenate([np.bincount(r[r > 0])[1:] for r in seq_ids])
        samples = int(sum((b["next_sentence_labels"] >= 0).sum().item() for b in timed))
    else:
        lengths = torch.cat([b["input_mask"].sum(1) for b in timed]).cpu().numpy()
        samples = len(lengths)
    predictions = int(sum((b["masked_lm_positions"] > 0).sum().item() for b in timed))
    # The optimizer step alone (gradients of the last step kept), to see its share of a step.
    step_fn(model, timed[-1])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        optimizer.step()
    torch.cuda.synchronize()
    lamb_ms = (time.perf_counter() - t) / 10 * 1000
    optimizer.zero_grad(set_to_none=True)
    flops = train_flops(cfg, lengths, predictions)
    out = {
        "config": name,
        "samples_per_s": samples / seconds,
        "real_tokens_per_s": float(lengths.sum()) / seconds,
        "model_tflops": flops / seconds / 1e12,
        "mfu_vs_measured_peak": flops / seconds / 1e12 / peak,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "rows_per_step": int(timed[0]["input_ids"].shape[0]),
        "row_width_mean": float(np.mean([b["input_ids"].shape[1] for b in timed])),
        "row_fill": float(lengths.sum()) / sum(b["input_ids"].numel() for b in timed),
        "step_ms": seconds / steps * 1000,
        "lamb_step_ms": lamb_ms,
        "mean_length": float(lengths.mean()),
    }
    if profile_to is not None:
        out["top_kernels"] = profile_steps(step_fn, model, optimizer, timed[:5], profile_to)
    print(json.dumps(out), flush=True)
    return out


def profile_steps(step_fn, model, optimizer, data, path: Path, top: int = 25) -> list[dict]:
    """GPU kernels of a few steps by total time, with their share of all kernel time (CSV at ``path``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in data:
            step_fn(model, b)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += e.device_time  # us
            k[1] += 1
    total = sum(v[0] for v in kernels.values())
    rows = [{"kernel": n, "calls": c, "ms_per_step": t / 1000 / len(data), "share": t / total}
            for n, (t, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])]  # fmt: skip
    with open(path, "w") as f:
        f.write("kernel,calls,ms_per_step,share\n")
        for r in rows:
            f.write(f'"{r["kernel"][:200]}",{r["calls"]},{r["ms_per_step"]:.4f},{r["share"]:.4f}\n')
    summary = {"total_kernel_ms_per_step": total / 1000 / len(data)}
    return [dict(r, kernel=r["kernel"][:120]) for r in rows[:top]] + [summary]


def hf_step(model, b):
    labels = torch.full_like(b["input_ids"], -100)
    labels.scatter_(1, b["masked_lm_positions"], b["masked_lm_ids"])
    labels[:, 0] = -100  # position 0 ([CLS]) stands for padding of masked_lm_positions
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(input_ids=b["input_ids"], token_type_ids=b["segment_ids"], attention_mask=b["input_mask"],
                    labels=labels, next_sentence_label=b["next_sentence_labels"])  # fmt: skip
    out.loss.backward()


def our_step(bench, index_loss: bool = False):
    def step(model, b):
        weights = bench.loss_weights(b)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (indexed_loss if index_loss else bench.loss)(model, b, weights)
        loss.backward()

    def indexed_loss(model, b, weights):
        """The loss as it was before: padding predictions and empty slots cut out by a boolean index, whose
        output size the host must read (a sync in forward and another in backward)."""
        mlm_logits, nsp_logits = bench._logits(model, b)
        valid = bench._valid(b)
        mlm = F.cross_entropy(mlm_logits[valid].float(), b["masked_lm_ids"][valid].long(), reduction="sum")
        labels = b["next_sentence_labels"].long()
        nsp = F.cross_entropy(nsp_logits[labels >= 0].float(), labels[labels >= 0], reduction="sum")
        return mlm / weights[0] + nsp / weights[1]

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--work", type=Path, default=Path("/tmp/tb-throughput"))
    p.add_argument("--only", nargs="*", help="run only these configurations")
    p.add_argument("--profile", nargs="*", help="configurations to profile (default: ours_packed_varlen)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    from trainbench.benchmarks.bert import BertBenchmark

    bench = BertBenchmark()
    peak = bf16_matmul_peak_tflops()
    print(json.dumps({"bf16_matmul_peak_tflops": peak, "gpu": torch.cuda.get_device_name()}), flush=True)
    prepared = args.work / "wikitext"
    if not (prepared / "manifest.json").exists():
        corpus = args.work / "corpus"
        corpus.mkdir(parents=True, exist_ok=True)
        text = "".join((args.data / "text" / "wikitext-2" / n).read_text() for n in ("valid.txt", "test.txt"))
        for c in range(4):
            (corpus / f"wiki.{c}.txt").write_text(text)
        env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run([sys.executable, "-m", "trainbench", "prepare", "bert", "--input", str(corpus), "--vocab",
                        str(args.data / "bert" / "vocab.txt"), "--out", str(prepared), "--num-shards", "4",
                        "--eval-samples", "100", "--eval-fraction", "0.05", "--formats", "fixed,packed",
                        "--no-progress"], env=env, check=True)  # fmt: skip
    from trainbench.data.bert_hdf5 import write_shard

    n_fixed = max(MICRO * (args.steps + args.warmup), 3 * 16 * MICRO)
    sets = {"wikitext": load_prepared(prepared, "fixed"), "synthetic": synthetic_fixed(n_fixed)}
    packed_sets = {"wikitext": load_prepared(prepared, "packed"), "synthetic": pack_fixed(sets["synthetic"])}
    packed6_sets: dict[str, dict[str, np.ndarray]] = {}  # packed on first use, only when a packed6 run is wanted
    synthetic_dir = args.work / "synthetic"
    synthetic_dir.mkdir(parents=True, exist_ok=True)
    write_shard(synthetic_dir / "part_0.hdf5", sets["synthetic"])
    shard_dirs = {"wikitext": prepared / "train", "synthetic": synthetic_dir}
    cfg = BertConfig(hidden_dropout=0.0, attention_dropout=0.0)
    results = {"bf16_matmul_peak_tflops": peak, "gpu": torch.cuda.get_device_name(), "runs": []}

    def want(name):
        return not args.only or name in args.only

    # name: (model, data, micro-batch rows, fused LAMB, compile mode, packed attention kernel, dropout[, FP8
    # recipe]). Models outer, data sets inner: each model is compiled once (both sets have the same shapes). Dropout
    # is 0 except in the `dropout` configurations, which train as the large preset does (0.1 on hidden states and
    # attention).
    configs = {
        "hf_compiled": ("hf", "fixed", MICRO, False, "default", None, 0.0),
        "ours_eager": ("ours", "fixed", MICRO, False, None, None, 0.0),
        "ours_compiled": ("ours", "fixed", MICRO, False, "default", None, 0.0),
        "ours_bins_compiled": ("ours", "bins", MICRO, True, "default", None, 0.0),
        "ours_packed_compiled": ("ours", "packed", MICRO, False, "default", "flex", 0.0),
        "ours_packed_fused_lamb": ("ours", "packed", MICRO, True, "default", "flex", 0.0),
        "ours_packed_fused_lamb_cudagraphs": ("ours", "packed", MICRO, True, "reduce-overhead", "flex", 0.0),
        "ours_packed_fused_lamb_b96": ("ours", "packed", 2 * MICRO, True, "default", "flex", 0.0),
        "ours_packed_varlen": ("ours", "packed", MICRO, True, "default", "varlen", 0.0),
        "ours_packed_varlen_b96": ("ours", "packed", 2 * MICRO, True, "default", "varlen", 0.0),
        # at most 6 sequences per packed row instead of 3: fuller rows
        "ours_packed6_varlen": ("ours", "packed6", MICRO, True, "default", "varlen", 0.0),
        "ours_packed6_varlen_b96": ("ours", "packed6", 2 * MICRO, True, "default", "varlen", 0.0),
        "ours_packed6_varlen_b144": ("ours", "packed6", 3 * MICRO, True, "default", "varlen", 0.0),
        # and the residual stream in bf16 (model.low_precision_residual=true)
        "ours_packed6_varlen_bf16res": ("ours", "packed6", MICRO, True, "default", "varlen", 0.0),
        "ours_packed6_varlen_bf16res_b96": ("ours", "packed6", 2 * MICRO, True, "default", "varlen", 0.0),
        "ours_packed6_varlen_bf16res_b144": ("ours", "packed6", 3 * MICRO, True, "default", "varlen", 0.0),
        # the trainer's default (3 sequences per row, bf16 residual) with each packed-row kernel: varlen flash
        # attention, and cuDNN's attention read in place from the QKV projection (model.packed_attention=cudnn)
        "ours_packed_varlen_bf16res": ("ours", "packed", MICRO, True, "default", "varlen", 0.0),
        "ours_packed_cudnn_bf16res": ("ours", "packed", MICRO, True, "default", "cudnn", 0.0),
        "ours_packed6_cudnn_bf16res_b144": ("ours", "packed6", 3 * MICRO, True, "default", "cudnn", 0.0),
        "ours_packed_dropout_varlen_bf16res": ("ours", "packed", MICRO, True, "default", "varlen", 0.1),
        "ours_packed_dropout_cudnn_bf16res": ("ours", "packed", MICRO, True, "default", "cudnn", 0.1),
        # the same, compiled with max-autotune: Triton GEMM templates against cuBLAS, with the elementwise ops
        # around a GEMM (bias, GELU, their backward) fused into its epilogue where that is faster
        "ours_packed_cudnn_bf16res_autotune": ("ours", "packed", MICRO, True, AUTOTUNE, "cudnn", 0.0),
        # the same, every kernel Inductor generates tuned by coordinate descent over its block sizes
        "ours_packed_cudnn_bf16res_tuned": ("ours", "packed", MICRO, True, TUNED, "cudnn", 0.0),
        "ours_packed6_cudnn_bf16res_b144_tuned": ("ours", "packed6", 3 * MICRO, True, TUNED, "cudnn", 0.0),
        # the same with the encoder's linear layers in FP8 (torchao's float8 training recipes)
        "ours_packed_cudnn_bf16res_fp8": ("ours", "packed", MICRO, True, "default", "cudnn", 0.0, FP8_TW),
        "ours_packed_cudnn_bf16res_fp8_rowwise": ("ours", "packed", MICRO, True, "default", "cudnn", 0.0, FP8_ROW),
        "ours_packed_cudnn_bf16res_fp8_gw_hp": ("ours", "packed", MICRO, True, "default", "cudnn", 0.0, FP8_GW_HP),
        "ours_packed6_cudnn_bf16res_b144_fp8": ("ours", "packed6", 3 * MICRO, True, "default", "cudnn", 0.0, FP8_TW),
        # the loss before it stopped syncing the host (boolean index of the valid predictions)
        "ours_packed_varlen_index_loss": ("ours", "packed", MICRO, True, "default", "varlen", 0.0),
        "ours_packed_dropout_sdpa": ("ours", "packed", MICRO, True, "default", "sdpa", 0.1),
        "ours_packed_dropout_varlen": ("ours", "packed", MICRO, True, "default", "varlen", 0.1),
    }
    profiled = args.profile or ["ours_packed_varlen"]
    for config, spec in configs.items():
        if not want(config):
            continue
        impl, layout, micro, fused, mode, attention, dropout, fp8 = (*spec, None)[:8]
        if impl == "hf":
            import transformers

            # BERT-large: transformers' BertConfig defaults to the base shape.
            hf_cfg = transformers.BertConfig(
                hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                intermediate_size=cfg.intermediate_size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                attn_implementation="sdpa",
            )  # fmt: skip
            model = transformers.BertForPreTraining(hf_cfg).cuda().train()
            assert model.num_parameters() > 300e6, "not the large shape"
            step = hf_step
        else:
            model_cfg = dataclasses.replace(cfg, hidden_dropout=dropout, attention_dropout=dropout,
                                            packed_attention=attention or "auto",
                                            low_precision_residual="_bf16res" in config)  # fmt: skip
            model = BertForPreTraining(model_cfg).cuda().train()
            if fp8 is not None:
                print(json.dumps({"config": config, "fp8_linears": convert_linears_to_fp8(model, fp8)}))
            step = our_step(bench, index_loss=config.endswith("_index_loss"))
        if mode == TUNED:
            model = torch.compile(model, dynamic=False, options={"coordinate_descent_tuning": True})
        elif mode is not None:
            model = torch.compile(model, mode=mode, dynamic=False)
        for data_name in sets:
            if layout == "bins":
                data, warmup = binned_batches(shard_dirs[data_name], 3), 16  # one global batch of warm-up
            else:
                if layout == "packed6" and not packed6_sets:
                    packed6_sets.update({name: pack_fixed(arrays, per_pack=6) for name, arrays in sets.items()})
                arrays = {"packed": packed_sets, "packed6": packed6_sets}.get(layout, sets)[data_name]
                data, warmup = batches(arrays, args.warmup + args.steps, micro), args.warmup
            profile = args.out / f"kernels_{data_name}_{config}.csv" if config in profiled else None
            run = time_model(f"{data_name}/{config}", step, model, data, warmup, cfg, peak, fused, profile)
            results["runs"].append(run)
            (args.out / "bert_throughput.json").write_text(json.dumps(results, indent=1))  # kept if cut short
            del data
        del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    for data_name in sets:
        runs = [r for r in results["runs"] if r["config"].startswith(data_name + "/")]
        base = next((r for r in runs if r["config"].endswith("hf_compiled")), None)
        for r in runs:
            r["ratio_to_hf"] = r["samples_per_s"] / base["samples_per_s"] if base else None
    (args.out / "bert_throughput.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
