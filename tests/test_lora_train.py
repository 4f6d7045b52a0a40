"""llama2_70b_lora end to end on the CPU: its data in three source forms, packed rows, the tiny preset to its target
with a log mlperf-logging's 6.1.0 and 5.1.0 checkers pass, the MLPerf eval rules, 1 rank against 2, and resume after
kill -9."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import only_run_dir, read_metrics, run_cli
from test_resume import events, kill_after_checkpoint, losses

from trainbench.benchmarks import get_benchmark
from trainbench.data import sft
from trainbench.data.prepare_sft import PROMPT, TextTokenizer
from trainbench.mlperf import check_compliance

BENCH = get_benchmark("llama2_70b_lora")


@pytest.fixture(scope="module")
def lora_converged(lora_data, tmp_path_factory) -> Path:
    """The tiny preset to its target: one run serves every assertion on a finished run."""
    out = tmp_path_factory.mktemp("lora-run")
    assert run_cli("run", "llama2_70b_lora", f"data.dir={lora_data}", f"output.results_dir={out}",
                   "progress=false", "telemetry_hz=0") == 0  # fmt: skip
    return only_run_dir(out)


# -- the tiny preset, the log and the MLPerf rules -------------------------------------------------------------


def test_tiny_lora_reaches_the_mlperf_target_and_passes_the_checker(lora_converged):
    log = lora_converged / "result_0.txt"
    for ruleset in ("6.1.0", "5.1.0"):  # the run's, with every key it requires; and the older one
        result = check_compliance(log, ruleset)
        assert result.passed, result.output[-3000:]  # no waiver: the closed rules, eval loss <= 0.925 included
    found = {e["key"]: e for e in events(log)}
    cfg = BENCH.config("tiny")
    expected = {"global_batch_size": 8, "gradient_accumulation_steps": 1, "lora_rank": 16, "lora_alpha": 32.0,
                "opt_base_learning_rate": cfg.optimizer.lr, "opt_learning_rate_training_steps": 1024,
                "opt_gradient_clip_norm": 0.3, "opt_adamw_weight_decay": 1e-4, "eval_samples": 173,
                "submission_benchmark": "llama2_70b_lora"}  # fmt: skip
    assert {k: found[k]["value"] for k in expected} == expected
    evals = [e for e in events(log) if e["key"] == "eval_accuracy"]
    # Every 384 samples, the first FLOOR(0.125 x 8 + 2) = 3 skipped: the first eval at 1,536 samples.
    counts = [e["metadata"]["samples_count"] for e in evals]
    assert counts[0] == 1536 and all(b - a == 384 for a, b in zip(counts, counts[1:], strict=False)), counts
    assert evals[-1]["value"] <= 0.925 < evals[0]["value"] or len(evals) == 1
    assert found["run_stop"]["metadata"]["status"] == "success"
    rows = read_metrics(lora_converged)
    assert [r["eval_loss"] for r in rows if "eval_loss" in r] == [e["value"] for e in evals]


def test_eval_cadence_and_skips_follow_the_global_batch():
    def first_and_every(gbs: int) -> tuple[int, int]:
        cfg = BENCH.config("llama2-70b")
        cfg.data.global_batch_size = gbs
        every = BENCH.eval_every_samples(cfg)
        return BENCH.first_eval_samples(cfg, every), every

    assert first_and_every(8) == (1536, 384)
    assert first_and_every(16) == (5 * 384, 384)  # FLOOR(2 + 2) = 4 skipped
    assert first_and_every(100) == (15 * 400, 400)  # 384 rounded up to 400; FLOOR(12.5 + 2) = 14 skipped


@pytest.mark.parametrize(
    "key", ["optimizer.clip=bucket", "distributed.tp=2", "data.eval_samples=10", "model.init_std=1"]
)
def test_keys_that_do_not_apply_are_refused(lora_data, tmp_path, capsys, key):
    assert run_cli("run", "llama2_70b_lora", f"data.dir={lora_data}", f"output.results_dir={tmp_path}", key) == 2
    out = capsys.readouterr().out
    assert "has no effect on llama2_70b_lora" in out and key.split("=")[0] in out
    assert not any(tmp_path.iterdir())


# -- 1 rank against 2, and resume after kill -9 ----------------------------------------------------------------

SHORT = ["progress=false", "telemetry_hz=0", "log_every_steps=1", "eval.every_samples=32", "schedule.max_samples=128",
         "model.lora_alpha=16", "optimizer.lr=5e-3"]  # fmt: skip


@pytest.fixture(scope="module")
def short_one_rank(lora_data, tmp_path_factory) -> Path:
    """16 steps on one rank, the first eval (after 3 skipped) at 128 samples."""
    out = tmp_path_factory.mktemp("lora-one")
    assert run_cli("run", "llama2_70b_lora", f"data.dir={lora_data}", f"output.results_dir={out}", *SHORT) == 1
    return only_run_dir(out)


@pytest.fixture(scope="module")
def no_dropout_one_rank(lora_data, tmp_path_factory) -> Path:
    """SHORT without dropout on one rank. Dropout's masks are drawn per rank, so two ranks draw other masks than one
    (as in any data-parallel run); without it, the arithmetic of the split is what must agree."""
    out = tmp_path_factory.mktemp("lora-one-no-dropout")
    assert run_cli("run", "llama2_70b_lora", f"data.dir={lora_data}", f"output.results_dir={out}", *SHORT,
                   "model.lora_dropout=0") == 1  # fmt: skip
    return only_run_dir(out)


@pytest.mark.full
def test_two_fsdp_ranks_train_the_losses_of_one_and_log_the_config(lora_data, no_dropout_one_rank, tmp_path):
    assert run_cli("run", "llama2_70b_lora", "--nproc", "2", f"data.dir={lora_data}", f"output.results_dir={tmp_path}",
                   *SHORT, "model.lora_dropout=0") == 1  # fmt: skip
    one, two = read_metrics(no_dropout_one_rank), read_metrics(only_run_dir(tmp_path))
    a, b = losses(no_dropout_one_rank), losses(only_run_dir(tmp_path))
    assert sorted(a) == list(range(1, 17)) and a[16] < a[1]
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-5, (a, b)
    evals = [[r["eval_loss"] for r in rows if "eval_loss" in r] for rows in (one, two)]
    assert len(evals[0]) == 1 and abs(evals[0][0] - evals[1][0]) <= 1e-5
    found = {e["key"]: e["value"] for e in events(only_run_dir(tmp_path) / "result_0.txt")}
    assert found["lora_alpha"] == 16.0 and found["opt_base_learning_rate"] == 5e-3  # from the config
    assert found["gradient_accumulation_steps"] == 1  # micro-batch fitted to each rank's 4 rows


@pytest.mark.full
def test_kill_9_then_resume_gives_the_losses_of_an_uninterrupted_run(lora_data, short_one_rank, tmp_path):
    run_dir = tmp_path / "killed"
    command = [sys.executable, "-m", "trainbench", "run", "llama2_70b_lora", f"data.dir={lora_data}", *SHORT,
               "checkpoint_every_steps=4", f"output.run_dir={run_dir}"]  # fmt: skip
    stopped = kill_after_checkpoint(command, run_dir, 8)
    assert stopped < 16 and (run_dir / "result_0.txt.partial").exists()
    # The checkpoint holds the adapters and their optimizer state, never the frozen base.
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(run_dir / "checkpoint_0")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    assert run_cli("run", "llama2_70b_lora", f"data.dir={lora_data}", f"output.run_dir={run_dir}", "resume=true") == 1
    expected, resumed = losses(short_one_rank), losses(run_dir)
    for step in range(stopped + 1, 17):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    keys = [e["key"] for e in events(run_dir / "result_0.txt")]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1


# -- packed rows ------------------------------------------------------------------------------------------------


def test_a_packed_row_trains_what_its_sequences_would_one_by_one(tmp_path):
    from trainbench.benchmarks.lora import TINY
    from trainbench.families.decoder import lora
    from trainbench.families.decoder.model import DecoderLM

    gen = np.random.default_rng(0)
    seqs = []
    for n, prompt in ((13, 5), (9, 4), (6, 2)):
        tokens = gen.integers(3, 512, n)
        seqs.append((tokens, (np.arange(n) >= prompt).astype(np.uint8)))
    sizes = sft.write_split(tmp_path, seqs, 32)
    assert sizes["rows"] == 1 and sizes["answer_tokens"] == 8 + 5 + 4
    row = {k: torch.as_tensor(v) for k, v in sft.Split(tmp_path, 32).row_arrays([0]).items()}
    torch.manual_seed(0)
    model = DecoderLM(TINY)
    model.init_weights(0)
    lora.attach(model, TINY.targets, 16, 32.0, 0.0)
    lora.load_adapters(model, {k: torch.randn(v.shape) * 0.05 for k, v in lora.full_init(model, 0).items()})
    packed = model(row["tokens"], targets=row["targets"], positions=row["positions"], segments=row["segments"])
    packed.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    alone = 0
    for tokens, mask in seqs:
        t = torch.as_tensor(tokens).unsqueeze(0)
        targets = torch.where(torch.as_tensor(mask[1:]).bool(), t[0, 1:], -100)
        targets = torch.cat([targets, torch.tensor([-100])]).unsqueeze(0)
        alone = alone + model(t, targets=targets)
    alone.backward()
    assert float(packed) == pytest.approx(float(alone), rel=1e-5)
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = grads[name]
            assert float((p.grad - g).abs().max()) <= 1e-5 * float(g.abs().max()), name  # fp32 sums in another order


# -- the three source forms ---------------------------------------------------------------------------------------


def _word_tokenizer(path: Path, words: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(words - 3)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def _texts(n: int, seed: int) -> tuple[list[str], list[str]]:
    gen = np.random.default_rng(seed)
    words = lambda k: " ".join(f"w{i}" for i in gen.integers(0, 509, k))
    return [words(gen.integers(20, 60)) for _ in range(n)], [words(gen.integers(3, 10)) for _ in range(n)]


@pytest.fixture(scope="module")
def govreport(tmp_path_factory):
    """The same made-up GovReport in the three forms: text parquet + tokenizer.json, MLPerf's tokenised parquet,
    NVIDIA's npy rows (two sequences a row)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("govreport")
    tokenizer = _word_tokenizer(root / "tokenizer.json", 512)
    tok = TextTokenizer(tokenizer)
    for form in ("text", "tokens", "npy"):
        (root / form).mkdir()
    for split, prefix, n in (("train", "train", 40), ("eval", "validation", 12)):
        inputs, outputs = _texts(n, seed=len(split))
        pq.write_table(pa.table({"id": list(range(n)), "input": inputs, "output": outputs}),
                       root / "text" / f"{prefix}-00000-of-00001.parquet")  # fmt: skip
        seqs = tok.example(inputs, outputs)
        labels = [np.where(m > 0, t, -100).tolist() for t, m in seqs]
        pq.write_table(pa.table({"input_ids": [t.tolist() for t, _ in seqs], "labels": labels}),
                       root / "tokens" / f"{prefix}.parquet")  # fmt: skip
        rows = []
        for i in range(0, n, 2):
            pair = seqs[i : i + 2]
            rows.append({"input_ids": np.concatenate([t for t, _ in pair]),
                         "loss_mask": np.concatenate([m for _, m in pair]),
                         "seq_start_id": [0, len(pair[0][0])][: len(pair)]})  # fmt: skip
        np.save(root / "npy" / f"{prefix}.npy", np.array(rows, dtype=object), allow_pickle=True)
    return root


