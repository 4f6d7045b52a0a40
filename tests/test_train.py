"""Whole runs through the CLI: reaching the target, the MLPerf log, multi-rank equivalence, bad input."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import only_run_dir, read_metrics, run_cli

from trainbench.mlperf import check_compliance

QUICK = ["progress=false", "eval_samples=256", "eval.every_samples=320", "schedule.max_samples=640"]


def log_events(path):
    return [json.loads(line.split(":::MLLOG", 1)[1]) for line in path.read_text().splitlines() if ":::MLLOG" in line]


def test_tiny_preset_reaches_target_with_a_compliant_log(converged):
    run_dir = converged  # `run bert --preset tiny` to its target (the session's shared run)
    out = (run_dir.parent / "stdout.txt").read_text()
    assert "time to train (minutes):" in out and str(run_dir) in out

    log = run_dir / "result_0.txt"
    assert log.exists() and not (run_dir / "result_0.txt.partial").exists()
    result = check_compliance(log, "5.0.0")
    assert result.passed, result.output
    assert "SUCCESS" in result.output

    events = log_events(log)
    keys = [e["key"] for e in events]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1
    by_key = {e["key"]: e for e in events}
    assert by_key["run_stop"]["metadata"]["status"] == "success"
    assert by_key["global_batch_size"]["value"] == 64 and by_key["gradient_accumulation_steps"]["value"] == 1
    assert by_key["submission_benchmark"]["value"] == "bert"
    accuracies = [e for e in events if e["key"] == "eval_accuracy"]
    assert accuracies[-1]["value"] >= 0.72 and all("epoch_num" in e["metadata"] for e in accuracies)
    assert accuracies[0]["value"] < 0.5, "the first eval should show an untrained model: learning really happens"

    outcome = json.loads((run_dir / "run_0.json").read_text())
    assert outcome["status"] == "success" and outcome["time_to_train_min"] > 0
    run_start = next(e for e in events if e["key"] == "run_start")["time_ms"]
    run_stop = next(e for e in events if e["key"] == "run_stop")["time_ms"]
    assert outcome["time_to_train_min"] == pytest.approx((run_stop - run_start) / 60_000)
    rows = read_metrics(run_dir)
    assert {"step", "samples", "loss", "lr", "samples_per_s"} <= set(rows[0])
    assert any("masked_lm_accuracy" in r for r in rows)
    assert (run_dir / "config.yaml").exists() and "run 0: success" in (run_dir / "console.log").read_text()
    assert run_cli("check", run_dir) == 0
    assert run_cli("check", log) == 0  # a single log: the ruleset comes from its submission_benchmark


def _losses(results):
    rows = read_metrics(only_run_dir(results))
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.full
def test_two_ranks_give_the_loss_curve_of_one_rank(small_data, tmp_path):
    common = [
        "run",
        "bert",
        "--preset",
        "tiny",
        f"data.dir={small_data}",
        "log_every_steps=1",
        "optimizer.lr=5e-3",
        *QUICK,
    ]
    run_cli(*common, f"output.results_dir={tmp_path / 'one'}", "micro_batch_size=64")
    run_cli(*common, f"output.results_dir={tmp_path / 'accum'}", "micro_batch_size=16")
    run_cli(*common, f"output.results_dir={tmp_path / 'two'}", "micro_batch_size=32", "--nproc", "2")
    one, accum, two = (_losses(tmp_path / n) for n in ("one", "accum", "two"))
    assert len(one) == 10 and len(two) == 10 and len(accum) == 10
    assert one[0] > one[-1], "the loss should fall over 10 steps"
    assert max(abs(a - b) for a, b in zip(one, two, strict=False)) <= 1e-5, (one, two)
    assert max(abs(a - b) for a, b in zip(one, accum, strict=False)) <= 1e-5, (one, accum)
    log = only_run_dir(tmp_path / "two") / "result_0.txt"
    events = {e["key"]: e for e in log_events(log)}
    assert events["global_batch_size"]["value"] == 64 and events["run_stop"]["metadata"]["status"] == "aborted"


@pytest.mark.full
def test_nexp_runs_k_seeds_into_one_folder(small_data, tmp_path):
    code = run_cli(
        "run",
        "bert",
        "--preset",
        "tiny",
        f"data.dir={small_data}",
        f"output.results_dir={tmp_path}",
        "--nexp",
        "2",
        "seed=100",
        *QUICK,
    )
    assert code == 1, "the runs stop at max_samples before the target: status aborted, exit code 1"
    run_dir = only_run_dir(tmp_path)
    seeds = [json.loads((run_dir / f"run_{i}.json").read_text())["seed"] for i in range(2)]
    assert seeds == [100, 101]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["status"] for r in summary["runs"]] == ["aborted", "aborted"]
    assert all(r["compliance"]["passed"] is False for r in summary["runs"]), "accuracy never reached 0.720"


def test_missing_data_dir_names_the_prepare_command(tmp_path, capsys):
    code = run_cli(
        "run", "bert", "--preset", "tiny", f"data.dir={tmp_path / 'nowhere'}", f"output.results_dir={tmp_path}"
    )
    out = capsys.readouterr().out
    assert code == 2
    assert "does not exist" in out and "trainbench prepare bert --synthetic" in out
    assert "Traceback" not in out
    assert not any(tmp_path.glob("*/config.yaml")), "nothing is created for a run that cannot start"


def test_broken_shard_names_file_and_key(small_data, tmp_path, capsys):
    import shutil

    import h5py

    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    shard = sorted((data / "train").iterdir())[1]
    with h5py.File(shard, "a") as f:
        del f["next_sentence_labels"]
    code = run_cli("run", "bert", f"data.dir={data}", f"output.results_dir={tmp_path}")
    out = capsys.readouterr().out
    assert code == 2 and shard.name in out and "'next_sentence_labels' is missing" in out


def test_more_eval_samples_than_the_data_holds(small_data, tmp_path, capsys):
    assert run_cli("run", "bert", f"data.dir={small_data}", f"output.results_dir={tmp_path}") == 2
    assert "data.eval_samples=2000 but the eval files" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_unknown_config_key_on_the_command_line(capsys):
    assert run_cli("run", "bert", "optimizer.learning_rate=1") == 2
    out = capsys.readouterr().out
    assert "unknown config key 'optimizer.learning_rate'" in out and "valid keys:" in out


def test_nproc_larger_than_the_machine(small_data, capsys):
    assert (
        run_cli(
            "run", "bert", f"data.dir={small_data}", "--nproc", "4096", "global_batch_size=4096", "micro_batch_size=1"
        )
        == 2
    )
    out = capsys.readouterr().out
    assert "--nproc 4096 asks for 4096 processes but this machine has" in out


def test_nan_loss_stops_the_run_with_a_clear_message(small_data, tmp_path, capsys):
    code = run_cli(
        "run",
        "bert",
        f"data.dir={small_data}",
        f"output.results_dir={tmp_path}",
        "optimizer.lr=1e30",
        "max_grad_norm=0",
        "log_every_steps=1",
        *QUICK,
    )
    out = capsys.readouterr().out
    assert code == 2
    assert "loss became NaN or infinite" in out and "lower optimizer.lr" in out
    run_dir = only_run_dir(tmp_path)
    stop = [e for e in log_events(run_dir / "result_0.txt") if e["key"] == "run_stop"]
    assert stop[0]["metadata"]["status"] == "aborted"
    assert json.loads((run_dir / "run_0.json").read_text())["status"] == "aborted"


def test_killed_run_is_never_left_looking_finished(small_data, tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainbench",
            "run",
            "bert",
            f"data.dir={small_data}",
            f"output.results_dir={tmp_path}",
            "progress=false",
            "log_every_steps=1",
            "schedule.max_samples=100000",
            "eval_samples=256",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            metrics = list(tmp_path.glob("*/metrics.jsonl"))
            if metrics and metrics[0].read_text().count("\n") >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the run produced no metrics within 120 s")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    run_dir = only_run_dir(tmp_path)
    assert (run_dir / "result_0.txt.partial").exists()
    assert not (run_dir / "result_0.txt").exists() and not (run_dir / "run_0.json").exists()
    assert not (run_dir / "summary.json").exists()
    assert run_cli("check", run_dir) == 2  # "holds no finished MLPerf log"


@pytest.mark.parametrize("command", [[], ["list"], ["prepare"], ["run"], ["submit"], ["convert"], ["check"]])
def test_every_subcommand_has_help(command):
    proc = subprocess.run([sys.executable, "-m", "trainbench", *command, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: trainbench" in proc.stdout


def _machine(monkeypatch, cores: int, online: int, load: float) -> None:
    """This process pinned to ``cores`` of a machine of ``online`` cores whose 1-minute load average is ``load``."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: online)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0), raising=False)


