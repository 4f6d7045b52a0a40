import dataclasses

import pytest

from trainbench.benchmarks import BENCHMARKS
from trainbench.cli import main as cli_main
from trainbench.config import apply_overrides, parse_key_values, read_yaml_overrides, save_config
from trainbench.errors import ConfigError
from trainbench.resolve import build_config, load_run_config


def test_large_preset_is_the_mlperf_reference_shape():
    _, cfg = build_config("bert", "large")
    m, d = cfg.model, cfg.data
    assert (m.num_layers, m.hidden_size, m.num_heads, m.intermediate_size, m.vocab_size) == (24, 1024, 16, 4096, 30522)
    assert (d.seq_length, d.max_predictions, d.eval_samples) == (512, 76, 10000)
    assert cfg.eval.target == 0.72


def test_dotted_and_leaf_keys_with_type_conversion():
    _, cfg = build_config(
        "bert",
        "tiny",
        overrides={"optimizer.lr": "2e-3", "warmup_steps": "7", "progress": "false", "eval_samples": "none"},
    )
    assert cfg.optimizer.lr == 2e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.schedule.warmup_steps == 7
    assert cfg.output.progress is False
    assert cfg.data.eval_samples is None


def test_unknown_key_names_the_valid_keys():
    with pytest.raises(ConfigError) as exc:
        build_config("bert", "tiny", overrides={"optimizer.lrr": "1"})
    msg = str(exc.value)
    assert "unknown config key 'optimizer.lrr'" in msg
    assert "did you mean 'optimizer.lr'" in msg
    assert "model.hidden_size" in msg and "data.global_batch_size" in msg


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("model.num_layers", "two", "expects int"),
        ("model.num_layers", "2.5", "expects int"),
        ("optimizer.lr", "fast", "expects float"),
        ("progress", "maybe", "expects bool"),
        ("device", "tpu", "must be one of auto, cpu, cuda"),
    ],
)
def test_wrong_type_is_one_clear_error(key, value, expected):
    with pytest.raises(ConfigError, match=expected):
        build_config("bert", "tiny", overrides={key: value})


def test_ambiguous_leaf_key():
    @dataclasses.dataclass
    class A:
        size: int = 1

    @dataclasses.dataclass
    class Both:
        a: A = dataclasses.field(default_factory=A)
        b: A = dataclasses.field(default_factory=A)

    with pytest.raises(ConfigError, match="ambiguous; write one of: a.size, b.size"):
        apply_overrides(Both(), {"size": "2"})
    both = Both()
    assert apply_overrides(both, {"b.size": "2"}) == ["b.size"] and both.b.size == 2


def test_yaml_file_nested_and_dotted(tmp_path):
    path = tmp_path / "o.yaml"
    path.write_text("optimizer:\n  lr: 1e-3\n  beta1: 0.8\ndata.global_batch_size: 128\n")
    _, cfg = build_config("bert", "tiny", yaml_files=[str(path)])
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.beta1 == 0.8 and cfg.data.global_batch_size == 128
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        read_yaml_overrides(bad)


def test_saved_config_loads_back_identical(tmp_path):
    _, cfg = build_config("bert", "base", overrides={"lr": "3e-4", "data.dir": "some dir/with space"})
    save_config(cfg, tmp_path / "config.yaml")
    _, again = load_run_config(tmp_path / "config.yaml")
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_a_saved_config_whose_keys_without_effect_held_another_default_loads_with_the_presets_values(tmp_path):
    """A config.yaml saved when a key without effect in its run had another default (as if perf.probe_sustained_s
    had been 5 then: the run planned nothing) loads: that key at the preset's value, the rest as saved. A key that
    takes effect is still the saved one, and is still checked."""
    _, cfg = build_config("llama31_8b", "tiny", overrides={"optimizer.lr": "3e-4"})
    saved = dataclasses.replace(cfg, perf=dataclasses.replace(cfg.perf, probe_sustained_s=5.0, probe_blocks=4))
    save_config(saved, tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match="perf.probe_sustained_s=5.0 has no effect"):  # given as the user's
        build_config("llama31_8b", "tiny", yaml_files=[str(tmp_path / "config.yaml")])
    _, again = load_run_config(tmp_path / "config.yaml")
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg) and again.optimizer.lr == 3e-4
    auto = dataclasses.replace(saved, perf=dataclasses.replace(saved.perf, plan="auto"), device="cuda")
    save_config(auto, tmp_path / "config.yaml")  # planned: the probe's keys took effect, and are kept
    assert load_run_config(tmp_path / "config.yaml")[1].perf.probe_blocks == 4
    save_config(dataclasses.replace(saved, perf=dataclasses.replace(saved.perf, recompute_blocks=5)),
                tmp_path / "config.yaml")  # fmt: skip
    with pytest.raises(ConfigError, match="perf.recompute_blocks=5"):
        load_run_config(tmp_path / "config.yaml")


