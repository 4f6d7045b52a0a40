"""dlrmv4 on one GPU: the jagged HSTU attention's Triton kernels (families/hstu/attention_kernel.py) against the dense
form in float64, forward and gradients, eager and compiled; the tiny preset with its tables sharded
(``perf.sharded_tables``, world 1) in bf16 autocast against every table held whole and against the dense attention;
and `trainbench bench` at the reference's layer shape with its tables truncated to fit.

Part of the single-GPU tier (``make test-gpu``, every tests/test_gpu_*.py but test_gpu_multi.py), skipped where no
CUDA device is visible."""

import json
import math

import pytest
import torch
from conftest import only_run_dir, read_metrics, run_cli, single_gpu_tier

pytestmark = single_gpu_tier()


def _losses(results) -> list[float]:
    return [r["loss"] for r in read_metrics(only_run_dir(results)) if "loss" in r]


def _attention_inputs(b, t, h, a, d, start, stops, dtype, seed=0):
    """q, k, v as the layer makes them (views of one projection [b, t, h (2a + d)]) and the keys' padding."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    proj = torch.randn(b, t, h * (2 * a + d), device="cuda", generator=gen).to(dtype).requires_grad_()
    q, k, v = (z.view(b, t, h, -1).transpose(1, 2) for z in proj.split([h * a, h * a, h * d], dim=-1))
    return proj, (q, k, v), torch.tensor(stops, device="cuda")


@pytest.mark.parametrize(
    "shape",
    [(3, 137, 2, 32, 32, 8, [8, 70, 137]), (2, 70, 3, 3, 5, 2, [40, 2]), (2, 300, 4, 128, 128, 8, [8, 250])],
    ids=["ragged-T", "narrow-heads", "reference-heads"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_jagged_attention_kernel_is_the_dense_form_forward_and_backward(shape, dtype):
    """The kernel (forward, the keys' and values' gradient, the queries' gradient) against model.py's dense form in
    float64 on the same inputs: padding of no key, of every history key, of some; a sequence not a multiple of the
    64-row tiles; heads narrower than 16 (padded in the tile). fp32 within 1e-5 of the largest value; bf16 no further
    from float64 than torch's dense form in bf16, plus 1e-2 of the largest value. Compiled (the op inside a
    torch.compile graph): the eager kernel's values."""
    from trainbench.families.hstu.attention_kernel import hstu_attention
    from trainbench.families.hstu.model import KeyPadding, dense_attention

    b, t, h, a, d, start, stops = shape
    alpha = a**-0.5
    proj, (q, k, v), stop = _attention_inputs(b, t, h, a, d, start, stops, dtype)
    weights = torch.randn(b, h, t, d, device="cuda", dtype=torch.float64)

    def run(fn, proj):
        q, k, v = (z.view(b, t, h, -1).transpose(1, 2) for z in proj.split([h * a, h * a, h * d], dim=-1))
        out = fn(q, k, v)
        (grad,) = torch.autograd.grad((out.double() * weights).sum(), proj)
        return out.double(), grad.double()

    def dense(q, k, v):
        return dense_attention(q, k, v, KeyPadding(start, stop), alpha)

    def kernel(q, k, v):
        return hstu_attention(q, k, v, stop, start, alpha)

    exact = run(dense, proj.detach().double().requires_grad_())
    got = run(kernel, proj)
    compiled = run(torch.compile(kernel, fullgraph=True), proj)
    baseline = run(dense, proj)  # torch's dense form in the same dtype
    for name, want, mine, theirs, again in zip(("out", "grad"), exact, got, baseline, compiled, strict=True):
        scale = want.abs().max().item()
        err, theirs_err = (mine - want).abs().max().item(), (theirs - want).abs().max().item()
        bound = 1e-5 * scale if dtype == torch.float32 else theirs_err + 1e-2 * scale
        assert err <= bound, (name, err, theirs_err, scale)
        assert torch.allclose(again, mine, rtol=0, atol=1e-6 * scale if dtype == torch.float32 else 1e-2 * scale)
    # Padding keys get no gradient (their k and v), padding queries (attending the contextual keys) do.
    grad, i = got[1], stops.index(max(stops))
    assert stops[i] > start
    assert grad[i, start : stops[i], h * a :].abs().max() == 0 and grad[i, start : stops[i], : h * a].abs().max() > 0