@pytest.mark.parametrize(
    ("cores", "online", "load", "ranks", "threads"),
    [
        (8, 8, 0.1, 1, 8),  # an idle machine: every core
        (8, 8, 0.0, 2, 4),  # shared by the ranks
        (8, 8, 3.2, 2, 2),  # 3 cores busy: 5 free, 2 each
        (2, 2, 1.6, 1, 1),  # the 2-core machine with another job on it
        (2, 2, 9.0, 4, 1),  # busier than it has cores: still one thread
        (4, 64, 32.0, 1, 2),  # 4 cores of a 64-core host half busy: its load counted for this share only
    ],
)
def test_cpu_threads_are_the_free_cores_shared_out(monkeypatch, cores, online, load, ranks, threads):
    from trainbench.distributed import cpu_threads

    _machine(monkeypatch, cores, online, load)
    chosen, why = cpu_threads(ranks, {})
    assert chosen == threads
    assert f"of this process's {cores} cores free" in why and f"load average of {load:.2f}" in why


@pytest.mark.parametrize("given", ["1", "3", "16"])
def test_omp_num_threads_wins_over_the_free_cores(monkeypatch, given):
    from trainbench.distributed import cpu_threads
    from trainbench.launch.local import torchrun_worker

    _machine(monkeypatch, 8, 8, 6.0)  # 2 free: not what OMP_NUM_THREADS says
    assert cpu_threads(2, {"OMP_NUM_THREADS": given}) == (int(given), f"OMP_NUM_THREADS={given} as set")
    monkeypatch.setenv("OMP_NUM_THREADS", given)
    _, env = torchrun_worker(2, "folder", "0")
    assert env["OMP_NUM_THREADS"] == given


