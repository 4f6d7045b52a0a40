"""dlrmv4: the HSTU layer against its equations written out here, RowWiseAdagrad against an update written here from
its documented equations (TorchRec's CPU wheel, fbgemm-gpu-cpu 1.9.0, does not load with this torch: an undefined
torch::autograd symbol), the exact AUC against counting pairs, the rules' arithmetic and a full-shape log through
mlperf-logging's 6.1.0 checker, and each bad input refused in one sentence."""

from __future__ import annotations

import dataclasses
import math
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from trainbench.benchmarks import BENCHMARKS
from trainbench.benchmarks.dlrmv4 import Dlrmv4Benchmark, eval_interval, exact_auc, first_eval, lr_band
from trainbench.data import yambda
from trainbench.errors import ConfigError, DataError
from trainbench.families.hstu.model import HstuLayer, KeyPadding
from trainbench.optim.rowwise_adagrad import AdamRowWiseAdagrad

BENCH = Dlrmv4Benchmark()


def test_the_hstu_layer_is_its_equations():
    torch.manual_seed(0)
    b, t, dim, heads, a, d = 2, 5, 12, 2, 3, 4
    layer = HstuLayer(dim, heads, a, d).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.3)
    x = torch.randn(b, t, dim, dtype=torch.float64)
    lengths = [5, 3]  # the second sample's first two positions are padding
    mask = torch.zeros(b, t, t, dtype=torch.bool)
    for s, n in enumerate(lengths):
        for i in range(t):
            for j in range(t):
                mask[s, i, j] = j <= i and j >= t - n
    padding = KeyPadding(0, torch.tensor([t - n for n in lengths]))
    assert torch.equal(padding.mask(t), mask)
    got = layer(x, padding)

    def norm(z, w, bias):
        mean = z.mean(-1, keepdim=True)
        var = ((z - mean) ** 2).mean(-1, keepdim=True)
        return (z - mean) / torch.sqrt(var + 1e-6) * w + bias

    expected = torch.empty_like(x)
    for s in range(b):
        n = norm(x[s], layer.input_norm.weight, layer.input_norm.bias)
        proj = n @ layer.uvqk.weight.T + layer.uvqk.bias
        u, v = proj[:, : heads * d], proj[:, heads * d : 2 * heads * d]
        q, k = proj[:, 2 * heads * d : 2 * heads * d + heads * a], proj[:, -heads * a :]
        u = u * torch.sigmoid(u)
        out = torch.zeros(t, heads * d, dtype=torch.float64)
        for h in range(heads):
            for i in range(t):
                for j in range(t):
                    if mask[s, i, j]:
                        score = (q[i, h * a : (h + 1) * a] @ k[j, h * a : (h + 1) * a]) / math.sqrt(a)
                        out[i, h * d : (h + 1) * d] += score * torch.sigmoid(score) / t * v[j, h * d : (h + 1) * d]
        y = u * norm(out, layer.output_norm.weight, layer.output_norm.bias)
        expected[s] = x[s] + y @ layer.output.weight.T
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12)


def reference_rowwise_adagrad(weight, accumulator, lookups, row_grads, lr, eps):
    """The documented update, row by row over the rows a step looked up: each row's gradients summed over its
    lookups; its accumulator grows by their mean square; the row moves by lr x gradient / (sqrt(accumulator) + eps)."""
    weight, accumulator = weight.clone(), accumulator.clone()
    summed = {}
    for row, g in zip(lookups.tolist(), row_grads, strict=True):
        summed[row] = summed.get(row, 0) + g
    for row, g in summed.items():
        accumulator[row] += float((g * g).mean())
        weight[row] -= lr * g / (math.sqrt(accumulator[row]) + eps)
    return weight, accumulator