def test_a_sharded_tables_backward_on_the_gpu_gives_the_tables_no_gradient():
    """The lookups' gradients reach the tables' ROW_GRADS lists alone: no table's parameter gets a gradient (a
    [rows, D] one would cost a fill and an add of the whole table a micro-batch, and a dense update of every row)."""
    import torch.distributed as dist

    from trainbench.benchmarks.dlrmv4 import Dlrmv4Benchmark
    from trainbench.distributed import DistInfo
    from trainbench.optim.rowwise_adagrad import ROW_GRADS

    bench = Dlrmv4Benchmark()
    cfg = bench.config("tiny")
    cfg.perf.sharded_tables = True
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cuda", torch.cuda.current_device()))
    try:
        placed = bench.family.place(bench.family.build_model(cfg), cfg, info, True)
        batch = {k: torch.as_tensor(v[:8]).cuda() for k, v in bench.bench_data(cfg, 0, 1).eval[0].items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = bench.loss(placed.model, batch, bench.loss_weights(batch))
        loss.backward()
        tables = placed.module.tables.values()
        assert all(t.weight.grad is None for t in tables)
        assert all(len(getattr(t.weight, ROW_GRADS)) == 1 for t in tables)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_sharded_tables_train_the_tiny_presets_losses_of_whole_tables_on_one_gpu_in_bf16(tmp_path):
    """10 steps of the tiny preset on CUDA in bf16 autocast (precision=auto), the tables sharded over the one rank
    (the exchange without peers, RowWiseAdagrad on the touched rows) against every table held whole (dense gradients),
    and the jagged attention (auto on CUDA) against the dense one, and the sharded tables looked up once a step over 4
    micro-batches (perf.lookup_once_a_step) against them whole: every loss finite, falling, and within 2e-2 of the
    other's (bf16: the sums' order differs)."""
    data = tmp_path / "data"
    assert run_cli("prepare", "dlrmv4", "--synthetic", "--preset", "tiny", "--out", data, "--no-progress") == 0
    common = ["run", "dlrmv4", "--preset", "tiny", f"data.dir={data}", "device=cuda", "progress=false",
              "log_every_steps=1", "telemetry_hz=0", "schedule.max_samples=1280", "eval.every_samples=640",
              "eval_samples=512"]  # fmt: skip
    run_cli(*common, f"output.results_dir={tmp_path / 'whole'}")
    run_cli(*common, "perf.sharded_tables=true", f"output.results_dir={tmp_path / 'sharded'}")
    run_cli(*common, "perf.hstu_attention=dense", f"output.results_dir={tmp_path / 'dense'}")
    run_cli(*common, "perf.sharded_tables=true", "perf.lookup_once_a_step=true", "data.micro_batch_size=32",
            f"output.results_dir={tmp_path / 'once'}")  # fmt: skip
    whole, sharded, dense, once = (_losses(tmp_path / n) for n in ("whole", "sharded", "dense", "once"))
    assert len(once) == 10 and max(abs(a - b) / abs(b) for a, b in zip(once, whole, strict=True)) <= 2e-2, once
    assert "looked up in one exchange" in (only_run_dir(tmp_path / "once") / "console.log").read_text()
    assert len(whole) == len(sharded) == len(dense) == 10 and all(math.isfinite(x) for x in sharded), (whole, sharded)
    assert sharded[-1] < sharded[0], sharded
    assert max(abs(a - b) / abs(b) for a, b in zip(sharded, whole, strict=True)) <= 2e-2, (whole, sharded)
    assert max(abs(a - b) / abs(b) for a, b in zip(whole, dense, strict=True)) <= 2e-2, (whole, dense)
    console = (only_run_dir(tmp_path / "sharded") / "console.log").read_text()
    assert "embedding tables sharded row-wise over 1 rank(s)" in console and "HSTU attention jagged" in console
    assert "HSTU attention dense" in (only_run_dir(tmp_path / "dense") / "console.log").read_text()


def test_bench_at_the_reference_layer_shape_runs_on_one_gpu_with_its_tables_truncated(tmp_path):
    """`trainbench bench dlrmv4` at the reference's layers (dim 512, 5 HSTU layers of 4 heads, a history of 2,048
    events) with every table cut to 1 M rows (the reference's 559 GiB of tables do not fit one GPU), sharded: it
    measures, and bench.json and the summary say the tables were truncated; its profiled step's GPU time is split by
    part (the lookup, the tables' and the dense optimizer, the model). A smaller batch than the reference's
    (the attention's [batch, heads, T, T] scores at T = 2,055 take 34 MB a sample in bf16)."""
    code = run_cli("bench", "dlrmv4", "--steps", "2", "--warmup", "1", "--profile-steps", "1", "--table-rows",
                   "1000000", "perf.sharded_tables=true", "device=cuda", "data.global_batch_size=64",
                   "data.micro_batch_size=32", "optimizer.lr=7.8125e-9", f"output.results_dir={tmp_path}")  # fmt: skip
    assert code == 0
    run_dir = only_run_dir(tmp_path)
    result = json.loads((run_dir / "bench.json").read_text())
    assert result["tables_truncated_to_rows"] == 1_000_000 and result["step_seconds"] > 0
    parts = result["profile"]["by_part_ms"]  # the profiled step's GPU time by part, each of them found
    assert all(parts.get(p, 0) > 0 for p in ("embedding lookup", "tables' optimizer", "optimizer", "model")), parts
    assert "truncated to at most 1,000,000 rows" in (run_dir / "console.log").read_text()


def test_the_reference_tables_on_one_gpu_are_refused_against_that_gpus_own_memory(tmp_path, capsys):
    """`trainbench run dlrmv4 --preset dlrmv4 device=cuda` with no perf.gpu_memory_gib: the tables (560 GiB sharded
    over the one rank, the preset's layout) are compared with this GPU's own memory, read from the device, and
    refused in one sentence that names its size and the GPUs of that size they would need, before any table is
    allocated on it."""
    data = tmp_path / "data"
    assert run_cli("prepare", "dlrmv4", "--synthetic", "--preset", "tiny", "--out", data, "--no-progress") == 0
    code = run_cli("run", "dlrmv4", "--preset", "dlrmv4", f"data.dir={data}", f"output.results_dir={tmp_path / 'r'}",
                   "device=cuda", "progress=false", "telemetry_hz=0")  # fmt: skip
    out = capsys.readouterr()
    assert code == 2, out
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    gpus = math.ceil(293_050_000 * 513 * 4 / total)
    errors = [ln for ln in (out.out + out.err).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, out
    assert f"against the {total / 2**30:,.1f} GiB of this GPU's memory" in errors[0], errors[0]
    assert f"shard them over at least {gpus} GPUs of this size" in errors[0], errors[0]
    assert "Traceback" not in out.out + out.err
    assert torch.cuda.memory_allocated() < 2**30  # no table was allocated