def _arrays(folder: Path) -> dict[str, np.ndarray]:
    return {f"{split}/{f}": np.load(folder / split / f) for split in ("train", "eval") for f in sft.FILES}


def _sequences(arrays: dict[str, np.ndarray], split: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    tokens, labels, offsets = (arrays[f"{split}/{f}"] for f in ("tokens.npy", "labels.npy", "seq_offsets.npy"))
    bounds = zip(offsets[:-1], offsets[1:], strict=True)
    return [(tuple(tokens[a:b].tolist()), tuple(labels[a:b].tolist())) for a, b in bounds]


def test_three_source_forms_hold_the_same_tokens_text_packed_and_mlperf_rows_as_given(govreport, tmp_path):
    made = {}
    for form in ("text", "tokens", "npy"):
        extra = ["--tokenizer", govreport / "tokenizer.json"] if form == "text" else []
        assert run_cli("prepare", "llama2_70b_lora", "--source", govreport / form, *extra, "--out", tmp_path / form,
                       "--no-progress") == 0  # fmt: skip
        made[form] = _arrays(tmp_path / form)
    manifests = {f: json.loads((tmp_path / f / "manifest.json").read_text()) for f in made}
    # Text is tokenised here and packed; the two tokenised forms keep every source row as one row.
    assert manifests["text"]["splits"]["train"]["sequences"] == 40 and manifests["text"]["rows"].startswith("packed")
    assert manifests["tokens"]["splits"]["train"]["rows"] == 40 and manifests["npy"]["splits"]["train"]["rows"] == 20
    assert manifests["npy"]["rows"].startswith("as given") and manifests["tokens"]["rows"].startswith("as given")
    for split in ("train", "eval"):
        source = _sequences(made["tokens"], split)  # one example a row, in the source order
        assert sorted(source) == sorted(_sequences(made["text"], split))
        pairs = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(source[0::2], source[1::2], strict=True)]
        assert _sequences(made["npy"], split) == pairs  # NVIDIA's rows of two, each kept whole
    # The prompt is masked, the answer and EOS are not: the first answer token follows "### Summary:\n".
    tokens, labels = made["text"]["train/tokens.npy"], made["text"]["train/labels.npy"]
    assert tokens[0] == 1 and labels[0] == 0 and labels.sum() < len(labels) / 3
    assert run_cli("run", "llama2_70b_lora", f"data.dir={tmp_path / 'text'}", "--help-config") == 0  # readable