@pytest.mark.parametrize("given", ["0", "four", "2,1"])
def test_an_omp_num_threads_that_is_no_positive_number_is_said_to_be_ignored(monkeypatch, given):
    from trainbench.distributed import cpu_threads

    _machine(monkeypatch, 4, 4, 0.0)
    chosen, why = cpu_threads(1, {"OMP_NUM_THREADS": given})
    assert chosen == 4 and f"OMP_NUM_THREADS={given!r} is not a positive number: ignored" in why


def test_torchrun_ranks_get_the_free_cores_and_why(monkeypatch):
    from trainbench.distributed import THREADS_WHY, cpu_threads
    from trainbench.launch.local import torchrun_worker

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _machine(monkeypatch, 8, 8, 2.0)
    _, env = torchrun_worker(3, "folder", "0")
    assert env["OMP_NUM_THREADS"] == "2"  # 6 free over 3 ranks (torchrun would otherwise set 1)
    assert cpu_threads(3, env) == (2, env[THREADS_WHY]) and "6 of this process's 8 cores free" in env[THREADS_WHY]


def test_a_cpu_rank_takes_omp_num_threads_and_its_header_says_so(monkeypatch, converged):
    import torch

    from trainbench.distributed import init_distributed

    before, given = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")  # as the shared run had it
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        info = init_distributed("cpu", "auto")
        assert torch.get_num_threads() == 1
        assert info.threads_note == "1 CPU thread(s) a rank: OMP_NUM_THREADS=1 as set"
    finally:
        torch.set_num_threads(before)
    header = (converged / "console.log").read_text().split("eval at")[0]  # the lines before the first eval
    why = (rf"OMP_NUM_THREADS={given} as set" if given and given.isdigit() and int(given) > 0
           else r"\d+ of this process's \d+ cores free")  # fmt: skip
    assert re.search(rf"run 0: \d+ CPU thread\(s\) a rank: {why}", header), header