def test_batch_sizes_must_divide():
    with pytest.raises(ConfigError, match="not a multiple"):
        build_config("bert", "tiny", overrides={"global_batch_size": "64", "micro_batch_size": "48"})
    with pytest.raises(ConfigError, match="not divisible by 3"):
        build_config("bert", "tiny", overrides={"global_batch_size": "64", "distributed.nproc": "3"})


def test_recompute_blocks_needs_checkpointing_and_at_most_the_models_blocks():
    with pytest.raises(ConfigError, match="perf.recompute_blocks=1 needs perf.activation_checkpointing=true"):
        build_config("llama2_70b_lora", "tiny", overrides={"perf.recompute_blocks": "1"})
    with pytest.raises(ConfigError, match="perf.recompute_blocks=3 but the model has 2 blocks"):
        build_config("llama31_8b", "tiny", overrides={"perf.recompute_blocks": "3",
                                                      "perf.activation_checkpointing": "true"})  # fmt: skip
    both = {"perf.recompute_blocks": "56", "perf.activation_checkpointing": "true"}
    _, cfg = build_config("llama2_70b_lora", "llama2-70b", overrides=both)
    assert cfg.perf.recompute_blocks == 56


def test_offload_blocks_only_for_the_fp8_lora_base_on_a_gpu_and_at_most_the_kept_blocks():
    fp8 = {"model.base_precision": "fp8", "device": "cuda"}
    with pytest.raises(ConfigError, match="offloaded only for llama2_70b_lora with model.base_precision=fp8"):
        build_config("llama2_70b_lora", "tiny", overrides={"perf.offload_blocks": "1"})
    with pytest.raises(ConfigError, match="offloaded only for llama2_70b_lora"):
        build_config("llama31_8b", "tiny", overrides={"perf.offload_blocks": "1"})
    with pytest.raises(ConfigError, match="perf.offload_blocks=1 needs a GPU"):
        build_config("llama2_70b_lora", "tiny", overrides=fp8 | {"perf.offload_blocks": "1", "device": "cpu"})
    with pytest.raises(ConfigError, match="perf.offload_blocks=3 but only 2 blocks keep their activations"):
        build_config("llama2_70b_lora", "tiny", overrides=fp8 | {"perf.offload_blocks": "3"})
    every = {"perf.activation_checkpointing": "true"}  # recompute_blocks=0: every block is recomputed
    with pytest.raises(ConfigError, match="perf.offload_blocks=1 but only 0 blocks keep their activations"):
        build_config("llama2_70b_lora", "tiny", overrides=fp8 | every | {"perf.offload_blocks": "1"})
    both = fp8 | every | {"perf.recompute_blocks": "20", "perf.offload_blocks": "30"}
    _, cfg = build_config("llama2_70b_lora", "llama2-70b", overrides=both)
    assert cfg.perf.offload_blocks == 30
    with pytest.raises(ConfigError, match="perf.offload_blocks=61 but only 60 blocks keep"):
        build_config("llama2_70b_lora", "llama2-70b", overrides=both | {"perf.offload_blocks": "61"})


def test_offloaded_blocks_are_spread_over_the_kept_ones():
    from trainbench.families.decoder.offload import spread

    assert spread(30, 60) == list(range(0, 60, 2))
    assert spread(1, 5) == [0] and spread(5, 5) == [0, 1, 2, 3, 4]
    assert spread(3, 10) == [0, 3, 6]
    with pytest.raises(ConfigError, match="perf.offload_blocks=4 but only 3 blocks keep"):
        spread(4, 3)


def test_only_dense_tensors_are_offloaded_as_one_block_of_bytes():
    import torch

    from trainbench.families.decoder.offload import dense

    t = torch.zeros(4, 6, 8)
    assert dense(t) and dense(t.transpose(0, 2)) and dense(t.permute(1, 0, 2)) and dense(t[:1]) and dense(t[1, 2:3])
    assert (
        not dense(t[:, :3]) and not dense(t[0:4, 2:3]) and not dense(t[..., ::2]) and not dense(t[:1].expand(3, 6, 8))
    )


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        parse_key_values(["lr"])


def test_unknown_benchmark_and_preset():
    with pytest.raises(ConfigError, match="available: bert"):
        build_config("resnet", "tiny")
    with pytest.raises(ConfigError, match="presets: tiny, base, large"):
        build_config("bert", "huge")