def test_rowwise_adagrad_updates_the_looked_up_rows_as_documented_and_adam_the_rest_with_the_clip():
    torch.manual_seed(1)
    table = torch.nn.Embedding(10, 4)
    dense = torch.nn.Linear(4, 1)
    opt = AdamRowWiseAdagrad(dense.parameters(), [table.weight], max_grad_norm=0.01, lr=0.1, betas=(0.95, 0.999),
                             eps=1e-8, table_eps=1e-8)  # fmt: skip
    weight, accumulator = table.weight.detach().clone(), torch.zeros(10)
    plain = torch.nn.Linear(4, 1)
    plain.load_state_dict(dense.state_dict())
    adam = torch.optim.Adam(plain.parameters(), lr=0.1, betas=(0.95, 0.999), eps=1e-8)
    for step in range(3):
        lookups = torch.tensor([1, 3, 3, 7]) if step != 1 else torch.tensor([0, 3])
        rows = table(lookups)
        rows.retain_grad()
        (dense(rows).square().sum()).backward()
        weight, accumulator = reference_rowwise_adagrad(weight, accumulator, lookups, rows.grad.detach(), 0.1, 1e-8)
        # Adam on the same dense gradients, clipped to a norm of 0.01 (the tables' gradients are not clipped).
        for p, q in zip(plain.parameters(), dense.parameters(), strict=True):
            p.grad = q.grad.clone()
        norm = torch.sqrt(sum(p.grad.square().sum() for p in plain.parameters()))
        for p in plain.parameters():
            p.grad *= min(1.0, 0.01 / (float(norm) + 1e-6))
        opt.step()
        adam.step()
        opt.zero_grad()
        adam.zero_grad()
        assert torch.allclose(table.weight, weight, rtol=1e-6, atol=1e-7)
        assert torch.allclose(opt.state[table.weight]["accumulator"], accumulator, rtol=1e-6)
        for p, q in zip(plain.parameters(), dense.parameters(), strict=True):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
    assert torch.equal(table.weight[[2, 4, 5, 6, 8, 9]], weight[[2, 4, 5, 6, 8, 9]])  # never looked up: unchanged


def test_the_exact_auc_counts_every_pair_ties_half():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 20, 300).astype(np.float64)  # many ties
    labels = (rng.random(300) < 0.4).astype(np.float64)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert exact_auc(scores, labels) == pytest.approx(pairs / (len(pos) * len(neg)), abs=1e-12)


def test_the_rules_arithmetic_matches_the_checkers_grid():
    assert eval_interval(8192) == 280 * 8192 == 2_293_760
    assert first_eval(8192) == 25 * eval_interval(8192)  # block 25 at 8,192 (closed_dlrmv4.yaml)
    assert first_eval(16384) == 31 * eval_interval(16384) and first_eval(32768) == 41 * eval_interval(32768)
    assert lr_band(16384) == pytest.approx((1e-6, 3e-6))
    cfg = BENCH.config("dlrmv4")
    BENCH.validate(cfg)
    assert BENCH.waived_checks(cfg) == frozenset()
    assert cfg.model.sequence_length <= cfg.data.seq_length == 4096
    cfg.optimizer.lr = 2e-6  # outside the band at GBS 8,192
    with pytest.raises(ConfigError, match="closed rules allow"):
        BENCH.validate(cfg)


def test_a_full_shape_log_passes_mlperf_loggings_checker_with_every_rule(tmp_path):
    from trainbench.mlperf import DISCLOSURE_KEYS, check_compliance
    from trainbench.train.record import MLPerfRecord

    cfg = BENCH.config("dlrmv4")
    record = MLPerfRecord(tmp_path / "log.txt", fresh=True)
    record.header(BENCH.mlperf_name, cfg.output, "platform")
    disclosure = dict.fromkeys(DISCLOSURE_KEYS, 1) | {k: "fp32" for k in DISCLOSURE_KEYS if "precision" in k}
    disclosure["config_filename"] = "config.yaml"
    record.hyperparameters(cfg, 1, 2_290_835_423, cfg.data.eval_samples, BENCH.hyperparameters(cfg), disclosure)
    record.run_start()
    every = BENCH.eval_every_samples(cfg)
    first = BENCH.first_eval_samples(cfg, every)
    for samples, auc in ((first, 0.74), (first + every, 0.751)):
        record.block_start(samples - every, every)
        record.block_stop(samples - every)
        record.eval_start(BENCH.eval_metadata(samples))
        record.eval_result(auc, BENCH.eval_metadata(samples))
    record.finish("success", int(1e13), tmp_path / "result_0.txt")
    result = check_compliance(tmp_path / "result_0.txt", "6.1.0")
    assert result.passed, result.output[-3000:]
    # A tiny run's cadence and shape are the waived checks, and the target never is.
    assert BENCH.waived_checks(BENCH.config("tiny")) == {"train_samples", "eval_samples", "max_sequence_length",
                                                         "opt_learning_rate_warmup_steps", "opt_base_learning_rate",
                                                         "eval_every_data_pct", "eval_accuracy"}  # fmt: skip


