"""The decoder family: Llama and GPT-3 (:class:`DecoderFamily`), GPT-OSS and the reference's mixture of experts
(:class:`GptOssFamily`), and LoRA on a frozen decoder (:class:`LoraFamily`).

Each builds its model on the meta device, places it (FSDP2, tensor or expert parallelism, compiled blocks, FP8,
recomputation and host offload: :mod:`.placement`, :mod:`.lora_placement`), checks the shapes and speed paths a config
asks for, plans its layout for a machine (``perf.plan=auto``, from :mod:`trainbench.families.planner`'s arithmetic)
and tells `trainbench bench` how to cut and count it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainbench.config import RunConfig
from trainbench.errors import ConfigError
from trainbench.families.base import ModelFamily
from trainbench.families.configs import DecoderConfig

if TYPE_CHECKING:
    import torch

    from trainbench.distributed import DistInfo, Placed

# The most rows a micro-batch llama31_8b's perf.plan=auto chooses: two rows of 8,192 tokens measured faster a token
# than one (the compiled elementwise kernels, half the gradient accumulations; docs/llm.md, "Blocks recomputed, chosen
# by the tool"), more not measured. Chosen only where they fit with no more blocks recomputed: a recomputed block costs
# more than that.
PLANNED_ROWS = 2


def output_layer_in_fp8(cfg: RunConfig) -> None:
    """ConfigError, one sentence, where ``model.output_precision=fp8`` cannot be honoured: without the blocks in FP8,
    with the output layer tied to the embedding, or with a vocabulary or width FP8's products cannot take."""
    m = cfg.model
    if m.precision != "fp8":
        raise ConfigError(f"model.output_precision=fp8 needs model.precision=fp8 (the blocks in FP8 too); this run "
                          f"has model.precision={m.precision}")  # fmt: skip
    if m.tie_embeddings:
        raise ConfigError("model.output_precision=fp8 needs model.tie_embeddings=false: its FP8 output layer is "
                          "built for a weight of its own, not one the embedding shares")  # fmt: skip
    odd = [f"model.{k}={v}" for k, v in (("vocab_size", m.vocab_size), ("hidden_size", m.hidden_size)) if v % 16]
    if odd:
        raise ConfigError(f"model.output_precision=fp8 needs a vocabulary and width that are multiples of 16 (FP8 "
                          f"tensor cores); {' and '.join(odd)}")  # fmt: skip
    if cfg.distributed.output_layer_apart:
        raise ConfigError("model.output_precision=fp8 keeps the output layer with the embedding under FSDP2 (its own "
                          "function reads the layer's weight without calling the layer): set "
                          "distributed.output_layer_apart=false")  # fmt: skip


def decoder_flops_per_token(model: DecoderConfig, seq: int) -> float:
    """Forward and backward FLOPs per token of a decoder trained in full: 6 x the parameters in matrix products (the
    output layer's included) plus the causal attention's QK^T and AV (half the positions on average) x 3."""
    matmul_params = model.num_params(embeddings=False) + model.vocab_size * model.hidden_size
    attention = 2 * 2 * model.num_layers * model.hidden_size * seq / 2
    return 6 * matmul_params + 3 * attention