def test_mlperf_eval_cadence():
    bench, cfg = build_config("bert", "large")
    assert bench.eval_every_samples(cfg) == 150_000  # GBS 768, as in MLPerf's table
    cfg.data.global_batch_size = 8192
    assert bench.eval_every_samples(cfg) == 225_000  # FLOOR(0.05 * (230.23 * 8192 + 3e6), 25000)


def test_packed_attention_kernel_must_run_where_the_run_trains():
    packed = {"data.layout": "packed", "device": "cpu"}
    with pytest.raises(ConfigError, match="packed_attention=varlen runs on CUDA in bf16"):
        build_config("bert", "tiny", overrides=packed | {"model.packed_attention": "varlen"})
    with pytest.raises(ConfigError, match="packed_attention=cudnn runs on CUDA in bf16"):
        build_config("bert", "tiny", overrides=packed | {"model.packed_attention": "cudnn"})
    with pytest.raises(ConfigError, match="packed_attention=flex runs on CUDA"):
        build_config("bert", "tiny", overrides=packed | {"model.packed_attention": "flex"})
    _, cfg = build_config("bert", "tiny", overrides=packed)  # auto picks what runs here
    assert cfg.model.packed_attention == "auto"


# -- keys a benchmark does not use ------------------------------------------------------------------------------


def _other_value(leaf, value):
    """A value of ``leaf``'s type different from ``value``."""
    import typing

    if leaf.choices:
        return next(c for c in leaf.choices if c != value)
    base = next((a for a in typing.get_args(leaf.type) if a is not type(None)), leaf.type)
    if base is bool:
        return not value
    if base is int:
        return (value or 0) + 1
    if base is float:
        return (value or 0.0) * 2 + 1.0
    raise AssertionError(f"no other value for {leaf.key} of type {leaf.type}")


UNUSED = [(b.name, key) for b in BENCHMARKS.values() for key in b.unused_for(b.config("tiny"))]


def test_every_benchmark_declares_keys_it_ignores_and_each_is_a_real_key():
    from trainbench.config import leaves

    assert {"perf.activation_checkpointing", "schedule.end_lr"} <= set(BENCHMARKS["bert"].unused_keys)
    for name in ("gpt3", "llama31_8b"):
        assert {"perf.cuda_graphs", "distributed.bucket_cap_mb", "distributed.overlap_compiled",
                "optimizer.clip"} <= set(BENCHMARKS[name].unused_keys)  # fmt: skip
    # FSDP2 reduce-scatters in bf16 under it; the LoRA's adapters (DDP or FSDP2) always in fp32
    assert "distributed.grad_reduce_dtype" not in BENCHMARKS["llama31_8b"].unused_keys
    assert "distributed.grad_reduce_dtype" in BENCHMARKS["llama2_70b_lora"].unused_keys
    for bench in BENCHMARKS.values():
        assert set(bench.unused_for(bench.config("tiny"))) <= set(leaves(bench.config("tiny"))), bench.name
    # derived from the architecture, not listed by each benchmark
    assert "model.max_seq_length" in BENCHMARKS["llama31_8b"].unused_for(BENCHMARKS["llama31_8b"].config("tiny"))
    assert "model.rope_theta" in BENCHMARKS["gpt3"].unused_for(BENCHMARKS["gpt3"].config("tiny"))
    assert "model.max_seq_length" in BENCHMARKS["llama2_70b_lora"].unused_for(
        BENCHMARKS["llama2_70b_lora"].config("tiny")
    )


@pytest.mark.parametrize("benchmark,key", UNUSED, ids=[f"{b}-{k}" for b, k in UNUSED])
def test_a_key_the_benchmark_does_not_use_is_refused_naming_key_and_benchmark(benchmark, key):
    from trainbench.config import leaves

    leaf = leaves(BENCHMARKS[benchmark].config("tiny"))[key]
    value = _other_value(leaf, getattr(leaf.owner, leaf.field.name))
    with pytest.raises(ConfigError) as err:
        build_config(benchmark, "tiny", overrides={key: str(value)})
    message = str(err.value)
    assert message.startswith(f"{key}=") and f"no effect on {benchmark}" in message and "\n" not in message