def test_mlperf_rows_holding_several_documents_survive_prepare_unchanged_with_attention_across_the_row(tmp_path):
    """Made-up files shaped like MLPerf's: full rows (256 tokens at the tiny preset, 8192 in MLPerf's) of several
    documents each, in NVIDIA's npy and MLPerf's tokenised parquet: the row count and every row's tokens and loss
    mask survive, and the loop sees each row as one sequence (positions 0..255, one segment: causal across it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    gen = np.random.default_rng(0)
    rows = {}
    for split, n in (("train", 9), ("validation", 3)):
        rows[split] = []
        for _ in range(n):
            ids, mask, starts = [], [], []
            while len(ids) < 256:
                starts.append(len(ids))
                prompt, answer = int(gen.integers(10, 60)), int(gen.integers(3, 20))
                ids += [1, *gen.integers(64, 500, prompt - 1).tolist(), *gen.integers(8, 64, answer).tolist()]
                mask += [0] * prompt + [1] * answer
            rows[split].append((np.array(ids[:256]), np.array(mask[:256]), [s for s in starts if s < 256]))
    npy, parquet = tmp_path / "npy", tmp_path / "parquet"
    npy.mkdir()
    parquet.mkdir()
    for split, items in rows.items():
        np.save(npy / f"{split}.npy", np.array([{"input_ids": i, "loss_mask": m, "seq_start_id": s}
                                                for i, m, s in items], dtype=object), allow_pickle=True)  # fmt: skip
        pq.write_table(pa.table({"input_ids": [i.tolist() for i, _, _ in items],
                                 "labels": [np.where(m > 0, i, -100).tolist() for i, m, _ in items]}),
                       parquet / f"{split}.parquet")  # fmt: skip
    for form in (npy, parquet):
        out = tmp_path / f"out-{form.name}"
        assert run_cli("prepare", "llama2_70b_lora", "--source", form, "--out", out, "--no-progress") == 0
        for split, folder in (("train", "train"), ("validation", "eval")):
            data = sft.Split(out / folder, 256)
            assert data.rows == len(rows[split]) and data.sequences == len(rows[split])
            for r, (ids, mask, _) in enumerate(rows[split]):
                a, b = int(data.seq_offsets[r]), int(data.seq_offsets[r + 1])
                assert np.array_equal(data.tokens[a:b], ids) and np.array_equal(data.labels[a:b], mask), (form, r)
            seen = data.row_arrays([0])  # one sequence a row: no positions or segments, plain causal attention
            assert set(seen) == {"tokens", "targets", "seq_ids"} and len(set(seen["seq_ids"][0])) == 1


def test_a_row_of_one_sequence_trains_the_same_through_the_causal_path_padding_included(tmp_path):
    """Rows as given skip the document mask: for a sequence followed by padding, plain causal attention gives its
    tokens the same loss and adapter gradients as the masked path (they never look forward at the padding)."""
    from trainbench.benchmarks.lora import TINY
    from trainbench.families.decoder import lora
    from trainbench.families.decoder.model import DecoderLM

    gen = np.random.default_rng(3)
    seqs = [(gen.integers(3, 500, n), (np.arange(n) >= n // 2).astype(np.uint8)) for n in (200, 256, 131)]
    sft.write_split(tmp_path, seqs, 256, packed=False)
    split = sft.Split(tmp_path, 256)
    assert split.whole_rows
    fast = {k: torch.as_tensor(v) for k, v in split.row_arrays([0, 1, 2]).items()}
    seg = fast["seq_ids"]
    positions = torch.where(seg >= 0, torch.arange(256).expand(3, 256), 0)
    torch.manual_seed(0)
    model = DecoderLM(TINY)
    model.init_weights(0)
    lora.attach(model, TINY.targets, 16, 32.0, 0.0)
    lora.load_adapters(model, {k: torch.randn(v.shape) * 0.05 for k, v in lora.full_init(model, 0).items()})
    losses, grads = [], []
    for kwargs in ({}, {"positions": positions, "segments": seg}):
        model.zero_grad()
        loss = model(fast["tokens"], targets=fast["targets"], **kwargs)
        loss.backward()
        losses.append(float(loss))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for name, g in grads[1].items():
        assert float((grads[0][name] - g).abs().max()) <= 1e-5 * float(g.abs().max()), name


def test_a_sentencepiece_tokenizer_model_is_read_too(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece

    gen = np.random.default_rng(1)
    corpus = [" ".join("".join(chr(97 + c) for c in gen.integers(0, 26, 5)) for _ in range(12)) for _ in range(3000)]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=512, model_type="bpe",
        bos_id=1, eos_id=2, unk_id=0,
    )  # fmt: skip
    source = tmp_path / "src"
    source.mkdir()
    for prefix in ("train", "validation"):
        pq.write_table(pa.table({"input": corpus[:20], "output": corpus[20:40]}), source / f"{prefix}.parquet")
    assert run_cli("prepare", "llama2_70b_lora", "--source", source, "--tokenizer", tmp_path / "tokenizer.model",
                   "--out", tmp_path / "out", "--no-progress") == 0  # fmt: skip
    tokens = np.load(tmp_path / "out" / "train" / "tokens.npy")
    offsets = np.load(tmp_path / "out" / "train" / "seq_offsets.npy")
    assert len(offsets) == 21 and set(tokens[offsets[1:] - 1]) == {2}  # every sequence ends with EOS
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    # the corpus has no capitals or '#': those pieces are unknown to this model, the rest of the prompt reads back
    assert PROMPT.split(":")[0].strip("# S") in sp.decode(tokens[: offsets[1]].tolist())


def _bad(tmp_path, capsys, source: Path, *extra) -> str:
    out = tmp_path / "out"
    assert run_cli("prepare", "llama2_70b_lora", "--source", source, *extra, "--out", out, "--no-progress") == 2
    assert not (out / "manifest.json").exists()  # nothing looks finished
    message = capsys.readouterr().out.strip()
    assert message.count("\n") <= 1, message
    return message


def test_bad_sources_are_one_sentence_each(govreport, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    only_input = tmp_path / "only_input"
    only_input.mkdir()
    pq.write_table(pa.table({"input": ["a"]}), only_input / "train.parquet")
    assert "no column 'output'" in _bad(tmp_path, capsys, only_input)

    long = tmp_path / "long"
    long.mkdir()
    for prefix in ("train", "validation"):
        pq.write_table(pa.table({"input_ids": [[5] * 300], "labels": [[-100] * 299 + [5]]}), long / f"{prefix}.parquet")
    assert "row 0 has 300 tokens, more than a row's 256" in _bad(tmp_path, capsys, long)

    short = tmp_path / "short"
    short.mkdir()
    pq.write_table(pa.table({"input_ids": [[5, 6, 7]], "labels": [[-100, 6]]}), short / "train.parquet")
    assert "row 0 has 2 labels for 3 input_ids" in _bad(tmp_path, capsys, short)

    small = _word_tokenizer(tmp_path / "small.json", 300)
    message = _bad(tmp_path, capsys, govreport / "text", "--tokenizer", small)
    assert "small.json: a vocabulary of 300 tokens, but the model has 512" in message

    assert "give --tokenizer" in _bad(tmp_path, capsys, govreport / "text")


def test_the_eval_loss_is_the_mean_over_sequences_of_each_ones_mean(lora_data):
    """MLPerf's reference evaluates one sequence per batch and averages: a long answer counts as much as a short."""
    cfg = BENCH.config("tiny")
    cfg.data.dir = str(lora_data)
    logits = torch.zeros(1, 6, 4)
    logits[0, :, 0] = 5.0  # every position predicts token 0
    batch = {
        "tokens": torch.zeros(1, 6, dtype=torch.long),
        "targets": torch.tensor([[0, 0, 0, 1, -100, -100]]),
        "positions": torch.zeros(1, 6, dtype=torch.long),
        "segments": torch.tensor([[0, 0, 0, 1, 1, -1]]),
        "seq_ids": torch.tensor([[0, 0, 0, 1, 1, -1]]),
    }
    sums = BENCH.eval_sums(lambda *a, **k: logits, batch)
    right, wrong = (-torch.log_softmax(logits[0, 0], -1)[[0, 1]]).tolist()
    assert BENCH.eval_metric(sums) == pytest.approx((right + wrong) / 2) and math.isclose(float(sums[1]), 2)