class DecoderFamily(ModelFamily):
    """Llama- or GPT-3-shaped decoders (``model.arch``), trained in full: FSDP2 over the ranks (on one rank too with
    ``distributed.shard_one_rank``), tensor parallelism within a node, compiled blocks, FP8 blocks and output layer,
    recomputation of some or all blocks; ``plans_layout``: whether ``perf.plan=auto`` plans its blocks recomputed
    and rows a micro-batch for a machine."""

    name = "decoder"
    hf_twin = "trainbench.families.decoder.hf"
    shards_one_rank = True
    ARCH_UNUSED = {
        "llama": {"model.max_seq_length": "the llama architecture has rotary positions"},
        "gpt3": {"model.rope_theta": "the gpt3 architecture has learned positions"},
    }

    def __init__(self, plans_layout: bool = False):
        self.plans_layout = plans_layout

    def unused_for(self, cfg: RunConfig) -> dict[str, str]:
        """The keys of the architecture ``model.arch`` does not have (llama: max_seq_length, gpt3: rope_theta)."""
        return super().unused_for(cfg) | self.ARCH_UNUSED.get(cfg.model.arch, {})

    def validate(self, cfg: RunConfig) -> None:
        from trainbench.families import fp8
        from trainbench.families.decoder.placement import FUSED_QKV_TP

        m, d = cfg.model, cfg.data
        if m.hidden_size % m.num_heads or m.num_heads % m.kv_heads:
            raise ConfigError(f"model: hidden_size {m.hidden_size}, heads {m.num_heads}, kv heads {m.kv_heads} "
                              "must divide evenly")  # fmt: skip
        if m.arch == "gpt3" and d.seq_length > m.max_seq_length:
            raise ConfigError(f"data.seq_length={d.seq_length} exceeds model.max_seq_length={m.max_seq_length}")
        if m.tie_embeddings and cfg.distributed.world_size > 1:
            raise ConfigError(f"model.tie_embeddings=true runs on one rank only (sharding would untie the weights); "
                              f"this run has {cfg.distributed.world_size} ranks")  # fmt: skip
        if m.fused_qkv and cfg.distributed.tp > 1:
            raise ConfigError(FUSED_QKV_TP)
        if cfg.distributed.nproc % cfg.distributed.tp:
            raise ConfigError(f"distributed.tp={cfg.distributed.tp} does not divide --nproc {cfg.distributed.nproc}")
        if cfg.perf.recompute_blocks and not cfg.perf.activation_checkpointing:
            raise ConfigError(f"perf.recompute_blocks={cfg.perf.recompute_blocks} needs "
                              "perf.activation_checkpointing=true")  # fmt: skip
        if cfg.perf.recompute_blocks > m.num_layers:
            raise ConfigError(f"perf.recompute_blocks={cfg.perf.recompute_blocks} but the model has {m.num_layers} "
                              "blocks")  # fmt: skip
        if m.precision == "fp8":
            fp8.require(cfg.device)
        if m.output_precision == "fp8":
            output_layer_in_fp8(cfg)
        offloads = self._offloads(cfg)
        if offloads and not self.offloads_activations(cfg):
            raise ConfigError(f"{offloads[0]}: activations are offloaded only for llama2_70b_lora with "
                              "model.base_precision=fp8 (whole blocks on each GPU, compiled inside their "
                              "checkpointing)")  # fmt: skip

    @staticmethod
    def _offloads(cfg: RunConfig) -> list[str]:
        offloads = [f"perf.offload_blocks={cfg.perf.offload_blocks}"] if cfg.perf.offload_blocks else []
        return offloads + (["perf.offload_recomputed_inputs=true"] if cfg.perf.offload_recomputed_inputs else [])

    def offloads_activations(self, cfg: RunConfig) -> bool:
        """Whether this config may keep blocks' saved activations in host memory (``perf.offload_blocks``): only a
        frozen FP8 base's whole blocks (:class:`LoraFamily`)."""
        return False

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        import torch

        from trainbench.families.decoder.model import DecoderLM

        with torch.device("meta"):
            return DecoderLM(cfg.model)

    def place(self, model: torch.nn.Module, cfg: RunConfig, info: DistInfo, bf16: bool) -> Placed:
        from trainbench.families.decoder.placement import place_decoder

        return place_decoder(model, cfg.model, info, cfg.distributed.tp, bf16, cfg.perf, cfg.seed,
                             cfg.distributed.ep, cfg.distributed.shard_one_rank,
                             cfg.distributed.grad_reduce_dtype == "bf16",
                             cfg.distributed.keep_outer_gathered, cfg.distributed.output_layer_apart)  # fmt: skip

    def data_rank(self, cfg: RunConfig, info: DistInfo) -> tuple[int, int]:
        tp = cfg.distributed.tp
        return info.rank // tp, info.world_size // tp

    def flops_per_sample(self, cfg: RunConfig) -> float | None:
        return decoder_flops_per_token(cfg.model, cfg.data.seq_length) * cfg.data.seq_length

    def plan_layout(self, cfg: RunConfig, preset: RunConfig, resources, probe) -> tuple[dict[str, Any], list[str]]:
        """``perf.plan=auto``: the fewest blocks recomputed (the last ones) with which the model fits each GPU,
        FSDP2 sharding its parameters, gradients and optimizer state over the ranks (planner.sharded, from a probe of
        two unsharded blocks on one GPU); nothing offloaded unless given. Then the rows a micro-batch: up to
        :data:`PLANNED_ROWS` where they fit with no more blocks recomputed (a micro-batch other than the preset's is
        kept as given). ConfigError, one sentence, where even every block recomputed does not fit."""
        from trainbench.families.planner import (
            MARGIN,
            NODE_COLLECTIVE_BYTES_S,
            best,
            describe,
            fixed_keys,
            gib,
            sharded,
            with_rows,
        )

        if not self.plans_layout:
            return super().plan_layout(cfg, preset, resources, probe)
        if cfg.distributed.tp > 1:
            raise ConfigError(f"perf.plan=auto plans FSDP2 over all the ranks; with distributed.tp="
                              f"{cfg.distributed.tp} set the layout keys by hand (perf.plan=manual)")  # fmt: skip
        given = fixed_keys(cfg, preset)
        layers, name = cfg.model.num_layers, f"{cfg.benchmark}/{cfg.preset}"
        fixed = {"perf.offload_blocks": 0, "perf.offload_recomputed_inputs": False} | given
        once, per_rank = cfg.distributed.reduce_once_a_step, cfg.data.global_batch_size // resources.gpus
        reduce_bytes = 2 if cfg.distributed.grad_reduce_dtype == "bf16" else 4
        # distributed.keep_gathered: the blocks' weights as gathered (FP8 a byte, bf16 two: a GPU's plan is bf16)
        gathered_as = 1 if cfg.model.precision == "fp8" else 2  # FP8 blocks are gathered in FP8 (families/fp8.py)
        gather_bytes = gathered_as if cfg.distributed.keep_gathered else 0
        outer_kept, head_apart = cfg.distributed.keep_outer_gathered, cfg.distributed.output_layer_apart

        def planned(gathered: int):
            """(rows a micro-batch, the fastest plan at them or None, the smallest plan) with the blocks' weights
            kept gathered at ``gathered`` bytes a parameter (0: not kept)."""

            def shards(p, rows: int):
                return sharded(p, resources.gpus, once, reduce_bytes, per_rank // rows, gathered, gathered_as,
                               outer_kept, head_apart)  # fmt: skip

            fastest, smallest = best(layers, shards(probe, cfg.data.micro_batch_size), resources, fixed)
            rows = probed = cfg.data.micro_batch_size
            if fastest is not None and rows == preset.data.micro_batch_size:
                for more in range(PLANNED_ROWS, rows, -1):
                    if more % probed or per_rank % more:
                        continue
                    plan, _ = best(layers, shards(with_rows(probe, more // probed), more), resources, fixed)
                    if plan is not None and plan.recompute <= fastest.recompute and plan.offload <= fastest.offload:
                        return more, plan, smallest
            return rows, fastest, smallest

        rows, fastest, smallest = planned(gather_bytes)
        probed = cfg.data.micro_batch_size
        if fastest is None:
            need, held = smallest.gpu_bytes / (1 - MARGIN), smallest.account
            raise ConfigError(
                f"{name} does not fit {resources.gpus} x {resources.gpu_name} of {gib(resources.gpu_bytes)}: even "
                f"with every block recomputed it needs {gib(need)} a GPU (weights {gib(held['weights'])}, gradients "
                f"and optimizer state {gib(held['gradients and optimizer state'])}); use more GPUs (--nproc N) or "
                "larger ones"
            )
        keys = fastest.keys() | ({"data.micro_batch_size": rows} if rows != cfg.data.micro_batch_size else {})
        lines = describe(fastest, layers, resources, given, rows * cfg.data.seq_length)
        lines[0] += f"; micro-batches of {rows} row{'s' if rows > 1 else ''}"
        if rows != probed:
            lines.append(f"  rows: {rows} a micro-batch, the most up to {PLANNED_ROWS} that fit with no more blocks "
                         f"recomputed (the prediction counts a row's time as at {probed}; measured faster a token: "
                         "docs/llm.md)")  # fmt: skip
        if resources.gpus > 1:
            lines[0] += f"; FSDP2 over the {resources.gpus} ranks"
            gathers = "gathers once a step (kept between micro-batches)" if outer_kept else "gathers each micro-batch"
            reduced = ("the embedding's reduce-scatter each micro-batch (the output layer's runs beside the blocks')"
                       if head_apart else "their reduce-scatters each micro-batch")  # fmt: skip
            outer = f"the embedding's and output layer's {gathers} and {reduced}"
            lines.append(f"  communication: {outer}, which no block's compute hides, at "
                         f"{NODE_COLLECTIVE_BYTES_S / 1e9:.0f} GB/s (one node's NVLink under compute); the blocks' own "
                         "overlap their neighbours' compute and are not counted")  # fmt: skip
        else:
            lines[0] += "; the whole model on the GPU"
        if gather_bytes:
            lines += self._kept_gathered_cost(planned(0), rows, fastest, cfg.data.seq_length)
        return keys, lines

    def node_costs(self, cfg: RunConfig, ranks: int, one) -> dict[str, float] | str:
        """FSDP2 over every rank (families/node_costs.fully_sharded), with the layout keys the placement reads."""
        from trainbench.families.node_costs import fully_sharded, micro_batches

        if cfg.distributed.tp > 1:
            return (
                f"distributed.tp={cfg.distributed.tp}: the forecast models FSDP2 over every rank, not tensor "
                "parallelism"
            )
        return fully_sharded(one, ranks, micro_batches(cfg, ranks), **self._sharding(cfg))

    @staticmethod
    def _sharding(cfg: RunConfig) -> dict[str, Any]:
        """fully_sharded's keywords for ``cfg``'s FSDP2 keys (FP8 blocks are gathered in FP8: families/fp8.py)."""
        from trainbench.families.node_costs import reduce_bytes

        d = cfg.distributed
        return {"reduce_bytes": reduce_bytes(d),
                "gathered_as": 1 if cfg.model.precision == "fp8" else 2, "reduce_once_a_step": d.reduce_once_a_step,
                "keep_gathered": d.keep_gathered, "outer_kept": d.keep_outer_gathered,
                "head_apart": d.output_layer_apart}  # fmt: skip

    @staticmethod
    def _kept_gathered_cost(without, rows: int, plan, seq: int) -> list[str]:
        """A line where distributed.keep_gathered's memory cost the plan rows a micro-batch or blocks recomputed,
        with what the plan without it predicts: on 2 H200 it cost the 8B its second row and measured 3.2 % slower
        (docs/llm.md)."""
        rows_without, plan_without, _ = without
        if plan_without is None or (rows_without <= rows and plan_without.recompute >= plan.recompute):
            return []
        return [f"  distributed.keep_gathered: with the weights kept gathered the plan holds {rows} row"
                f"{'s' if rows > 1 else ''} a micro-batch and {plan.recompute} blocks recomputed; without the key "
                f"{rows_without} and {plan_without.recompute}, predicted "
                f"{rows_without * seq / plan_without.seconds:,.0f} tokens/s a GPU against this plan's "
                f"{rows * seq / plan.seconds:,.0f} (on 2 H200 the key "
                "measured 3.2 % slower so: docs/llm.md)"]  # fmt: skip


class GptOssFamily(DecoderFamily):
    """GPT-OSS's mixture-of-experts decoder and the reference's block (``model.block``): experts spread over the ranks
    by ``distributed.ep`` (all-to-all), sink attention with a sliding window on some blocks, FP8 grouped products of
    the experts. No layout plan: its experts' memory and all-to-all are not in the planner's model."""

    has_experts = True

    def __init__(self):
        super().__init__(plans_layout=False)

    def validate(self, cfg: RunConfig) -> None:
        super().validate(cfg)
        m = cfg.model
        if m.experts_per_token > m.num_experts:
            raise ConfigError(f"model.experts_per_token={m.experts_per_token} exceeds model.num_experts="
                              f"{m.num_experts}: a token cannot go to more experts than there are")  # fmt: skip
        if m.arch != "llama":
            raise ConfigError(f"model.arch={m.arch}: gpt_oss_20b's blocks are Llama-shaped (RMSNorm, rotary positions)")
        ep, ranks = cfg.distributed.ep, cfg.distributed.world_size
        if ep > 1 and (m.num_experts % ep or ep != ranks):
            raise ConfigError(f"distributed.ep={ep} must divide the {m.num_experts} experts and equal the run's "
                              f"{ranks} ranks (expert parallelism spans all of them)")  # fmt: skip
        every = cfg.distributed.expert_rebalance_every
        if every and (ep <= 1 or ranks <= 1):
            raise ConfigError(f"distributed.expert_rebalance_every={every} places the experts that "
                              "distributed.ep spreads over the ranks: set distributed.ep to the run's ranks (more "
                              "than one), or leave it at 0")  # fmt: skip
        wire = cfg.distributed.expert_exchange
        if wire == "fp8" and (m.precision != "fp8" or m.expert_weight_grad != "fp8" or ep <= 1 or ranks <= 1):
            raise ConfigError("distributed.expert_exchange=fp8 sends the rows of expert parallelism's all-to-all as "
                              "FP8's grouped products cast them: it needs model.precision=fp8, "
                              "model.expert_weight_grad=fp8 (a bf16 weight gradient would read the rows rounded to "
                              "FP8) and distributed.ep set to the run's ranks (more than one)")  # fmt: skip
        if cfg.distributed.expert_row_casts == "kernel" and (m.precision != "fp8" or ep <= 1 or ranks <= 1):
            raise ConfigError("distributed.expert_row_casts=kernel casts the rows of the experts' FP8 products under "
                              "expert parallelism: it needs model.precision=fp8 and distributed.ep set to the run's "
                              "ranks (more than one)")  # fmt: skip
        scores = cfg.data.micro_batch_size * m.num_heads * cfg.data.seq_length**2 * 4
        if m.gpt_oss_block and not cfg.perf.compile and scores > 4 << 30:
            raise ConfigError(f"model.block=gpt_oss at seq {cfg.data.seq_length} needs perf.compile=true: uncompiled, "
                              f"its sink attention holds every score ({scores / 2**30:.0f} GiB a micro-batch); "
                              "compiled on a GPU it runs through FlexAttention")  # fmt: skip
        fused = [f"model.{key}={kernel}" for key, kernel in (("attention", m.attention),
                 ("window_attention", m.window_attention)) if kernel in ("flash", "cudnn")]  # fmt: skip
        if fused and (not cfg.perf.compile or cfg.device == "cpu" or cfg.precision == "fp32"):
            raise ConfigError(f"{fused[0]} is a GPU kernel of the compiled blocks in 16 bits: it needs "
                              "perf.compile=true, a GPU (device=cuda or auto) and precision=auto or bf16; "
                              "leave the key at its default elsewhere")  # fmt: skip
        if cfg.distributed.tp > 1:
            raise ConfigError(f"distributed.tp={cfg.distributed.tp}: gpt_oss_20b has no tensor-parallel plan (its "
                              "experts are stacked tensors); use more data-parallel ranks")  # fmt: skip

    def block_period(self, cfg: RunConfig) -> tuple[int, str]:
        m = cfg.model
        if m.sliding_window > 0 and m.window_every > 1:
            whole = m.window_every - 1
            return m.window_every, f"a windowed block, then {whole} over the whole prefix: model.window_every"
        return 1, ""

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        import torch

        from trainbench.families.decoder.gpt_oss import GptOssLM

        with torch.device("meta"):
            return GptOssLM(cfg.model)

    def place(self, model: torch.nn.Module, cfg: RunConfig, info: DistInfo, bf16: bool) -> Placed:
        import torch

        from trainbench.families.decoder.gpt_oss import auto_kernel

        placed = super().place(model, cfg, info, bf16)
        m = cfg.model
        ep = cfg.distributed.ep if info.world_size > 1 else 1
        spread = f"; {m.num_experts // ep} experts on each of {ep} ranks (all-to-all)" if ep > 1 else ""
        kernels = ""
        if cfg.perf.compile and info.device.type == "cuda":  # the compiled blocks' fused attention (model.attention)
            causal = m.attention if m.attention != "auto" else auto_kernel(info.device, torch.bfloat16 if bf16 else
                                                                           torch.float32)  # fmt: skip
            kernels = f"; attention through {causal} (whole prefix) and {m.window_attention} (window)"
        placed.notes.append(f"{m.block} block: {m.num_experts} experts, {m.experts_per_token} a token; a "
                            f"{m.sliding_window}-token window on every {m.window_every} blocks{spread}"
                            f"{kernels}")  # fmt: skip
        kernel_casts, wire = cfg.distributed.expert_row_casts == "kernel", cfg.distributed.expert_exchange == "fp8"
        if ep > 1 and (kernel_casts or wire):
            from trainbench.families.decoder.moe import MoE
            from trainbench.families.decoder.moe_fp8 import exchange_in_fp8, fp8_products, in_fp8

            for moe in (mod for mod in placed.module.modules() if isinstance(mod, MoE)):
                if kernel_casts and in_fp8(moe):
                    fp8_products(moe, m.expert_weight_grad, "kernel")
                if wire:
                    exchange_in_fp8(moe)
        if ep > 1 and kernel_casts:
            placed.notes.append("the experts' rows cast to e4m3 by one Triton pass a row (distributed.expert_row_casts="
                                "kernel): not yet run over NCCL on several GPUs")  # fmt: skip
        if ep > 1 and wire:
            placed.notes.append("the all-to-all's rows to the experts, and their outputs' gradients, in e4m3 on the "
                                "wire (distributed.expert_exchange=fp8): not yet run over NCCL on several "
                                "GPUs")  # fmt: skip
        every = cfg.distributed.expert_rebalance_every
        if ep > 1 and every:
            from trainbench.families.decoder.expert_placement import ExpertPlacer

            placed.rearrange = ExpertPlacer(placed.module, every).rearrange
            placed.notes.append(f"each block's experts dealt out over the {ep} ranks again every {every} steps by "
                                "the tokens each took (distributed.expert_rebalance_every): not yet run over NCCL "
                                "on several GPUs")  # fmt: skip
        return placed

    def one_gpu_rates(self, cfg: RunConfig, device) -> dict[str, float]:
        """In FP8 on CUDA: the casts that expert parallelism adds outside the compiled blocks, a block and
        micro-batch, at this shape's rows (moe_fp8.expert_parallel_cast_seconds), for :meth:`node_costs`: the FP8
        wire's, and the row casts only where the blocks are compiled (uncompiled, :meth:`node_costs` charges none, and
        timing them would compile them for nothing)."""
        m = cfg.model
        if m.precision != "fp8" or device.type != "cuda":
            return {}
        import torch

        from trainbench.families.decoder.moe_fp8 import expert_parallel_cast_seconds

        rows = cfg.data.micro_batch_size * cfg.data.seq_length * m.experts_per_token
        try:
            found = expert_parallel_cast_seconds(rows, m.hidden_size, m.intermediate_size, device,
                                                 row_casts=cfg.perf.compile)  # fmt: skip
        except torch.OutOfMemoryError:
            return {}
        finally:
            torch.cuda.empty_cache()
        return {f"expert_casts_{k}": v for k, v in found.items()}

    def expert_params(self, model: torch.nn.Module) -> int:
        """The experts' weights and biases of every block's mixture (the router is not an expert's)."""
        from trainbench.families.decoder.moe import MoE

        return sum(p.numel() for m in model.modules() if isinstance(m, MoE)
                   for name, p in m.named_parameters(recurse=False) if p.requires_grad)  # fmt: skip

    def node_costs(self, cfg: RunConfig, ranks: int, one) -> dict[str, float] | str:
        """With the experts spread over the ranks (``distributed.ep``): FSDP2 over the rest of the blocks and the
        layers outside them, the experts' all-to-all (families/node_costs.all_to_all_s, in bf16 or with two of its
        four in FP8), in FP8 the row casts it makes outside the compiled blocks (where the one GPU timed them:
        :meth:`one_gpu_rates`) and the wait for the rank whose experts the router sent the most tokens (where the one
        GPU counted them); without, FSDP2 over everything (in FP8: :meth:`_sharded_fp8_experts`)."""
        from trainbench.families.node_costs import all_to_all_s, busiest_rank_s, fully_sharded, micro_batches

        d, m = cfg.distributed, cfg.model
        if d.ep <= 1 and (m.precision != "fp8" or not one.expert_params or d.tp > 1):
            return super().node_costs(cfg, ranks, one)  # the experts sharded and gathered as the rest
        micro, keys = micro_batches(cfg, ranks), self._sharding(cfg)
        out = fully_sharded(one, ranks, micro, params=one.block_params - one.expert_params, **keys)  # but the experts
        if d.ep <= 1:
            return self._sharded_fp8_experts(out, one, ranks, micro, keys)
        rows = cfg.data.micro_batch_size * cfg.data.seq_length
        exchange = all_to_all_s(rows, m.hidden_size, m.experts_per_token, m.num_layers, ranks,
                                fp8_halves=d.expert_exchange == "fp8") * micro  # fmt: skip
        out |= {"the experts' all-to-all": exchange}
        rates = one.family_rates or {}
        # The row casts run outside the compiled blocks: the one GPU's, fused into them, taken as free. Uncompiled,
        # the one GPU's step holds them too, each eager: none is charged (the kernel's, faster, taken as the same).
        casts = rates.get(f"expert_casts_{d.expert_row_casts}_s") if cfg.perf.compile else 0.0
        wire = rates.get("expert_casts_wire_s") if d.expert_exchange == "fp8" else 0.0
        if casts is not None and wire is not None and casts + wire > 0:
            out["the experts' row casts"] = (casts + wire) * m.num_layers * micro
        if one.expert_loads and len(one.expert_loads) == m.num_layers:
            experts_s = one.step_s * micro / one.micro_batches * self.experts_share(cfg)
            from trainbench.families.decoder.expert_placement import balanced

            deal = balanced if d.expert_rebalance_every else None  # (the one GPU's loads, dealt as the run deals them)
            out["the router's busiest rank"] = busiest_rank_s(one.expert_loads, ranks, experts_s, deal)
        return out

    @staticmethod
    def _sharded_fp8_experts(out: dict[str, float], one, ranks: int, micro: int,
                             keys: dict[str, Any]) -> dict[str, float]:  # fmt: skip
        """FSDP2 over every parameter in FP8: to ``out`` (the costs of all but the experts, their linear layers
        gathered in FP8) the experts', gathered in bf16 (FSDP2's copies of 2 bytes a parameter) and cast to FP8 in
        each micro-batch's forward and again for its backward (moe_fp8's casts, uncached when sharded), where the one
        GPU cast them once a step."""
        from trainbench.families.node_costs import fully_sharded, weight_casts_s

        experts = fully_sharded(dataclasses.replace(one, other_params=0), ranks, micro, params=one.expert_params,
                                **(keys | {"gathered_as": 2}))  # fmt: skip
        if one.device_copy_bytes_s:
            out["FSDP2's copies"] += experts["FSDP2's copies"]
            # each micro-batch's casts, less the one GPU's once a step that its step scaled to these micro-batches holds
            casts = micro - micro / one.micro_batches
            out["the experts' FP8 casts"] = weight_casts_s(one.expert_params, casts, one.device_copy_bytes_s)
        return out

    def experts_share(self, cfg: RunConfig) -> float:
        """The experts' share of a step's FLOPs (:meth:`flops_per_sample`'s count): each token's top-k experts, three
        products of hidden x expert width each, in every block."""
        m = cfg.model
        experts = 6 * m.experts_per_token * 3 * m.hidden_size * m.intermediate_size * m.num_layers
        return experts * cfg.data.seq_length / self.flops_per_sample(cfg)

    def flops_per_sample(self, cfg: RunConfig) -> float | None:
        """6 x the parameters a token passes through in matrix products (its top-k experts, the output layer) plus
        the attention's QK^T and AV x 3: half the positions on average in full blocks, the window in windowed ones."""
        m, seq = cfg.model, cfg.data.seq_length
        matmul = m.num_params(embeddings=False, active=True) + m.vocab_size * m.hidden_size
        width = m.num_heads * m.head_dim
        keys = [min(m.sliding_window, seq) if m.windowed(i) else seq / 2 for i in range(m.num_layers)]
        return (6 * matmul + 3 * 2 * 2 * width * sum(keys)) * seq


class LoraFamily(DecoderFamily):
    """LoRA adapters on a frozen decoder read from HF safetensors: the base replicated on each GPU or sharded by
    FSDP2 (``model.base_sharding``), in bf16 or FP8 (``model.base_precision``), some blocks recomputed and some
    blocks' activations in host memory, planned for a machine by ``perf.plan=auto``. ``base_weights``: the base's
    folder for a config (the recipe knows where its data set names it); ``full_shape``: the model NVIDIA's FLOP count
    is given for, and ``full_flops`` that count for a row of ``full_seq`` tokens."""

    shards_one_rank = False  # its frozen base has a sharding of its own: model.base_sharding

    def __init__(self, base_weights: Callable[[RunConfig], str | None], full_shape: DecoderConfig, full_seq: int,
                 full_flops: float):  # fmt: skip
        super().__init__(plans_layout=True)
        self.base_weights = base_weights
        self.full_shape, self.full_seq, self.full_flops = full_shape, full_seq, full_flops

    def offloads_activations(self, cfg: RunConfig) -> bool:
        # (under perf.plan=auto the plan sets the FP8 base before the run starts)
        return cfg.model.base_precision == "fp8" or cfg.perf.plan == "auto"

    def validate(self, cfg: RunConfig) -> None:
        import torch
        from torch import nn

        from trainbench.families.decoder.model import DecoderLM

        super().validate(cfg)
        m = cfg.model
        offloads = self._offloads(cfg)
        if offloads:
            if cfg.device == "cpu":
                raise ConfigError(f"{offloads[0]} needs a GPU (device=cuda or auto)")
            if m.base_sharding == "fsdp":
                raise ConfigError(f"{offloads[0]} needs model.base_sharding=replicate: a sharded block's gathered "
                                  "weights are freed after its forward, which the copies would race")  # fmt: skip
            if cfg.perf.offload_recomputed_inputs and not cfg.perf.activation_checkpointing:
                raise ConfigError("perf.offload_recomputed_inputs=true but no block is recomputed "
                                  "(perf.activation_checkpointing=false)")  # fmt: skip
            from trainbench.families.decoder.memory import kept_blocks

            kept = kept_blocks(cfg.perf, m.num_layers)
            if cfg.perf.offload_blocks > kept:
                raise ConfigError(
                    f"perf.offload_blocks={cfg.perf.offload_blocks} but only {kept} "
                    f"blocks keep their activations (perf.recompute_blocks="
                    f"{cfg.perf.recompute_blocks} of {m.num_layers}, 0 meaning all, with "
                    f"perf.activation_checkpointing={str(cfg.perf.activation_checkpointing).lower()})"
                )
        if not m.targets:
            raise ConfigError("model.lora_targets names no layer; MLPerf's are qkv_proj,o_proj")
        with torch.device("meta"):
            linears = {n.rsplit(".", 1)[-1] for n, mod in DecoderLM(m).named_modules() if isinstance(mod, nn.Linear)}
        unknown = [t for t in m.targets if t not in linears]
        if unknown:
            raise ConfigError(
                f"model.lora_targets names '{unknown[0]}', which is not a linear layer of this model; its linear "
                f"layers are {', '.join(sorted(linears))} (MLPerf adapts qkv_proj,o_proj)"
            )

    def place(self, model: torch.nn.Module, cfg: RunConfig, info: DistInfo, bf16: bool) -> Placed:
        from trainbench.families.decoder.lora_placement import place_lora

        m = dataclasses.replace(cfg.model, base_weights=self.base_weights(cfg))
        placed = place_lora(model, m, info, cfg.distributed.tp, bf16, cfg.perf, cfg.seed)
        if m.base_weights is None:
            placed.notes.append("the base initialised from the seed, no checkpoint read: its losses are not a "
                                "convergence result")  # fmt: skip
        return placed

    def flops_per_sample(self, cfg: RunConfig) -> float | None:
        """NVIDIA's count for a row of the full model (forward and backward of the frozen base and the adapters,
        recompute excluded), per block for fewer; None for another width, vocabulary or row length."""
        m, full = cfg.model, self.full_shape
        if (m.hidden_size, m.intermediate_size, m.vocab_size, cfg.data.seq_length) != (
                full.hidden_size, full.intermediate_size, full.vocab_size, self.full_seq):  # fmt: skip
            return None
        return self.full_flops * m.num_layers / full.num_layers

    def model_notes(self, cfg: RunConfig, device: torch.device, bf16: bool) -> list[str]:
        """Which base was read, the type its files store and what the run made of it."""
        from trainbench.families.decoder.hf_checkpoint import FLOAT_TYPES, HFCheckpoint

        folder = self.base_weights(cfg)
        if folder is None:
            return [f"base weights: random, from seed {cfg.seed} (a throughput measurement)"]
        with HFCheckpoint(folder) as ckpt:
            stored = sorted({FLOAT_TYPES.get(ckpt.dtype(n), ckpt.dtype(n)) for n in ckpt.where})
        if cfg.model.base_precision == "fp8":
            made = "quantised to FP8 (e4m3, a scale per output channel) block by block"
        else:
            target = "bfloat16" if bf16 and device.type == "cuda" else "float32"
            made = f"used as {target}" + ("" if stored == [target] else " (" + "; ".join(
                f"{t} {'widened exactly' if _wider(target, t) else 'rounded'} to {target}" for t in stored
                if t != target) + ")")  # fmt: skip
        return [f"base weights: {folder}, stored as {', '.join(stored)}, {made}"]

    # -- layout (perf.plan=auto) --------------------------------------------------------------------------------
    def node_costs(self, cfg: RunConfig, ranks: int, one) -> dict[str, float] | str:
        return ("perf.plan=auto predicts the LoRA's step on several GPUs from its probe (the plan's `predicted` "
                "line): that is its forecast")  # fmt: skip

    def probe_config(self, cfg: RunConfig, preset: RunConfig) -> RunConfig:
        """Probed with the FP8 base, the one a plan picks where the GPU has FP8 (unless the base is given)."""
        from trainbench.families.planner import fixed_keys

        base = cfg.model.base_precision if "model.base_precision" in fixed_keys(cfg, preset) else "fp8"
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, base_precision=base))

    def plan_layout(self, cfg: RunConfig, preset: RunConfig, resources, probe) -> tuple[dict[str, Any], list[str]]:
        """The FP8 base on every GPU with the fastest mix of kept, offloaded and recomputed blocks that fits
        (planner.best); where no FP8 replica fits, the sentence says what would (the bf16 base sharded over GPUs)."""
        from trainbench.families.planner import best, describe, fixed_keys, refusal

        given = fixed_keys(cfg, preset)
        layers = cfg.model.num_layers
        base = given.get("model.base_precision", "fp8" if resources.fp8 else "auto")
        name = f"{cfg.benchmark}/{cfg.preset}"
        if base == "fp8" and not resources.fp8:
            raise ConfigError(f"model.base_precision=fp8 needs FP8 tensor cores (compute capability 8.9 or newer); "
                              f"{resources.gpu_name} has none: use model.base_precision=auto")  # fmt: skip
        if base != "fp8":
            return self._plan_sharded(cfg, resources)
        if given.get("model.base_sharding") == "fsdp":
            return self._plan_fp8_sharded(cfg, resources, probe, "model.base_sharding=fsdp was given")
        fastest, smallest = best(layers, probe, resources, given)
        if fastest is None and resources.gpus > 1 and "perf.offload_blocks" not in given:
            return self._plan_fp8_sharded(cfg, resources, probe, refusal(name, smallest, layers, resources, probe))
        if fastest is None:
            raise ConfigError(refusal(name, smallest, layers, resources, probe))
        tokens = cfg.data.micro_batch_size * cfg.data.seq_length
        return {"model.base_precision": "fp8", **fastest.keys()}, describe(fastest, layers, resources, given, tokens)

    def _plan_fp8_sharded(self, cfg: RunConfig, resources, probe, why_not: str) -> tuple[dict[str, Any], list[str]]:
        """The FP8 base sharded by FSDP2 (gathered in FP8 a block at a time), every block recomputed: where a replica
        per GPU does not fit. Its memory: the base's shards, two gathered blocks, the inputs, one block's working."""
        from trainbench.families.planner import GIB, MARGIN, gib

        layers, world = cfg.model.num_layers, resources.gpus
        weights = layers * probe.block_weight_bytes + probe.other_weight_bytes
        need = (weights / world + 2 * probe.block_weight_bytes + layers * probe.input_bytes + probe.kept_bytes
                + layers * probe.optimizer_bytes_per_block / world + probe.working_bytes)  # fmt: skip
        if need > resources.gpu_bytes * (1 - MARGIN):
            raise ConfigError(f"{why_not}; nor does the FP8 base sharded over {world} GPUs ({gib(need)} a GPU)")
        keys = {"model.base_precision": "fp8", "model.base_sharding": "fsdp", "perf.activation_checkpointing": True,
                "perf.recompute_blocks": 0, "perf.offload_blocks": 0,
                "perf.offload_recomputed_inputs": False}  # fmt: skip
        seconds = probe.head_s + layers * (2 * probe.forward_s + probe.backward_s)
        tokens = cfg.data.micro_batch_size * cfg.data.seq_length
        return keys, [f"layout (perf.plan=auto) for {world} x {resources.gpu_name} of {gib(resources.gpu_bytes)}: "
                      f"no FP8 replica fits beside the activations, so the FP8 base is sharded by FSDP2 over the "
                      f"{world} GPUs (gathered in FP8 a block at a time) and every block is recomputed",
                      f"  predicted: {seconds:.2f} s a micro-batch ({tokens / seconds:,.0f} tokens/s a GPU before "
                      f"the gathers' cost, not modelled), about {need / GIB:.1f} GiB a GPU"]  # fmt: skip

    def _plan_sharded(self, cfg: RunConfig, resources) -> tuple[dict[str, Any], list[str]]:
        """The bf16 base sharded by FSDP2 over the ranks, every block recomputed: where its shards fit."""
        from trainbench.families.planner import GIB, gib

        params = cfg.model.num_params()
        need = 2 * params / resources.gpus + 24 * GIB  # bf16 shards, gathered blocks, inputs, logits
        if need > resources.gpu_bytes:
            gpus = math.ceil(2 * params / max(1, resources.gpu_bytes - 24 * GIB))
            raise ConfigError(f"{cfg.benchmark}/{cfg.preset} with a bf16 base needs about {gib(need)} a GPU on "
                              f"{resources.gpus} x {resources.gpu_name} of {gib(resources.gpu_bytes)}: use at least "
                              f"{gpus} GPUs, or model.base_precision=fp8 on GPUs with FP8")  # fmt: skip
        return {"perf.activation_checkpointing": True, "perf.recompute_blocks": 0}, [
            f"layout (perf.plan=auto): the bf16 base sharded by FSDP2 over {resources.gpus} x "
            f"{resources.gpu_name}, every block recomputed (about {gib(need)} a GPU)"]  # fmt: skip


def _wider(target: str, stored: str) -> bool:
    """Whether every ``stored`` value is exactly a ``target`` value (float16 -> float32, bfloat16 -> float32)."""
    bits = {"bfloat16": (8, 8), "float16": (11, 5), "float32": (24, 8), "float64": (53, 11)}  # mantissa, exponent
    return all(a >= b for a, b in zip(bits[target], bits[stored], strict=True))