def test_the_preset_value_of_an_unused_key_is_accepted_and_a_wrong_optimizer_is_refused(capsys):
    build_config("llama31_8b", "tiny", overrides={"perf.cuda_graphs": "false", "optimizer.clip": "global"})
    build_config("bert", "tiny", overrides={"perf.activation_checkpointing": "false"})
    with pytest.raises(ConfigError, match="optimizer.name=adamw: bert trains with lamb"):
        build_config("bert", "tiny", overrides={"optimizer.name": "adamw"})
    with pytest.raises(ConfigError, match="optimizer.name=adamw: gpt3 trains with adam"):
        build_config("gpt3", "tiny", overrides={"optimizer.name": "adamw"})
    # From the command line: one sentence and exit code 2, before anything runs.
    assert cli_main(["run", "llama2_70b_lora", "distributed.grad_reduce_dtype=bf16"]) == 2
    out = capsys.readouterr().out
    assert "distributed.grad_reduce_dtype=bf16 has no effect on llama2_70b_lora" in out and "Traceback" not in out


def test_fp8_training_is_refused_on_the_cpu_without_torchao_and_for_lora(monkeypatch):
    import importlib.util

    with pytest.raises(ConfigError, match="model.precision=fp8 trains on FP8 tensor cores: it needs an NVIDIA GPU"):
        build_config("llama31_8b", "tiny", overrides={"model.precision": "fp8", "device": "cpu"})
    with pytest.raises(ConfigError, match="model.precision=fp8 has no effect on llama2_70b_lora"):
        build_config("llama2_70b_lora", "tiny", overrides={"model.precision": "fp8"})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(
        ConfigError,
        match=r"torchao's float8 training, which is not installed: pip install -e '\.\[fp8\]' in trainbench's clone",
    ):
        build_config("gpt3", "tiny", overrides={"model.precision": "fp8", "device": "cuda"})


def test_fp8_placement_refuses_a_device_without_fp8_tensor_cores(monkeypatch):
    import torch

    from trainbench.families import fp8

    with pytest.raises(ConfigError, match="needs an NVIDIA GPU, not the cpu"):
        fp8.min_capability(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"compute capability 8.9 or newer.*NVIDIA A100-SXM4-80GB has 8.0"):
        fp8.min_capability(torch.device("cuda", 0))
    # the experts' FP8 grouped products need Hopper: an Ada GPU (8.9) trains a decoder in FP8, not a mixture of experts
    from trainbench.families.decoder.moe import MoE, MoEShape
    from trainbench.families.decoder.moe_fp8 import experts_in_fp8, in_fp8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA L40S")
    fp8.min_capability(torch.device("cuda", 0))
    assert experts_in_fp8(torch.nn.Linear(4, 4), torch.device("cuda", 0)) == 0  # no experts, nothing to check
    moe = torch.nn.Sequential(MoE(MoEShape(hidden=16, ffn=16, experts=2, top_k=1)))
    with pytest.raises(ConfigError, match=r"the experts' FP8 grouped products \(compute capability 9.0 or newer: "
                                          r"Hopper, Blackwell\); NVIDIA L40S has 8.9"):  # fmt: skip
        experts_in_fp8(moe, torch.device("cuda", 0))
    assert not in_fp8(moe[0]) and moe[0].align_rows == 1


def test_fp8_training_swaps_only_the_blocks_linear_layers_keeping_their_names():
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    import torch

    from trainbench.families import fp8
    from trainbench.families.decoder.model import DecoderLM

    _, cfg = build_config("llama31_8b", "tiny")
    with torch.device("meta"):
        model = DecoderLM(cfg.model)
    names = [n for n, _ in model.named_parameters()]
    swapped = fp8.train_blocks_in_fp8(model)
    assert swapped == 7 * cfg.model.num_layers  # q, k, v, o, gate, up, down
    assert [n for n, _ in model.named_parameters()] == names
    assert type(model.lm_head).__name__ == "Linear"
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Float8Linear"


def test_the_output_layer_in_fp8_is_refused_in_one_sentence_where_it_cannot_be_honoured():
    fp8 = {"model.precision": "fp8", "device": "cuda", "model.output_precision": "fp8"}
    _, cfg = build_config("gpt_oss_20b", "tiny", overrides=fp8)
    assert cfg.model.output_precision == "fp8"
    with pytest.raises(ConfigError, match=r"^model.output_precision=fp8 needs model.precision=fp8 .*precision=auto$"):
        build_config("llama31_8b", "tiny", overrides={"model.output_precision": "fp8"})
    with pytest.raises(ConfigError, match="needs model.tie_embeddings=false"):
        build_config("llama31_8b", "tiny", overrides=fp8 | {"model.tie_embeddings": "true"})
    with pytest.raises(ConfigError, match=r"multiples of 16 .*; model.vocab_size=30522$"):
        build_config("llama31_8b", "tiny", overrides=fp8 | {"model.vocab_size": "30522"})
    with pytest.raises(ConfigError, match=r"keeps the output layer with the embedding under FSDP2 .*: set "
                       r"distributed.output_layer_apart=false$"):  # fmt: skip
        build_config(
            "llama31_8b", "tiny", overrides=fp8 | {"distributed.nproc": "2", "distributed.output_layer_apart": "true"}
        )
    assert "model.output_precision" in BENCHMARKS["llama2_70b_lora"].unused_for(
        build_config("llama2_70b_lora", "tiny")[1]
    )


