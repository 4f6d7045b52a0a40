"""Helpers of the scripts under perf/ that compute what docs/performance.md reports."""

import importlib.util
import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "perf"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rank_imbalance_costs_a_row_by_its_sequences_squared_lengths(tmp_path):
    rank_imbalance = load("rank_imbalance")
    ids = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1], [1, 2, 2, 3, 3, 3]], dtype=np.int8)
    with h5py.File(tmp_path / "part_0.hdf5", "w") as f:
        f["sequence_ids"] = ids
    assert rank_imbalance.row_costs(tmp_path).tolist() == [9 + 4, 36, 1 + 4 + 9]
    with pytest.raises(SystemExit, match="no packed shards"):
        rank_imbalance.row_costs(tmp_path / "missing")


def test_bert_scaling_reads_steps_per_second_outside_compilation_and_profiled_steps(tmp_path):
    bert_scaling = load("bert_scaling")
    run = tmp_path / "results" / "run"
    run.mkdir(parents=True)
    # 10 steps per interval: 125 ms a step, except a slow interval at step 50, which a profiled run leaves out
    rows, t = [], 0
    for step in range(10, 101, 10):
        t += 1250 if step != 50 else 5000
        rows.append({"step": step, "time_ms": t, "samples_per_s": 400.0 + step})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "run_0.json").write_text(json.dumps({"peak_memory_gib": 1.0}))
    plain = bert_scaling.read_run(tmp_path / "results")
    assert plain["steps_per_s_intervals"] == pytest.approx([8, 2, 8, 8, 8, 8, 8])  # steps 40-100
    assert plain["samples_per_s"] == 470  # the median of steps 40-100
    (run / "profile_0_kernels.csv").write_text("")
    profiled = bert_scaling.read_run(tmp_path / "results")
    assert profiled["steps_per_s_intervals"] == pytest.approx([8, 8, 8, 8, 8])  # steps 40 and 70-100
    assert profiled["gpus_while_timed"] == {}


def test_attention_benchmark_packs_synthetic_rows_in_order_and_within_the_cap():
    attention_kernels = load("attention_kernels")
    fills = {}
    for per_row in (3, 6):
        ids = attention_kernels.packed_sequence_ids(per_row)
        assert ids.shape == (48, 512)
        for row in ids:
            real = int((row > 0).sum())
            assert (row[real:] == 0).all()  # sequences first, then the row's padding
            assert (np.diff(row[:real]) >= 0).all() and (np.diff(row[:real]) <= 1).all()  # 1, 2, ... in order
            assert 1 <= row.max() <= per_row
        fills[per_row] = (ids > 0).mean()
    assert fills[6] > fills[3]  # more sequences per row fill the rows better


def test_the_fp8_quality_script_splits_wikitext_into_articles_and_holds_one_in_20_out(tmp_path):
    quality = load("llm_fp8_quality")
    text = "".join(f" = Article {i} = \n\n = = Section = = \n Body {i} . \n\n" for i in range(40))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "part.txt").write_text(text)
    docs = quality.articles(text)
    assert len(docs) == 40 and docs[3].startswith("= Article 3 =") and "= = Section = =" in docs[3]
    assert quality.source_folder(tmp_path / "text", tmp_path / "src") == {"articles_train": 38, "articles_eval": 2}
    held = [json.loads(line)["text"] for line in (tmp_path / "src" / "wikitext-validation.jsonl").open()]
    assert [d.split(" =")[0] for d in held] == ["= Article 19", "= Article 39"]
    with pytest.raises(SystemExit, match="no WikiText .txt files"):
        quality.source_folder(tmp_path / "src", tmp_path / "other")


def test_the_inductor_options_hook_sets_known_options_and_refuses_unknown_ones_in_one_sentence():
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(SCRIPTS / "inductor_options"))
    show = "import torch._inductor.config as c; print(c.triton.tile_reductions, c.coordinate_descent_tuning)"
    env["TRAINBENCH_INDUCTOR_OPTIONS"] = "triton.tile_reductions=1,coordinate_descent_tuning=1"
    done = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "True"]
    env["TRAINBENCH_INDUCTOR_OPTIONS"] = "triton.tile_reduction=1"
    bad = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "error: TRAINBENCH_INDUCTOR_OPTIONS: 'triton.tile_reduction=1' is not key=value with a key of "
        "torch._inductor.config"
    ]