@pytest.mark.full
def test_fp8_base_on_one_and_two_ranks_tracks_the_full_precision_run(lora_data, no_dropout_one_rank, tmp_path):
    """The FP8 layouts (whole base on every rank with DDP over the adapters, or sharded by FSDP2 and gathered in FP8)
    on the CPU, where the product is taken with the dequantised weights: two ranks agree with one to FP8's rounding
    (a sum in another order can flip an e4m3 rounding of the gradient), and all track the full-precision run."""
    common = [f"data.dir={lora_data}", *SHORT, "model.lora_dropout=0"]
    fsdp = "model.base_sharding=fsdp"
    runs = {"fp8_one": ["--nproc", "1"], "fp8_two": ["--nproc", "2"], "fsdp_one": ["--nproc", "1", fsdp],
            "fsdp_two": ["--nproc", "2", fsdp]}  # fmt: skip
    got = {"full": losses(no_dropout_one_rank)}
    for name, extra in runs.items():
        assert run_cli("run", "llama2_70b_lora", *extra, *common, "model.base_precision=fp8",
                       f"output.results_dir={tmp_path / name}") == 1  # fmt: skip
        got[name] = losses(only_run_dir(tmp_path / name))
    steps = range(1, 17)
    assert max(abs(got["fp8_one"][s] - got["fp8_two"][s]) / got["fp8_one"][s] for s in steps) <= 5e-3, got
    assert max(abs(got["fp8_one"][s] - got["full"][s]) / got["full"][s] for s in steps) <= 1e-2, got
    assert got["fp8_one"][16] < got["fp8_one"][1] - 1.0  # it learns
    # the FP8 base sharded by FSDP2 (gathered in FP8) trains what the replicated one does: on one rank the same sums
    assert max(abs(got["fsdp_one"][s] - got["fp8_one"][s]) / got["fp8_one"][s] for s in steps) <= 1e-5, got
    assert max(abs(got["fsdp_two"][s] - got["fp8_one"][s]) / got["fp8_one"][s] for s in steps) <= 5e-3, got