# -- bad input ------------------------------------------------------------------------------------------------------
SYNTH = {"seed": 3, "users": 60, "items": 40, "artists": 8, "albums": 16, "favourites": 2, "loyalty": 0.6,
         "signal": 3.0, "user_bias": 0.5, "artist_quality": 2.0, "item_quality": 1.0,
         "min_events": 10, "max_events": 20, "session_events": 6}  # fmt: skip


@pytest.fixture
def source(tmp_path):
    yambda.write_synthetic(tmp_path / "src", SYNTH)
    return tmp_path / "src"


def store(source, out):
    return yambda.build_store(source, out, 1, 0.2, 0, lambda *a: None)


def test_a_store_is_built_from_the_reference_layout_and_its_samples_are_in_range(source, tmp_path):
    counts = store(source, tmp_path / "out")
    arrays = yambda.open_store(tmp_path / "out", counts)
    assert counts["train"] + counts["eval"] > 0 and len(arrays["item"]) == counts["events"]
    model = dataclasses.replace(BENCH.config("tiny").model, uid_rows=60, item_rows=40, artist_rows=8, album_rows=16)
    batch = yambda.SampleBuilder(arrays, model, tmp_path).build(np.asarray(arrays["train_anchors"][:16]))
    assert batch["hist_item"].shape == (16, model.history) and set(np.unique(batch["label"])) <= {0.0, 1.0}
    assert (batch["hist_len"] <= model.history).all() and (batch["hist_len"] >= 1).all()  # min_history 1


def test_a_table_file_of_the_wrong_width_is_refused(source, tmp_path):
    table = pq.read_table(source / yambda.ARTISTS)
    pq.write_table(table.append_column("genre", pa.array(np.zeros(len(table), np.int64))), source / yambda.ARTISTS)
    with pytest.raises(DataError, match="has 3 columns .* the Yambda layout has 2"):
        store(source, tmp_path / "out")


def test_sessions_out_of_order_or_of_unequal_lists_are_refused(source, tmp_path):
    table = pq.read_table(source / yambda.SESSIONS)
    pq.write_table(table.take(list(range(len(table)))[::-1]), source / yambda.SESSIONS)
    with pytest.raises(DataError, match="not after the row before it"):
        store(source, tmp_path / "out")


def test_row_ids_past_a_tables_size_are_refused(source, tmp_path):
    counts = store(source, tmp_path / "out")
    arrays = yambda.open_store(tmp_path / "out", counts)
    model = dataclasses.replace(BENCH.config("tiny").model, uid_rows=60, item_rows=10, artist_rows=8, album_rows=16)
    with pytest.raises(DataError, match="past the item table's 10 rows"):
        yambda.SampleBuilder(arrays, model, tmp_path).build(np.asarray(arrays["train_anchors"][:64]))


def test_a_cross_feature_naming_a_missing_column_is_refused():
    cfg = BENCH.config("tiny")
    cfg.model.cross_features = "uid*genre:100"
    with pytest.raises(ConfigError, match="names genre, which the data has no column for"):
        BENCH.validate(cfg)