@pytest.mark.parametrize(
    "command",
    [["--help"], ["run", "--help"], ["submit", "--help"], ["bench", "--help"], ["prepare", "bert", "--help"], ["list"]],
)
def test_help_and_list_import_no_torch(command):
    # Importing torch takes seconds; the benchmarks' names, presets and options need none of it.
    code = ("import sys\nfrom trainbench.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True)
    assert "usage: trainbench" in proc.stdout or "llama2_70b_lora" in proc.stdout, proc.stdout
    assert proc.stderr.strip().endswith("no torch"), proc.stderr


def test_help_config_lists_every_key_with_type_and_meaning(capsys):
    assert run_cli("run", "bert", "--preset", "large", "--help-config") == 0
    out = capsys.readouterr().out
    assert "optimizer.lr (float) = 0.00096" in out and "model.init_checkpoint (str or None) = None" in out
    assert "MLPerf `opt_base_learning_rate`" in out


def test_list_shows_bert_presets(capsys):
    assert run_cli("list") == 0
    out = capsys.readouterr().out
    assert "bert" in out and "tiny, base, large" in out


def test_prepare_is_idempotent_and_refuses_to_mix(tmp_path, capsys):
    out = tmp_path / "d"
    args = [
        "prepare",
        "bert",
        "--synthetic",
        "--out",
        out,
        "--train-samples",
        "200",
        "--eval-samples",
        "40",
        "--shards",
        "2",
    ]
    assert run_cli(*args) == 0
    assert run_cli(*args) == 0 and "nothing to do" in capsys.readouterr().out
    assert run_cli(*args[:-1], "3") == 2 and "different data set" in capsys.readouterr().out
    assert run_cli("prepare", "bert", "--out", out) == 2 and "--synthetic" in capsys.readouterr().out


def _over_one_rank(check) -> None:
    """``check()`` inside a CPU process group of one rank (FSDP2 needs one), torn down after it: the worker's other
    tests run with no process group."""
    import torch
    import torch.distributed as dist

    from trainbench.distributed import single_rank_group

    assert not dist.is_initialized()
    single_rank_group(torch.device("cpu"))
    try:
        check()
    finally:
        dist.destroy_process_group()


def test_fsdp2_reduces_once_a_step_the_gradients_it_kept_whole_over_the_micro_batches():
    """distributed.reduce_once_a_step's context (Placed.no_sync for FSDP2): around the micro-batches before the
    last, FSDP2 keeps the weights gathered and their whole gradients unreduced (no shard of a gradient made); the
    last micro-batch's backward reduces the sum of all of them at once: the gradients of reducing each micro-batch,
    within fp32's rounding of the sums' order. Over a process group of one (the reduce-scatter a copy); over two
    ranks the runs' losses (tests/test_llm.py, tests/test_flux.py)."""
    _over_one_rank(_fsdp2_reduced_once_a_step)


def _fsdp2_reduced_once_a_step() -> None:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from trainbench.distributed import fsdp_reduce_once_a_step, reduce_once_a_step

    torch.manual_seed(0)
    xs = [torch.randn(4, 8) for _ in range(4)]

    def model() -> torch.nn.Module:
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        for layer in (m[0], m[2]):
            fully_shard(layer)
        fully_shard(m)
        return m

    each, once = model(), model()
    for m, no_sync in ((each, None), (once, fsdp_reduce_once_a_step(once))):
        for i, x in enumerate(xs):
            last = i == len(xs) - 1
            with contextlib.nullcontext() if last or no_sync is None else no_sync():
                m(x).square().sum().backward()
            # Reduced: the sharded parameters (DTensors) hold their gradient's shard. Deferred: the parameters stay
            # gathered (plain tensors), their whole gradients accumulating.
            gathered = not last and no_sync is not None
            assert all(isinstance(p, DTensor) != gathered for p in m.parameters()), (i, no_sync)
    for a, b in zip(each.parameters(), once.parameters(), strict=True):
        assert b.grad is not None and torch.allclose(a.grad.full_tensor(), b.grad.full_tensor(), rtol=1e-6, atol=1e-6)
    _applies_to_fsdp2_alone(reduce_once_a_step, once, "once a step")


def _applies_to_fsdp2_alone(apply, sharded_model, says: str) -> None:
    """``apply`` (a key's setting of Placed.no_sync) gives a model FSDP2 placed a no_sync of its own and says
    ``says``; a model without FSDP2 keeps the null one, and the console says it has no FSDP2."""
    import torch

    from trainbench.distributed import Placed

    placed = Placed(module=sharded_model, model=sharded_model)
    apply(placed)
    assert placed.no_sync is not contextlib.nullcontext and says in placed.notes[0]
    plain = Placed(module=torch.nn.Linear(2, 2), model=None)
    apply(plain)
    assert plain.no_sync is contextlib.nullcontext and "no FSDP2" in plain.notes[0]


def test_fsdp2_keeps_the_blocks_gathered_through_the_micro_batches_and_reduces_each():
    """distributed.keep_gathered's context (Placed.no_sync for FSDP2): around the micro-batches before the last, the
    blocks that reshard after their forward keep their weights gathered through the forward, the backward and into
    the next micro-batch; the last micro-batch reshards after its forward and after its backward, as without the key.
    Each micro-batch's gradients are still reduced: the same gradients as without the key, bit for bit. Over both
    keys, the gradients of reducing once a step. Over a process group of one; over two ranks the runs' losses
    (tests/test_llm.py)."""
    _over_one_rank(_fsdp2_kept_gathered)


def _fsdp2_kept_gathered() -> None:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from trainbench.distributed import (
        RESHARDED_AFTER_FORWARD,
        fsdp_keep_gathered,
        fsdp_reduce_once_a_step,
        keep_gathered,
    )

    torch.manual_seed(0)
    xs = [torch.randn(4, 8) for _ in range(4)]

    def model() -> torch.nn.Module:
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        fully_shard(m[0], reshard_after_forward=True)  # as the placements shard every block but the last
        RESHARDED_AFTER_FORWARD.add(m[0])
        fully_shard(m[2], reshard_after_forward=False)
        fully_shard(m)
        return m

    def sharded(layer: torch.nn.Module) -> bool:
        return all(isinstance(p, DTensor) for p in layer.parameters())

    each, kept, both = model(), model(), model()
    ways = ((each, None), (kept, fsdp_keep_gathered(kept, contextlib.nullcontext)),
            (both, fsdp_keep_gathered(both, fsdp_reduce_once_a_step(both))))  # fmt: skip
    for m, no_sync in ways:
        for i, x in enumerate(xs):
            last = i == len(xs) - 1
            within = not last and no_sync is not None
            with contextlib.nullcontext() if not within else no_sync():
                loss = m(x).square().sum()
                assert sharded(m[0]) != within, (i, no_sync)  # the first block: resharded after forward, or kept
                loss.backward()
            # After a backward: every block kept gathered within the context, every one resharded after it.
            assert all(isinstance(p, DTensor) != within for p in m.parameters()), (i, no_sync)
    for name, m in (("kept", kept), ("both", both)):
        for a, b in zip(each.parameters(), m.parameters(), strict=True):
            if name == "kept":
                assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), name
            else:
                assert torch.allclose(a.grad.full_tensor(), b.grad.full_tensor(), rtol=1e-6, atol=1e-6), name
    _applies_to_fsdp2_alone(keep_gathered, kept, "keeps the blocks' weights gathered")