# The stand-in `python3`'s first line: `d`, the results folder the script hands `trainbench bench`.
RESULTS_DIR_OF_ARGS = 'for a in "$@"; do case $a in output.results_dir=*) d=${a#output.results_dir=} ;; esac; done\n'


def _perf_script(tmp_path, script: str, stand_in: str, args: tuple[str, ...], env: dict[str, str],
                 limit: tuple[str, ...] = ()):  # fmt: skip
    """perf/``script`` ``args`` with ``stand_in`` (a shell script's body, after :data:`RESULTS_DIR_OF_ARGS`) as the
    `python3` on PATH, $OUT and $RESULTS under ``tmp_path``, ``env`` besides, after ``limit`` (a `timeout`). The
    finished process."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    python3 = bin_dir / "python3"
    python3.write_text("#!/bin/sh\n" + RESULTS_DIR_OF_ARGS + stand_in)
    python3.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               RESULTS=str(tmp_path / "results"), **env)  # fmt: skip
    return subprocess.run([*limit, "bash", str(SCRIPTS / script), *args], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def _bench_figures(tmp_path, stand_in: str, *measurements: str, limit_s: int | None = None, nproc: int = 1,
                   env: dict[str, str] | None = None):  # fmt: skip
    """perf/bench_figures.sh ``measurements`` on ``nproc`` GPUs through :func:`_perf_script`; under `timeout
    limit_s` where given. The finished process."""
    limit = ("timeout", str(limit_s)) if limit_s is not None else ()
    return _perf_script(tmp_path, "bench_figures.sh", stand_in, measurements, {"NPROC": str(nproc), **(env or {})},
                        limit)  # fmt: skip


def _recording(folder: str, figure: str = "samples_per_s") -> str:
    """A stand-in `trainbench bench` for :func:`_bench_figures` that records its arguments a line a call in
    $OUT/args.txt and writes a bench.json (``figure``: 1) in a results folder named ``folder``."""
    return (f'echo "$*" >> "$OUT/args.txt"\nmkdir -p "$d/{folder}"\n'
            f"echo '{{\"{figure}\": 1}}' > \"$d/{folder}/bench.json\"\n")  # fmt: skip


def _calls(tmp_path) -> list[list[str]]:
    """The arguments of each call :func:`_recording` recorded, split."""
    return [c.split() for c in (tmp_path / "out" / "args.txt").read_text().splitlines()]


def test_a_failed_measurement_of_bench_figures_is_named_and_the_next_still_runs(tmp_path):
    """perf/bench_figures.sh with a stand-in `python3` on PATH whose `trainbench bench llama31_8b` fails after its
    first depth: the depth it measured comes back, the bert measurement after it still runs and its bench.json comes
    back, and the call ends non-zero naming the failed one."""
    done = _bench_figures(
        tmp_path,
        'case " $* " in *" llama31_8b "*) mkdir -p "$d/20261127T000000Z-llm" && echo \'{"depth": 2}\' '
        '> "$d/20261127T000000Z-llm/bench_raw_2.json"; echo "error: does not fit"; exit 1 ;; esac\n'
        'mkdir -p "$d/20261127T000000Z-bert" && echo \'{"tokens_per_s": 1}\' > "$d/20261127T000000Z-bert/bench.json"\n',
        "llm",
        "bert",
    )
    assert done.returncode == 1 and "failed: llm" in done.stderr, (done.stdout, done.stderr)
    assert json.loads((tmp_path / "out" / "bert.json").read_text()) == {"tokens_per_s": 1}
    assert "does not fit" in (tmp_path / "out" / "llm.log").read_text()
    assert json.loads((tmp_path / "out" / "llm.raw_2.json").read_text()) == {"depth": 2}
    assert not (tmp_path / "out" / "llm.json").exists()


def test_dlrmv4_on_one_gpu_and_on_the_node_takes_a_step_of_512_a_gpu_at_the_rules_learning_rate(tmp_path):
    """`NPROC=2 perf/bench_figures.sh node-dlrmv4`: two measurements, on 1 GPU and on 2, each GPU a step of 512
    samples in micro-batches of 128, the learning rate 1e-6 x GBS / 8192 (inside the rules' band), the tables cut to
    1 M rows and sharded; each bench.json back under its own name."""
    done = _bench_figures(
        tmp_path,
        _recording("20261129T000000Z-dlrmv4"),
        "node-dlrmv4",
        nproc=2,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    calls = _calls(tmp_path)
    assert len(calls) == 2
    for args, n, gbs, lr in zip(calls, (1, 2), (512, 1024), ("6.25e-08", "1.25e-07"), strict=True):
        call = " ".join(args)
        assert args[args.index("--nproc") + 1] == str(n) and f"data.global_batch_size={gbs}" in args, call
        assert f"optimizer.lr={lr}" in args and "data.micro_batch_size=128" in args, call
        assert args[args.index("--table-rows") + 1] == "1000000" and "perf.sharded_tables=true" in args, call
    assert all((tmp_path / "out" / f"node_dlrmv4_{n}.json").exists() for n in (1, 2))


def test_node_bert_takes_the_shapes_asked_for_and_the_node_keys_on_the_node_alone(tmp_path):
    """`NPROC=2 BERT_ACCUMULATION=1 NODE_EXTRA=... perf/bench_figures.sh node-bert`: BERT at 48 x 1 on one GPU and on
    2, not at 48 x 2; the keys of NODE_EXTRA (which one GPU refuses as having no effect) on the 2-GPU run alone, EXTRA's
    on both."""
    done = _bench_figures(
        tmp_path,
        _recording("20261130T000000Z-bert"),
        "node-bert",
        nproc=2,
        env={"BERT_ACCUMULATION": "1", "NODE_EXTRA": "distributed.bucket_cap_mb=400 distributed.overlap_compiled=true",
             "EXTRA": "--profile-steps 0"},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout, done.stderr)
    calls = _calls(tmp_path)
    assert [(c[c.index("--nproc") + 1], [a for a in c if a.startswith("data.global_batch_size=")]) for c in calls] == [
        ("1", ["data.global_batch_size=48"]), ("2", ["data.global_batch_size=96"])]  # fmt: skip
    node = ["distributed.bucket_cap_mb=400", "distributed.overlap_compiled=true"]
    assert not any(k in calls[0] for k in node) and all(k in calls[1] for k in node), calls
    assert all(c[c.index("--profile-steps") + 1] == "0" for c in calls), calls
    back = sorted(p.name for p in (tmp_path / "out").glob("*.json"))
    assert back == ["node_bert_1x48x1.json", "node_bert_2x48x1.json"], back


def test_node_flux_512_takes_the_presets_global_batch_on_one_gpu_and_on_the_node(tmp_path):
    """`NPROC=2 NODE_EXTRA=... perf/bench_figures.sh node-flux-512`: flux1 in FP8 at the preset's global batch of 512
    on one GPU (32 micro-batches of 16) and on 2 (16 each), NODE_EXTRA's keys on the 2-GPU run alone, each bench.json
    back under its own name."""
    done = _bench_figures(
        tmp_path,
        _recording("20261130T000000Z-flux1"),
        "node-flux-512",
        nproc=2,
        env={"NODE_EXTRA": "distributed.reduce_once_a_step=true distributed.keep_gathered=true"},
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    calls = _calls(tmp_path)
    assert [c[c.index("--nproc") + 1] for c in calls] == ["1", "2"], calls
    for c in calls:
        assert "data.global_batch_size=512" in c and "data.micro_batch_size=16" in c and "model.precision=fp8" in c
        assert c[c.index("--blocks") + 1] == "1,2" and c[c.index("--preset") + 1] == "flux1-schnell", c
    node = ["distributed.reduce_once_a_step=true", "distributed.keep_gathered=true"]
    assert not any(k in calls[0] for k in node) and all(k in calls[1] for k in node), calls
    back = sorted(p.name for p in (tmp_path / "out").glob("*.json"))
    assert back == ["node_flux_1x512.json", "node_flux_2x512.json"], back


def test_node_flux_whole_measures_the_whole_model_at_the_presets_global_batch_on_the_node_alone(tmp_path):
    """`NPROC=2 NODE_EXTRA=... perf/bench_figures.sh node-flux-whole`: flux1 in FP8 with all its 19 blocks (no
    --blocks) at the preset's global batch of 512 on the 2 GPUs alone, NODE_EXTRA's keys with it: what the line
    through 1 and 2 blocks says of the whole model's memory, measured."""
    done = _bench_figures(
        tmp_path,
        _recording("20261130T000000Z-flux1"),
        "node-flux-whole",
        nproc=2,
        env={"NODE_EXTRA": "distributed.reduce_once_a_step=true distributed.grad_reduce_dtype=bf16"},
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    calls = _calls(tmp_path)
    assert len(calls) == 1 and calls[0][calls[0].index("--nproc") + 1] == "2" and "--blocks" not in calls[0], calls
    assert all(
        k in calls[0]
        for k in (
            "data.global_batch_size=512",
            "data.micro_batch_size=16",
            "model.precision=fp8",
            "distributed.reduce_once_a_step=true",
            "distributed.grad_reduce_dtype=bf16",
        )
    )
    assert (tmp_path / "out" / "node_flux_whole.json").exists()


@pytest.mark.parametrize("nproc, depth", [(2, ["--blocks", "2,4"]), (8, [])])
def test_both_blocks_of_gpt_oss_20b_spread_their_experts_over_the_node(tmp_path, nproc, depth):
    """`perf/bench_figures.sh node-moe node-moe-hf node-moe-fsdp`: the reference's block and GPT-OSS's (its own
    preset), each with its experts over NPROC GPUs, then the reference's block with the experts sharded by FSDP2 as
    the rest (no distributed.ep); the whole 24 blocks on 8, 2 and 4 blocks extrapolated on fewer."""
    done = _bench_figures(
        tmp_path,
        _recording("20261129T000000Z-moe", "tokens_per_s"),
        "node-moe",
        "node-moe-hf",
        "node-moe-fsdp",
        nproc=nproc,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    calls = _calls(tmp_path)
    assert [c[c.index("--preset") + 1] for c in calls] == ["gpt-oss-20b", "gpt-oss-20b-hf", "gpt-oss-20b"]
    for c in calls:
        assert c[c.index("--nproc") + 1] == str(nproc)
        assert ("--blocks" in c) == bool(depth) and (not depth or c[c.index("--blocks") + 1] == "2,4")
    assert [f"distributed.ep={nproc}" in c for c in calls] == [True, True, False]
    assert not any(k.startswith("distributed.ep=") for k in calls[2])
    assert all((tmp_path / "out" / f"{name}.json").exists() for name in ("node_moe", "node_moe_hf", "node_moe_fsdp"))


def test_a_measurement_stopped_by_a_time_limit_keeps_the_depths_it_measured(tmp_path):
    """perf/bench_figures.sh under `timeout` (its TERM, as a device call's time limit sends it) while a stand-in
    `trainbench bench` waits after its first depth: the depth measured comes back into $OUT, and `timeout` ends the
    call with its own code for a limit reached."""
    done = _bench_figures(
        tmp_path,
        'mkdir -p "$d/20261127T000000Z-llm" && echo \'{"depth": 2}\' > "$d/20261127T000000Z-llm/bench_raw_2.json"\n'
        "trap 'echo error: the measurement was stopped by SIGTERM; exit 1' TERM\n"
        "for i in $(seq 300); do sleep 0.1; done\n",
        "llm",
        limit_s=2,
    )
    assert done.returncode == 124, (done.returncode, done.stdout, done.stderr)
    # Its last words, said after the TERM that `timeout` sends to the whole group (tee among it), are in its log.
    assert "stopped by SIGTERM" in (tmp_path / "out" / "llm.log").read_text()
    assert json.loads((tmp_path / "out" / "llm.raw_2.json").read_text()) == {"depth": 2}, done.stderr
    assert "a depth measured before llm stopped" in done.stderr


def test_term_to_bench_figures_alone_reaches_the_measurement_under_way_at_once(tmp_path):
    """TERM sent to perf/bench_figures.sh's own process (`kill`, not a signal to its whole group as `timeout` sends):
    the stand-in `trainbench bench` under way is sent TERM at once (the real one then ends its ranks) rather than
    left to run to its end, and the depth it had measured comes back."""
    import os
    import signal
    import subprocess
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        "#!/bin/bash\n" + RESULTS_DIR_OF_ARGS +
        'mkdir -p "$d/20261127T000000Z-llm" && echo \'{"depth": 2}\' > "$d/20261127T000000Z-llm/bench_raw_2.json"\n'
        'trap \'echo stopped > "$OUT/measurement_stopped"; exit 143\' TERM\n'
        'touch "$OUT/measuring"; for i in $(seq 600); do sleep 0.1; done\n'
    )  # fmt: skip
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out),
               RESULTS=str(tmp_path / "results"), NPROC="1")  # fmt: skip
    script = subprocess.Popen(["bash", str(SCRIPTS / "bench_figures.sh"), "llm"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 30
    while not (out / "measuring").exists() and time.time() < deadline:
        time.sleep(0.05)
    script.send_signal(signal.SIGTERM)
    try:
        _, stderr = script.communicate(timeout=30)  # the stand-in alone would sleep 60 s
    finally:
        script.kill()
    assert script.returncode == 143, (script.returncode, stderr)
    assert (out / "measurement_stopped").read_text() == "stopped\n", stderr
    assert json.loads((out / "llm.raw_2.json").read_text()) == {"depth": 2} and "before llm stopped" in stderr


def test_the_saved_tensors_listing_names_what_each_way_keeps_from_the_forward_for_the_backward():
    """perf/saved_for_backward.py at a tiny width: with the per-call casts the backward takes the fp32 weights from
    the block's inputs, with the casts once a step their FP8 casts instead; in both the forward's own tensors (the
    activations kept per micro-batch) are listed with their bytes."""
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    import torch

    from trainbench.families.decoder.model import Block, DecoderConfig

    saved_for_backward = load("saved_for_backward")
    cfg = DecoderConfig(vocab_size=64, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                        intermediate_size=128, max_seq_length=32, fused_qkv=True)  # fmt: skip
    torch._dynamo.reset()
    ways = {once: saved_for_backward.saved(cfg, 2, 32, once) for once in (False, True)}
    for tensors in ways.values():
        own = [t for t in tensors if not t["input"]]
        assert own and all(t["bytes"] > 0 for t in own)
    weights = {tuple(w.shape) for w in Block(cfg).parameters() if w.dim() == 2}  # the linear layers'
    for once, tensors in ways.items():  # the weights as the backward takes them, in either orientation
        kept = {t["dtype"] for t in tensors if t["input"] and {tuple(t["shape"]), tuple(t["shape"][::-1])} & weights}
        assert kept == ({"torch.float8_e4m3fn"} if once else {"torch.float32"}), (once, kept)


def _each_gpu(tmp_path, stand_in: str, *measurements: str, gpus: str = "2"):
    """perf/each_gpu.sh ``measurements`` on ``gpus`` GPUs through :func:`_perf_script`. The finished process."""
    return _perf_script(tmp_path, "each_gpu.sh", stand_in, measurements, {"GPUS": gpus})


# A stand-in `trainbench bench` whose figure is its GPU's (CUDA_VISIBLE_DEVICES): GPU 1 the slower
BY_GPU = (
    'echo "$CUDA_VISIBLE_DEVICES $*" >> "$OUT/args.txt"\nmkdir -p "$d/run"\n'
    "case $CUDA_VISIBLE_DEVICES in 0) t=15059.4 ;; 1) t=14856.2 ;; *) t=1 ;; esac\n"
    'printf \'{\\n  "tokens_per_s": %s,\\n  "tokens_per_s_per_rank": 2\\n}\\n\' "$t" > "$d/run/bench.json"\n'
)


def test_each_gpu_measures_one_gpu_figures_on_every_gpu_side_by_side_and_names_the_slowest(tmp_path):
    """perf/each_gpu.sh llm-auto on 2 GPUs: bench_figures.sh's llm-auto once on each GPU alone (CUDA_VISIBLE_DEVICES
    0 and 1, one rank each, results apart), each bench.json back as llm_auto-gpuN.json with its console, then each
    GPU's figure and the slowest's, the pace a synchronous step of both would go at."""
    done = _each_gpu(tmp_path, BY_GPU, "llm-auto")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.strip() == "llm_auto: GPU 0 15059, GPU 1 14856 tokens/s; the slowest GPU 1: 14856", done.stdout
    out = tmp_path / "out"
    assert json.loads((out / "llm_auto-gpu0.json").read_text())["tokens_per_s"] == 15059.4
    assert json.loads((out / "llm_auto-gpu1.json").read_text())["tokens_per_s"] == 14856.2
    calls = sorted(_calls(tmp_path))
    assert [c[0] for c in calls] == ["0", "1"]  # one measurement on each GPU alone
    for gpu, call in zip("01", calls, strict=True):
        assert call[1:5] == ["-m", "trainbench", "bench", "llama31_8b"] and "--nproc" not in call
        assert f"output.results_dir={tmp_path}/results/gpu{gpu}/llm_auto-gpu{gpu}" in call, call
    assert (out / "llm_auto-gpu1.log").exists() and (out / "each_gpu1.log").exists()


def test_each_gpu_refuses_a_node_measurement_or_a_host_without_gpus_and_says_which_gpu_failed(tmp_path):
    """A node measurement (it runs on NPROC GPUs) and a host where no GPU is listed are refused in one sentence,
    exit 2, before anything runs; a measurement that fails on one GPU ends the call non-zero naming that GPU and
    its console, the other GPU's figure still said."""
    node = _each_gpu(tmp_path, BY_GPU, "llm-auto", "node-llm")
    assert node.returncode == 2 and "node-llm runs on NPROC GPUs: give it to perf/bench_figures.sh" in node.stderr
    none = _each_gpu(tmp_path, BY_GPU, "llm-auto", gpus="0")
    assert none.returncode == 2 and "usage: perf/each_gpu.sh MEASUREMENT" in none.stderr
    assert not (tmp_path / "out" / "args.txt").exists()
    failing = 'case $CUDA_VISIBLE_DEVICES in 1) echo "error: CUDA out of memory"; exit 1 ;; esac\n' + BY_GPU
    done = _each_gpu(tmp_path, failing, "llm-auto")
    assert done.returncode == 1 and f"failed on GPU 1 ({tmp_path}/out/each_gpu1.log)" in done.stderr, done.stderr
    assert done.stdout.strip() == "llm_auto: GPU 0 15059 tokens/s; the slowest GPU 0: 15059", done.stdout


def test_each_gpu_one_each_gives_every_measurement_a_gpu_of_its_own_at_once(tmp_path):
    """ONE_EACH=1 perf/each_gpu.sh A B on 3 GPUs: A on GPU 0 alone, B on GPU 1 alone, GPU 2 idle, each figure said
    under its name; more measurements than GPUs are refused in one sentence before anything runs."""
    done = _perf_script(tmp_path, "each_gpu.sh", BY_GPU, ("llm-auto", "gpt-oss"), {"GPUS": "3", "ONE_EACH": "1"})
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert sorted(done.stdout.split("\n")[:2]) == ["gpt_oss: GPU 1 14856 tokens/s", "llm_auto: GPU 0 15059 tokens/s"]
    calls = sorted(_calls(tmp_path))
    assert [(c[0], c[4]) for c in calls] == [("0", "llama31_8b"), ("1", "gpt_oss_20b")], calls
    assert all("--nproc" not in c for c in calls) and not (tmp_path / "out" / "each_gpu2.log").exists()
    assert (tmp_path / "out" / "llm_auto-gpu0.json").exists() and (tmp_path / "out" / "gpt_oss-gpu1.json").exists()
    (tmp_path / "many").mkdir()
    many = _perf_script(tmp_path / "many", "each_gpu.sh", BY_GPU, ("llm-auto", "gpt-oss", "bert"),
                        {"GPUS": "2", "ONE_EACH": "1"})  # fmt: skip
    assert many.returncode == 2 and "gives each of the 3 measurements a GPU of its own, and 2 are" in many.stderr
    assert not (tmp_path / "many" / "out" / "args.txt").exists()


def test_forecast_layouts_takes_one_gpus_steps_to_the_models_depth_and_forecasts_each_layout(tmp_path, monkeypatch,
                                                                                             capsys):  # fmt: skip
    """perf/forecast_layouts.py: the one GPU's step on the line through its two depths, at the model's own depth;
    each layout's forecast through the product's (measure/forecast.py), its rate a GPU against the one GPU's."""
    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path))
    forecast_layouts = load("forecast_layouts")
    from trainbench.resolve import build_config

    _, tiny = build_config("gpt_oss_20b", "tiny", None, {})
    gbs, layers = 4 * tiny.data.micro_batch_size, tiny.model.num_layers
    rows = forecast_layouts.forecasts("gpt_oss_20b", "tiny", {"data.global_batch_size": str(gbs)},
                                      [{"distributed.ep": "2"}, {}], 2, (1, 2), (0.3, 0.5), 2e12)  # fmt: skip
    step = 0.3 + 0.2 * (layers - 1)
    assert [r["one_gpu_step_s"] for r in rows] == [pytest.approx(step)] * 2 and rows[0]["depth"] == layers
    ep, fsdp = (r["split_s"] for r in rows)
    assert ep["compute (one GPU's step)"] == pytest.approx(step / 2)  # each rank half the one GPU's micro-batches
    assert "the experts' all-to-all" in ep and "the experts' all-to-all" not in fsdp and "FSDP2's copies" in fsdp
    for row in rows:
        assert row["of_one"] == pytest.approx(step / 2 / row["step_s"]) and row["of_one"] < 1
    # the one GPU's tokens per expert: rank 0's half of the experts busier, the busiest rank waited for
    experts = tiny.model.num_experts
    loads = [[3] * (experts // 2) + [1] * (experts // 2)] * 2
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    record = {"kind": "bench", "benchmark": "gpt_oss_20b", "preset": "tiny", "figures": "measured", "ranks": 1,
              "device": "NVIDIA H200", "router": {"loads": loads}}  # fmt: skip
    (bench_dir / "bench.json").write_text(json.dumps(record))
    assert forecast_layouts.read_loads(bench_dir) == loads
    [busy] = forecast_layouts.forecasts(
        "gpt_oss_20b",
        "tiny",
        {"data.global_batch_size": str(gbs)},
        [{"distributed.ep": "2"}],
        2,
        (1, 2),
        (0.3, 0.5),
        2e12,
        "GPU",
        loads,
    )
    assert busy["split_s"]["the router's busiest rank"] > 0 and busy["of_one"] < rows[0]["of_one"]
    (bench_dir / "bench.json").write_text(json.dumps(record | {"router": {"loads": [[1, -1]]}}))
    from trainbench.errors import UserError

    with pytest.raises(UserError, match="holds no router.loads"):
        forecast_layouts.read_loads(bench_dir)
    with pytest.raises(UserError, match="fewer than the depth"):
        forecast_layouts.forecasts("gpt_oss_20b", "tiny", {}, [{}], 2, (1, 3), (0.3, 0.5), None, "GPU", loads)
    with pytest.raises(UserError, match="two different depths"):
        forecast_layouts.forecasts("gpt_oss_20b", "tiny", {}, [{}], 2, (2, 2), (0.3, 0.5), None)
    with pytest.raises(UserError, match="two numbers split by a comma"):
        forecast_layouts._pair("2;4", int, "--depths")
    refused = [(["nosuch"], "error: unknown benchmark 'nosuch'"),
               (["gpt_oss_20b", "--preset", "tiny", "--layout", "distributed.ep=3"], "error: distributed.ep=3"),
               (["gpt_oss_20b", "--layout", "distributed.ep"], "'distributed.ep' is not of the form key=value"),
               (["gpt_oss_20b", "--loads", str(tmp_path / "none")], "cannot be read (no such file)"),
               (["gpt_oss_20b", "--loads", str(bench_dir)], "holds no router.loads")]  # fmt: skip
    for args, said in refused:  # one sentence on stderr, exit 2, nothing on stdout
        monkeypatch.setattr(sys, "argv", ["forecast_layouts.py", *args, "--depths", "1,2", "--steps", "1,2"])
        with pytest.raises(SystemExit) as stopped:
            forecast_layouts.main()
        printed = capsys.readouterr()
        assert stopped.value.code == 2 and not printed.out, printed
        assert printed.err.startswith("error: ") and printed.err.count("\n") == 1 and said in printed.err, printed


def test_probe_modes_probes_each_way_in_turn_and_plans_from_each_probe(monkeypatch, capsys):
    """perf/probe_modes.py: for each round a probe synced, then one streamed (measure/probe.measure stood in for: it
    needs a GPU), each planned by the benchmark's own planner from that probe's figures alone: slower blocks, a lower
    predicted rate; its keys taken after its options; with --blocks and --copies-gib, each probe built with that
    many blocks and stepping beside copies where asked, the probe's own again after."""
    from test_layout import P70, probe_data

    from trainbench.families.planner import GIB
    from trainbench.measure import probe

    modes = load("probe_modes")
    asked, stepper = [], probe._stepper

    def measure(cfg, bench, streamed=True):
        asked.append((streamed, cfg.perf.probe_sustained_s, cfg.model.num_layers, probe.probe_blocks(cfg),
                      probe._stepper is not stepper))  # fmt: skip
        slower = 1.1 if streamed else 1.0
        return probe_data(P70, "NVIDIA H200", int(139 * GIB), int(140 * GIB), 480 * GIB,
                          forward_s=P70.forward_s * slower, backward_s=P70.backward_s * slower, power_w=690.0,
                          sm_clock_mhz=1515.0 - 15 * streamed, blocks=probe.probe_blocks(cfg))  # fmt: skip

    monkeypatch.setattr(probe, "measure", measure)
    assert modes.main(["llama2_70b_lora", "--preset", "llama2-70b", "--rounds", "2", "--blocks", "2",
                       "perf.probe_sustained_s=20"]) == 0  # fmt: skip
    # the run's config (measure cuts it to the probe's blocks), held as asked, the probe's own blocks, no copies
    assert asked == [(False, 20.0, 80, 2, False), (True, 20.0, 80, 2, False)] * 2
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("round")]
    ways = [f"round {r}, {mode}, 2 blocks" for r in (0, 1) for mode in ("synced", "streamed")]
    assert [line.split(":")[0] for line in said] == ways, said
    assert "forward 13.20 ms, backward 30.80 ms" in said[1] and "at 1,500 MHz, 690 W" in said[1], said
    rates = [int(line.split("(")[1].split(" tokens/s")[0].replace(",", "")) for line in out.splitlines()
             if "predicted:" in line]  # fmt: skip
    assert len(rates) == 4 and rates[0] == rates[2] > rates[1] == rates[3], rates
    asked.clear()
    assert modes.main(["llama2_70b_lora", "--preset", "llama2-70b", "--rounds", "1", "--modes", "streamed",
                       "--blocks", "2,8", "--copies-gib", "0,1.5"]) == 0  # fmt: skip
    assert [a[3:] for a in asked] == [(2, False), (2, True), (8, False), (8, True)]
    assert "round 0, streamed, 8 blocks, 1.5 GiB a block copied each way:" in capsys.readouterr().out
    assert probe._stepper is stepper
    for bad in (["--rounds", "0"], ["--blocks", "1"], ["--modes", "fast"], ["--copies-gib", "x"]):
        assert modes.main(["llama2_70b_lora", *bad]) == 2
        assert capsys.readouterr().err.startswith("error: "), bad