def test_a_sequence_longer_than_the_rules_allow_is_refused():
    cfg = BENCH.config("dlrmv4")
    cfg.data.seq_length = 8192
    with pytest.raises(ConfigError, match="at most 4,096 tokens"):
        BENCH.validate(cfg)
    cfg = BENCH.config("tiny")
    cfg.model.history_length = 300
    with pytest.raises(ConfigError, match="longer than data.seq_length"):
        BENCH.validate(cfg)


def test_tables_that_cannot_fit_are_refused_in_one_sentence_with_the_gpus_they_need():
    """The reference's 293 M rows of 512 (559 GiB of fp32): whole on one H200 they need their rows, gradient and
    accumulators (1,119 GiB), sharded over one rank 560 GiB, so at least 5 such GPUs; over 8 they fit (70 GiB a
    rank). Whole tables on each of a node's ranks are first drawn in host memory, which must hold them; on the CPU the
    node's ranks share the host's memory. A GPU of unknown size is not compared. The tiny preset fits anywhere."""
    from trainbench.families.hstu.family import check_tables_fit, tables_need

    h200, host = int(139.3 * 2**30), 2000 * 2**30
    cfg = BENCH.config("dlrmv4")
    cfg.device = "cuda"
    assert sum(cfg.model.table_rows().values()) == 293_050_000
    assert cfg.perf.sharded_tables  # the preset's layout: they fit no GPU whole
    cfg.perf.sharded_tables = False
    with pytest.raises(ConfigError, match=r"whole on every rank need at least 1,119.0 GiB .* against the 139.3 GiB of "
                       r"this GPU's memory: shard them over at least 5 GPUs of this size"):  # fmt: skip
        check_tables_fit(cfg, h200, host)
    cfg.perf.sharded_tables = True
    with pytest.raises(ConfigError, match=r"sharded over 1 rank\(s\) need at least 560.0 GiB .* at least 5 GPUs"):
        check_tables_fit(cfg, h200, host)
    check_tables_fit(cfg, None, host)  # a GPU of unknown size (no perf.gpu_memory_gib): not compared
    cfg.distributed.nproc = 8
    assert tables_need(cfg) == (math.ceil(293_050_000 / 8) * 513 * 4, 0)
    check_tables_fit(cfg, h200, host)  # 70.0 GiB a rank: fits
    cfg.perf.sharded_tables = False  # whole tables on 8 ranks of a 2,000 GiB host: 8 x 559 GiB drawn there first
    with pytest.raises(ConfigError, match=r"each of this node's 8 rank\(s\) are first drawn in host memory"):
        check_tables_fit(cfg, 2000 * 2**40, host)
    cfg.device = "cpu"
    with pytest.raises(ConfigError, match=r"host memory this node's 8 rank\(s\) share: run them sharded on "
                       r"GPUs \(device=cuda perf.sharded_tables=true\), or cut them"):  # fmt: skip
        check_tables_fit(cfg, None, host)
    check_tables_fit(BENCH.config("tiny"), None, 2**30)