def test_tied_embeddings_on_several_ranks_are_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(ConfigError, match="model.tie_embeddings=true runs on one rank only.*this run has 2 ranks"):
        build_config("llama31_8b", "tiny", overrides={"model.tie_embeddings": "true", "distributed.nproc": "2"})
    build_config("llama31_8b", "tiny", overrides={"model.tie_embeddings": "true"})  # one rank: fine


def test_the_8b_preset_has_one_qkv_proj_and_tensor_parallelism_then_asks_for_separate_projections():
    _, cfg = build_config("llama31_8b", "llama31-8b")
    assert cfg.model.fused_qkv  # one FP8 cast of the attention's input instead of three
    with pytest.raises(ConfigError, match="model.fused_qkv=true .*set distributed.tp=1, or model.fused_qkv=false"):
        build_config("llama31_8b", "llama31-8b", overrides={"distributed.nproc": "2", "distributed.tp": "2"})
    _, tp = build_config("llama31_8b", "llama31-8b", overrides={"distributed.nproc": "2", "distributed.tp": "2",
                                                                "model.fused_qkv": "false"})  # fmt: skip
    assert not tp.model.fused_qkv and tp.distributed.tp == 2
    assert not build_config("llama31_8b", "tiny")[1].model.fused_qkv  # the tiny preset's layout is unchanged


def test_no_two_benchmarks_claim_one_mlperf_name_unless_both_declare_it():
    from trainbench.benchmarks import register
    from trainbench.benchmarks.llm import Llama31Benchmark

    names = [b.mlperf_name for b in BENCHMARKS.values()]
    for bench in BENCHMARKS.values():
        for other in BENCHMARKS.values():
            if other is not bench and other.mlperf_name == bench.mlperf_name:
                assert other.name in bench.shares_mlperf_name and bench.name in other.shares_mlperf_name
    assert len(set(names)) == len(names)

    class Copy(Llama31Benchmark):
        name = "llama31_8b_copy"

    with pytest.raises(ConfigError, match="logs submission_benchmark 'llama31_8b', which llama31_8b logs too"):
        register(Copy())
    assert "llama31_8b_copy" not in BENCHMARKS


def test_an_mlperf_name_the_ruleset_does_not_know_is_refused_before_training(tmp_path, capsys):
    from trainbench.benchmarks import register, unregister
    from trainbench.benchmarks.llm import Llama31Benchmark

    class Misnamed(Llama31Benchmark):
        name, mlperf_name = "misnamed_lm", "gpt2_tiny_lm"

    register(Misnamed())
    try:
        code = cli_main(["run", "misnamed_lm", "--preset", "tiny", f"output.results_dir={tmp_path / 'r'}"])
        out = capsys.readouterr().out
        assert (
            code == 2
            and "logs submission_benchmark 'gpt2_tiny_lm', which mlperf-logging's ruleset 6.1.0 does not know" in out
            and "mlperf = False" in out
        ), out
        assert not (tmp_path / "r").exists()
    finally:
        unregister("misnamed_lm")


def test_a_renamed_key_still_works_under_its_old_name_with_a_one_line_notice(capsys):
    """perf.layout became perf.plan: the old name sets the new key (on the command line, in YAML and in a saved
    config.yaml alike, all through apply_overrides) and says so once; an unknown key is still refused."""
    from trainbench import config
    from trainbench.resolve import build_config

    config._noticed.discard("perf.layout")
    _, cfg = build_config("llama2_70b_lora", "tiny", overrides={"perf.layout": "manual"})
    _, again = build_config("llama2_70b_lora", "tiny", overrides={"perf.layout": "manual"})
    assert cfg.perf.plan == again.perf.plan == "manual"
    said = capsys.readouterr().out
    assert said.count("config key 'perf.layout' is now 'perf.plan'") == 1, said
    with pytest.raises(ConfigError, match="unknown config key 'perf.layoutt'"):
        build_config("llama2_70b_lora", "tiny", overrides={"perf.layoutt": "auto"})