def test_a_bad_base_checkpoint_stops_the_run_before_any_folder_is_made(lora_data, tmp_path, capsys):
    import shutil

    broken = tmp_path / "data"
    shutil.copytree(lora_data, broken)
    shard = sorted((broken / "base").glob("*.safetensors"))[2]
    shard.unlink()
    results = tmp_path / "results"
    assert run_cli("run", "llama2_70b_lora", f"data.dir={broken}", f"output.results_dir={results}") == 2
    assert f"{shard}: named in model.safetensors.index.json but missing" in capsys.readouterr().out
    assert run_cli("run", "llama2_70b_lora", f"data.dir={lora_data}", f"output.results_dir={results}",
                   "model.intermediate_size=256") == 2  # fmt: skip
    assert "needs [256, 128]; set the model config of this checkpoint" in capsys.readouterr().out
    assert not results.exists()


def test_synthetic_rows_at_the_70b_shape_are_govreports_and_a_run_on_them_draws_its_base_from_the_seed(
        lora_data, tmp_path, capsys):  # fmt: skip
    """`prepare --synthetic --preset llama2-70b` writes MLPerf's GovReport rows' shape (rows of exactly 8,192 tokens,
    a few documents each, about a tenth of the tokens summary) and no base: its manifest says the base is random and
    the benchmark reads none (None: drawn from the seed). A run on such rows (the tiny preset's, the manifest set so)
    says on its console that its base came from the seed and its losses are no convergence result."""
    import shutil

    RANDOM_BASE = sft.RANDOM_BASE

    out = tmp_path / "rows"
    assert run_cli("prepare", "llama2_70b_lora", "--synthetic", "--preset", "llama2-70b", "--out", out,
                   "--train-samples", "8", "--eval-samples", "2", "--no-progress") == 0  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["base"] == RANDOM_BASE and "base_weights" not in manifest and not (out / "base").exists()
    assert "initialises its 80-layer base from its seed" in capsys.readouterr().out
    train = manifest["splits"]["train"]
    assert train["rows"] == train["sequences"] == 8 and train["tokens"] == 8 * 8192
    assert 0.05 < train["answer_tokens"] / train["tokens"] < 0.15
    cfg = BENCH.config("llama2-70b")
    cfg.data.dir = str(out)
    assert BENCH.base_weights(cfg) is None
    BENCH.check_data(cfg)  # no checkpoint to check; the rows are
    assert BENCH.inputs_identity(cfg)["base weights"] == RANDOM_BASE

    tiny = tmp_path / "tiny"
    shutil.copytree(lora_data, tiny)
    shutil.rmtree(tiny / "base")
    changed = json.loads((tiny / "manifest.json").read_text())
    del changed["base_weights"]
    (tiny / "manifest.json").write_text(json.dumps(changed | {"base": RANDOM_BASE}))
    results = tmp_path / "r"
    run_cli("run", "llama2_70b_lora", f"data.dir={tiny}", f"output.results_dir={results}", *SHORT,
            "schedule.max_samples=16")  # fmt: skip
    console = (only_run_dir(results) / "console.log").read_text()
    assert "the base initialised from the seed, no checkpoint read" in console
    assert len([r for r in read_metrics(only_run_dir(results)) if "loss" in r]) == 2  # it trained