def test_the_reference_tables_on_the_cpu_are_refused_before_they_are_allocated(tiny_data, tmp_path, capsys):
    """`trainbench run dlrmv4 --preset dlrmv4` on the CPU: one sentence and exit code 2 (it used to try to allocate
    the first table's 204,800,000,000 bytes and fail with the allocator's traceback)."""
    from tests.conftest import run_cli

    code = run_cli("run", "dlrmv4", "--preset", "dlrmv4", f"data.dir={tiny_data}", f"output.results_dir={tmp_path}",
                   "device=cpu", "progress=false", "telemetry_hz=0")  # fmt: skip
    out = capsys.readouterr()
    assert code == 2, out
    errors = [ln for ln in (out.out + out.err).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "293,050,000 rows of 512" in errors[0] and "--table-rows N" in errors[0], out
    assert "sharded over 1 rank(s)" in errors[0] and "run them sharded on GPUs (device=cuda)" in errors[0], errors[0]
    assert "Traceback" not in out.out + out.err


def test_the_hstu_ranker_gives_one_logit_a_sample_whatever_its_batch():
    from trainbench.families.hstu.model import HstuRanker

    torch.manual_seed(0)
    cfg = BENCH.config("tiny").model
    model = HstuRanker(cfg).eval()
    n, h = 6, cfg.history
    batch = {"uid": torch.randint(0, cfg.uid_rows, (n,)), "cross": torch.zeros(n, len(cfg.crosses), dtype=torch.long),
             "hist_item": torch.randint(0, cfg.item_rows, (n, h)), "hist_artist": torch.randint(0, 60, (n, h)),
             "hist_album": torch.randint(0, 240, (n, h)), "hist_action": torch.randint(0, 8, (n, h)),
             "hist_len": torch.tensor([0, 1, 5, h, 3, 2]), "cand_item": torch.randint(0, 600, (n,)),
             "cand_artist": torch.randint(0, 60, (n,)), "cand_album": torch.randint(0, 240, (n,))}  # fmt: skip
    whole = model(batch)
    halves = torch.cat([model({k: v[:3] for k, v in batch.items()}), model({k: v[3:] for k, v in batch.items()})])
    assert whole.shape == (n,) and torch.allclose(whole, halves, atol=1e-6)
    # Padding is never attended: changing a padded position's track leaves the logit as it was.
    changed = dict(batch, hist_item=batch["hist_item"].clone())
    changed["hist_item"][2, 0] = (changed["hist_item"][2, 0] + 1) % cfg.item_rows
    assert torch.allclose(model(changed)[2], whole[2], atol=1e-6)
    assert F.binary_cross_entropy_with_logits(whole, torch.ones(n)).isfinite()


def test_the_jagged_attention_op_is_registered_for_autograd_and_the_compiler_and_falls_back_to_dense():
    """``trainbench::hstu_attention`` (families/hstu/attention_kernel.py; its Triton kernels are checked against the
    dense form on the GPU in tests/test_gpu_dlrmv4.py): torch's own checks of a custom op (schema, fake tensors,
    autograd registration, the compiler's dispatch) pass, and off CUDA it computes model.py's dense attention, its
    gradients included, on views with the layer's strides."""
    from trainbench.families.hstu.attention_kernel import hstu_attention
    from trainbench.families.hstu.model import dense_attention

    torch.manual_seed(0)
    b, t, h, a, d = 3, 11, 2, 4, 5
    proj = torch.randn(b, t, h * (a + a + d), dtype=torch.float64, requires_grad=True)
    q, k, v = (z.view(b, t, h, -1).transpose(1, 2) for z in proj.split([h * a, h * a, h * d], dim=-1))
    stop = torch.tensor([2, 7, 11])  # keys [2, stop) padding: none, five, all but the contextual two
    torch.library.opcheck(hstu_attention, (q, k, v, stop, 2, 0.5))
    got = hstu_attention(q, k, v, stop, 2, 0.5)
    want = dense_attention(q, k, v, KeyPadding(2, stop), 0.5)
    assert got.shape == (b, h, t, d) and torch.equal(got, want)
    weights = torch.randn_like(want)
    (grad_got,) = torch.autograd.grad((got * weights).sum(), proj)
    (grad_want,) = torch.autograd.grad((want * weights).sum(), proj)
    assert torch.allclose(grad_got, grad_want, rtol=1e-12, atol=1e-12)
    assert grad_got[1, 2:7].abs().sum() > 0  # padding queries attend the contextual keys: their q has a gradient
    assert grad_got[1, 2:7, h * a : 2 * h * a].abs().sum() == 0  # ... and padding keys none


def test_the_hstu_attention_key_picks_the_kernel_on_cuda_alone():
    from trainbench.families.hstu.attention_kernel import jagged_attention
    from trainbench.families.hstu.family import HstuFamily
    from trainbench.families.hstu.model import HstuRanker, dense_attention

    cfg = BENCH.config("tiny")
    model = HstuRanker(cfg.model)
    cpu = types.SimpleNamespace(device=torch.device("cpu"))
    assert "dense" in HstuFamily.attention_note(model, cfg, cpu)
    assert all(layer.attend is dense_attention for layer in model.layers)
    cfg.perf.hstu_attention = "jagged"
    with pytest.raises(ConfigError, match="CUDA kernel"):
        HstuFamily.attention_note(model, cfg, cpu)
    with pytest.raises(ConfigError, match="CUDA kernel"):
        BENCH.validate(dataclasses.replace(cfg, device="cpu"))
    cuda = types.SimpleNamespace(device=torch.device("cuda"))  # the placement only sets the layers' function
    assert "jagged" in HstuFamily.attention_note(model, cfg, cuda)
    assert all(layer.attend is jagged_attention for layer in model.layers) and len(model.layers) > 0
    bert = BENCHMARKS["bert"].config("tiny")
    bert.perf.hstu_attention = "dense"
    with pytest.raises(ConfigError, match="perf.hstu_attention=dense has no effect on bert: .* no HSTU layers"):
        BENCHMARKS["bert"].validate(bert)


# -- whole runs -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from tests.conftest import run_cli

    out = tmp_path_factory.mktemp("dlrmv4") / "tiny"
    assert run_cli("prepare", "dlrmv4", "--synthetic", "--preset", "tiny", "--out", out, "--no-progress") == 0
    return out


@pytest.mark.full
def test_the_tiny_run_reaches_its_target_with_a_log_the_checker_passes(tiny_data, tmp_path):
    """``prepare --synthetic --preset tiny`` then ``run --preset tiny``: the target AUC inside a few hundred steps, and
    mlperf-logging's 6.1.0 checker failing only the full-size checks the scaled-down run waives."""
    from tests.conftest import only_run_dir, read_metrics, run_cli
    from trainbench.mlperf import check_compliance, read_log

    assert run_cli("run", "dlrmv4", "--preset", "tiny", f"data.dir={tiny_data}", f"output.results_dir={tmp_path}",
                   "progress=false", "telemetry_hz=0") == 0  # fmt: skip
    run_dir = only_run_dir(tmp_path)
    cfg = BENCH.config("tiny")
    evals = [(r["samples"], r["auc"]) for r in read_metrics(run_dir) if "auc" in r]
    assert evals[-1][1] >= cfg.eval.target and all(auc < cfg.eval.target for _, auc in evals[:-1])
    assert evals[-1][0] <= 200 * cfg.data.global_batch_size, evals
    waived = BENCH.waived_checks(cfg)
    result = check_compliance(run_dir / "result_0.txt", "6.1.0", waived=waived)
    assert result.ok and "except the full-size checks" in result.reason(), result.output[-3000:]
    keys = {e["key"]: e for e in read_log(run_dir / "result_0.txt")}
    assert keys["run_stop"]["metadata"]["status"] == "success"
    assert keys["submission_benchmark"]["value"] == "dlrmv4" and keys["opt_sparse_name"]["value"] == "RowWiseAdagrad"


@pytest.mark.full
def test_two_ranks_train_the_losses_and_evals_of_one(tiny_data, tmp_path):
    """Every rank holds every table: two gloo ranks of 64 samples each step reduce the gradients of one rank's 128
    (the sample's logit does not depend on its batch, the loss is a sum over the global batch), and the eval's
    scores are summed into their places, so the AUC is the whole set's."""
    from tests.conftest import losses_and_evals

    common = ["run", "dlrmv4", "--preset", "tiny", f"data.dir={tiny_data}", "progress=false", "log_every_steps=1",
              "telemetry_hz=0", "schedule.max_samples=1280", "eval.every_samples=640", "eval_samples=512"]  # fmt: skip
    runs = {"one": ["--nproc", "1"], "two": ["--nproc", "2", "micro_batch_size=64"]}
    losses, evals = losses_and_evals(common, runs, tmp_path, "auc")
    assert len(losses["one"]) == 10 and len(evals["one"]) == 2 and losses["one"][0] > losses["one"][-1]
    assert max(abs(a - b) for a, b in zip(losses["one"], losses["two"], strict=True)) <= 1e-5, losses
    assert max(abs(a - b) for a, b in zip(evals["one"], evals["two"], strict=True)) <= 1e-5, evals