def test_fsdp2_keeps_the_layers_outside_the_blocks_gathered_between_micro_batches_and_reduces_each():
    """distributed.keep_outer_gathered's context (Placed.no_sync of a decoder sharded by FSDP2): around the
    micro-batches before the last, the root's own weights (a decoder's embedding and final norm) and the output
    layer's, sharded apart, stay gathered after the backward, while the blocks reshard as without the key; the last
    micro-batch reshards them all before the optimizer's update. Each micro-batch's gradients are still reduced: the
    same gradients as without the key, bit for bit. Over a process group of one; over two ranks the runs' losses
    (tests/test_llm.py)."""
    _over_one_rank(_fsdp2_outer_kept_gathered)


def _fsdp2_outer_kept_gathered() -> None:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from trainbench.distributed import Placed
    from trainbench.families.decoder.placement import keep_outer_gathered

    torch.manual_seed(0)
    xs = [torch.randn(4, 8) for _ in range(4)]

    class Tiny(torch.nn.Module):  # a decoder's units: the root's embedding, two blocks, the output layer
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.embed = torch.nn.Linear(8, 16)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
            self.lm_head = torch.nn.Linear(16, 8)

        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = torch.nn.functional.gelu(block(x))
            return self.lm_head(x)

    def model(apart: bool) -> Tiny:
        m = Tiny()
        fully_shard(m.blocks[0], reshard_after_forward=True)  # as the placements shard every block but the last
        fully_shard(m.blocks[1], reshard_after_forward=False)
        if apart:
            fully_shard(m.lm_head, reshard_after_forward=False)
        fully_shard(m)
        return m

    def sharded(*modules: torch.nn.Module) -> list[bool]:
        return [isinstance(p, DTensor) for m in modules for p in m.parameters()]

    each, kept, together = model(True), model(True), model(False)
    placements = {}
    for name, m, apart in (("kept", kept, True), ("together", together, False)):
        placements[name] = Placed(module=m, model=m)
        keep_outer_gathered(placements[name], apart)
    for m, no_sync in ((each, None), (kept, placements["kept"].no_sync), (together, placements["together"].no_sync)):
        for i, x in enumerate(xs):
            last = i == len(xs) - 1
            within = not last and no_sync is not None
            with contextlib.nullcontext() if not within else no_sync():
                m(x).square().sum().backward()
            # After a backward: the blocks resharded; the embedding and the output layer kept gathered within the
            # context, resharded after it (and without it).
            assert all(sharded(*m.blocks)), (i, no_sync)
            assert sharded(m.embed, m.lm_head) == [not within] * 4, (i, no_sync)
    for other in (kept, together):
        for a, b in zip(each.parameters(), other.parameters(), strict=True):
            assert isinstance(b.grad, DTensor) and torch.equal(a.grad.full_tensor(), b.grad.full_tensor())
    for placed in placements.values():
        assert placed.notes == [
            "FSDP2 gathers the embedding, the final norm and the output layer once a step and keeps "
            "them gathered between its micro-batches (distributed.keep_outer_gathered)"
        ]
