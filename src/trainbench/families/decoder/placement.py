"""Parallelism applied to a :class:`~trainbench.families.decoder.model.DecoderLM` from outside the model.

A 2-d DeviceMesh named ``("dp", "tp")``: tensor parallelism inside each ``tp`` group (DTensor
``parallelize_module``: q/k/v and gate/up column-parallel, o/down row-parallel, so each block needs one
all-reduce after attention and one after the MLP), FSDP2 (``fully_shard``) over ``dp`` with bf16
parameters and fp32 gradient reduction on CUDA, activation checkpointing (``families/decoder/memory.py``) and
``torch.compile`` per block. The order is the one FSDP2 and DTensor expect: TP, then checkpointing and compile, then
FSDP, then materialisation; checkpointing on fewer blocks and host offload (``perf.recompute_blocks``,
``perf.offload_blocks``) last, on the placed model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainbench.config import PerfConfig
from trainbench.distributed import DistInfo, Placed
from trainbench.errors import ConfigError
from trainbench.families.decoder.memory import recompute_all, recompute_and_offload
from trainbench.families.decoder.model import DecoderConfig, DecoderLM, lm_loss

FUSED_QKV_TP = ("model.fused_qkv=true (one qkv_proj) has no tensor-parallel plan: set distributed.tp=1, or "
                "model.fused_qkv=false for separate q/k/v projections")  # fmt: skip

# Models smaller than this are initialised whole on every rank and then sharded, so a run on N ranks
# starts from exactly the weights of a one-rank run; larger ones are initialised shard by shard.
FULL_INIT_MAX_PARAMS = 2_000_000_000

# Inductor options for a compiled block (they concern its Triton kernels only, so the CPU's code is unchanged). A
# block's backward fuses each RMSNorm's backward, a row reduction, with the FP8 cast of the norm's output that the
# weight gradients' GEMMs read transposed; left to Inductor's defaults, that fused kernel writes the transposed
# bytes one at a time. Tiled reductions, and the norm weight's column sums in a kernel of their own (no mix-order
# reduction), make those writes coalesced: less time a block and micro-batch at the 8B width (the figures:
# docs/notes/llm.md, "Inductor's tiling"; docs/llm.md, "FP8 training").
BLOCK_COMPILE_OPTIONS = {"triton.tile_reductions": True, "triton.prefer_nd_tiling": True,
                         "triton.mix_order_reduction": False}  # fmt: skip


def make_mesh(device_type: str, world: int, tp: int) -> DeviceMesh:
    if tp < 1 or world % tp:
        raise ConfigError(f"distributed.tp={tp} does not divide the {world} ranks")
    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def apply_tp(model: DecoderLM, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg = model.cfg
    tp = mesh.size()
    if cfg.fused_qkv:
        raise ConfigError(FUSED_QKV_TP)
    for name, heads in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.kv_heads)):
        if heads % tp:
            raise ConfigError(f"model.{name}={heads} is not divisible by distributed.tp={tp}")
    if cfg.intermediate_size % tp:
        raise ConfigError(f"model.intermediate_size={cfg.intermediate_size} is not divisible by distributed.tp={tp}")
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    if cfg.arch == "llama":
        plan["mlp.gate_proj"] = ColwiseParallel()
    for block in model.model.layers:
        parallelize_module(block, mesh, plan)


BF16_REDUCE_NOTE = (
    "FSDP2 reduce-scatters the gradients in bf16 (distributed.grad_reduce_dtype=bf16), each rank's "
    "shard added to its fp32 gradient"
)


def sharded_comm_precision(world: int, bf16: bool, fp8: bool = False, reduce_bf16: bool = False) -> str:
    """What :func:`apply_fsdp`'s collectives carry at the lowest: the blocks' FP8 weights gathered in FP8 under
    ``fp8``, bf16 parameters gathered under ``bf16`` or gradients reduced in bf16 under ``reduce_bf16``; fp32
    otherwise and on one rank."""
    if world == 1:
        return "fp32"
    return "fp8" if fp8 else "bfloat16" if bf16 or reduce_bf16 else "fp32"


def apply_expert_parallel(model: DecoderLM, device_type: str, ep: int, world: int) -> set[nn.Parameter]:
    """Every mixture of experts' stacked expert tensors cut by expert over the ``ep`` ranks (all of them: a 1-d mesh
    ``("ep",)``), as DTensors sharded on dim 0, on the meta device; returns them, for FSDP to leave alone. Tokens
    then travel to their experts' ranks by all-to-all (:meth:`MoE._experts_parallel`)."""
    from torch.distributed.tensor import DTensor, Shard

    from trainbench.families.decoder.moe import MoE

    if ep != world:
        raise ConfigError(f"distributed.ep={ep}: expert parallelism spans all {world} ranks of the run (or none)")
    mesh = init_device_mesh(device_type, (ep,), mesh_dim_names=("ep",))
    rank, spread = mesh.get_local_rank(), set()
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if moe.shape.experts % ep:
            raise ConfigError(f"distributed.ep={ep} does not divide the {moe.shape.experts} experts")
        for name in MoE.EXPERT_TENSORS:
            full = getattr(moe, name)
            if full is None:
                continue
            mine = DTensor.from_local(full.chunk(ep, dim=0)[rank], mesh, [Shard(0)], run_check=False)
            setattr(moe, name, nn.Parameter(mine, requires_grad=full.requires_grad))
            spread.add(getattr(moe, name))
        moe.ep_group, moe.expert_grad_scale = mesh.get_group(), 1.0 / world
    return spread


def apply_fsdp(model: DecoderLM, mesh: DeviceMesh, bf16: bool, ignored: set[nn.Parameter] | None = None,
               reduce_bf16: bool = False, head_apart: bool = False) -> None:  # fmt: skip
    """:func:`shard_blocks` over the decoder's blocks; ``head_apart``: its output layer as a unit of its own."""
    shard_blocks(model, list(model.model.layers), mesh, bf16, ignored, reduce_bf16,
                 model.lm_head if head_apart else None)  # fmt: skip


def shard_blocks(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, bf16: bool,
                 ignored: set[nn.Parameter] | None = None, reduce_bf16: bool = False,
                 head: nn.Module | None = None) -> None:  # fmt: skip
    """FSDP2 on each of ``blocks`` in order, then on ``head`` (the output layer, where given), then on ``model`` for
    the rest: bf16 parameters gathered under ``bf16``; the gradients reduce-scattered in fp32, or in bf16 under
    ``reduce_bf16`` (``distributed.grad_reduce_dtype=bf16``: half the bytes; each micro-batch's reduced shard is
    added to the fp32 gradient in fp32); ``ignored`` parameters left unsharded (experts spread by expert
    parallelism). ``head`` apart, its gradient is reduce-scattered as soon as the backward has it, beside the
    blocks' backward, where in ``model``'s unit it waits for the embedding's at the backward's end; like the last
    block it is not resharded after its forward (the backward needs it at once)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = None
    if bf16 or reduce_bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.bfloat16 if reduce_bf16 else torch.float32)  # fmt: skip
    kwargs = {"mesh": mesh} | ({"mp_policy": mp} if mp else {}) | ({"ignored_params": ignored} if ignored else {})
    from trainbench.distributed import RESHARDED_AFTER_FORWARD

    for i, block in enumerate(blocks):
        # The last block's parameters are needed at once by the backward: no point resharding them.
        reshard = i < len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
        if reshard:  # (distributed.keep_gathered keeps them gathered between micro-batches)
            RESHARDED_AFTER_FORWARD.add(block)
    if head is not None:
        fully_shard(head, reshard_after_forward=False, **kwargs)
    fully_shard(model, **kwargs)


def wrap_blocks(model: DecoderLM, checkpointing: bool, compile_blocks: bool) -> None:
    """Checkpointing (every block, or none: :mod:`~trainbench.families.decoder.memory`) and compilation per block
    (and of the output layer with its loss), in place: parameter names stay those of HF Llama. The compiled call of
    a block runs its checkpointing inside."""
    recompute_all(model, checkpointing)
    for block in model.model.layers:
        if compile_blocks:
            block.compile(dynamic=False, options=BLOCK_COMPILE_OPTIONS)
    if compile_blocks:
        model.loss_fn = torch.compile(lm_loss, dynamic=False)


def use_flex_for_packed_rows(model: DecoderLM, device: torch.device, compiled: bool) -> None:
    """Compiled blocks on CUDA attend over packed rows through FlexAttention's block mask (no [seq, seq] mask, only
    each sequence's causal blocks); elsewhere SDPA with the dense mask (flex's eager form is slow, its backward
    absent on CPU)."""
    if compiled and device.type == "cuda":
        model.model.packed_kernel = "flex"


def parallelize(model: DecoderLM, device: torch.device, world: int, tp: int, bf16: bool, checkpointing: bool,
                compile_blocks: bool, full_state: dict[str, torch.Tensor] | None, seed: int,
                fill: Callable[[DecoderLM], None] | None = None, ep: int = 1,
                shard_one_rank: bool = False, reduce_bf16: bool = False, head_apart: bool = False
                ) -> nn.Module:  # fmt: skip
    """Shard ``model`` (built on the meta device) over ``world`` ranks and materialise it on ``device``; on one rank
    too where ``shard_one_rank`` (FSDP2 over a process group of one, as several ranks place it).

    With ``full_state`` (an unsharded state dict on CPU, the same on every rank) the shards are cut from it,
    so the model equals the one-rank model exactly; with ``fill``, that function fills the materialised shards
    (e.g. from a checkpoint on disk); otherwise each shard is initialised in place.
    """
    sharded = world > 1 or shard_one_rank
    if sharded and model.cfg.tie_embeddings:
        raise ConfigError("model.tie_embeddings=true runs unsharded on one rank only (sharding would untie the "
                          "weights)")  # fmt: skip
    if sharded:
        if world == 1:
            from trainbench.distributed import single_rank_group

            single_rank_group(device)  # FSDP2 over one rank needs a process group too
        mesh = make_mesh(device.type, world, tp)
        if tp > 1:
            apply_tp(model, mesh["tp"])
    if model.cfg.precision == "fp8":  # before compilation and FSDP: both then see torchao's Float8Linear
        from trainbench.families import fp8
        from trainbench.families.decoder.moe_fp8 import experts_in_fp8

        fp8.min_capability(device)
        fp8.train_blocks_in_fp8(model, sharded=sharded)
        experts_in_fp8(model, device, getattr(model.cfg, "expert_weight_grad", "fp8"), compile_blocks)
    if device.type == "cuda":  # the experts' activation as one kernel, forward and backward
        from trainbench.families.decoder.glu_kernel import fuse_activations

        fuse_activations(model)
    wrap_blocks(model, checkpointing, compile_blocks)
    if getattr(model.cfg, "output_precision", "auto") == "fp8":  # (its own FP8 function, not compiled: see there)
        from trainbench.families.decoder.fp8_output import lm_loss_fp8

        model.loss_fn = lm_loss_fp8
    use_flex_for_packed_rows(model, device, compile_blocks)
    if sharded:
        experts = apply_expert_parallel(model, device.type, ep, world) if ep > 1 else None
        apply_fsdp(model, mesh["dp"], bf16, experts, reduce_bf16, head_apart)
    model.to_empty(device=device)
    if model.cfg.tie_embeddings:  # to_empty gives every module its own tensor: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    if fill is not None:
        fill(model)
    elif full_state is None:
        model.init_weights(seed)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if sharded:
            set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True))
        else:
            model.load_state_dict(full_state)
    return model


def keep_outer_gathered(placed: Placed, head_apart: bool) -> None:
    """``distributed.keep_outer_gathered`` on a decoder sharded by FSDP2: the root's unit (the embedding, the final
    norm) and the output layer's where it is apart (``head_apart``) kept gathered between a step's micro-batches
    (:func:`~trainbench.distributed.fsdp_keep_outer_gathered`), said on the console."""
    from trainbench.distributed import fsdp_keep_outer_gathered

    root = placed.module
    units = [root, root.lm_head] if head_apart else [root]
    placed.no_sync = fsdp_keep_outer_gathered(units, placed.no_sync)
    placed.notes.append("FSDP2 gathers the embedding, the final norm and the output layer once a step and keeps them "
                        "gathered between its micro-batches (distributed.keep_outer_gathered)")  # fmt: skip


def place_decoder(model: DecoderLM, cfg: DecoderConfig, info: DistInfo, tp: int, bf16: bool, perf: PerfConfig,
                  seed: int, ep: int = 1, shard_one_rank: bool = False,
                  reduce_bf16: bool = False, keep_outer: bool = False, head_apart: bool = False
                  ) -> Placed:  # fmt: skip
    """``model`` (built on the meta device) sharded over the ranks (on one rank too where ``shard_one_rank``; the
    gradients reduce-scattered in bf16 under ``reduce_bf16``; the layers outside the blocks kept gathered between
    micro-batches under ``keep_outer``, :func:`keep_outer_gathered`; the output layer sharded as a unit of its own
    under ``head_apart``),
    materialised and initialised from ``seed``; compiled per block and checkpointed by ``perf.compile`` and
    ``perf.activation_checkpointing``, and what its blocks keep for the backward chosen by ``perf``'s other keys last
    (:func:`~trainbench.families.decoder.memory.recompute_and_offload`: checkpointing on fewer blocks, host
    offload)."""
    checkpointing, compile_blocks = perf.activation_checkpointing, perf.compile
    full = None
    if cfg.num_params() <= FULL_INIT_MAX_PARAMS:
        whole = type(model)(cfg)
        whole.init_weights(seed)
        full = whole.state_dict()
    mixed = bf16 and info.device.type == "cuda"
    placed = parallelize(model, info.device, info.world_size, tp, mixed, checkpointing, compile_blocks, full, seed,
                         ep=ep, shard_one_rank=shard_one_rank, reduce_bf16=reduce_bf16,
                         head_apart=head_apart)  # fmt: skip
    fp8 = cfg.precision == "fp8"
    sharded = info.world_size > 1 or shard_one_rank
    comm = sharded_comm_precision(info.world_size, mixed, fp8, sharded and reduce_bf16)
    out = Placed(module=placed, model=placed, comm_precision=comm)
    if sharded and head_apart:
        out.notes.append("FSDP2 shards the output layer apart (distributed.output_layer_apart): its gradient "
                         "reduce-scattered beside the blocks' backward")  # fmt: skip
    if sharded and keep_outer:
        keep_outer_gathered(out, head_apart)
    if info.world_size == 1 and shard_one_rank:
        out.notes.append("FSDP2 over this one rank (distributed.shard_one_rank), placed as several ranks place it")
    if sharded and reduce_bf16:
        out.notes.append(BF16_REDUCE_NOTE)
    if not sharded and info.device.type == "cuda" and not cfg.tie_embeddings:
        from trainbench.families.decoder.embedding_rows import rows_into_grad

        rows_into_grad(placed.model.embed_tokens)
        out.notes.append("the embedding's gradient added into .grad by the rows each micro-batch touches")
    if fp8:
        from trainbench.families.decoder.moe import MoE
        from trainbench.families.fp8 import finish_placement

        experts = sum(isinstance(m, MoE) for m in placed.modules())
        unchanged = "the embedding" + (", the routers" if experts else "")
        finish_placement(out, sharded, unchanged)
        if not sharded:  # (sharded, FSDP2's gathers cast once a step: fp8.precompute_scales)
            from trainbench.families.fp8 import cast_placed_weights_once_a_step

            cast_placed_weights_once_a_step(out, placed, compile_blocks)
            from trainbench.families.decoder.fp8_output import cache_output_casts, lm_loss_fp8

            if placed.loss_fn is lm_loss_fp8:  # (set by parallelize where model.output_precision=fp8)
                out.also_after_step(cache_output_casts(placed, compile_blocks))
        if experts:
            wgrad = getattr(cfg, "expert_weight_grad", "fp8")
            out.notes.append(f"the experts' grouped products of {experts} blocks in FP8 (forward and input "
                             f"gradient; the weights' gradient in {wgrad}), each expert's rows padded to a multiple "
                             "of 16")  # fmt: skip
            # Sharded by FSDP2, the experts' weights are gathered anew for each forward: cast there. Spread by expert
            # parallelism, FSDP2 leaves them alone and each rank casts its share once a step.
            if not sharded or ep > 1:
                from trainbench.families.decoder.moe_fp8 import cache_fp8_weight_casts

                out.also_after_step(cache_fp8_weight_casts(placed, compile_blocks))
                out.notes.append("the experts' weights cast to FP8 once a step, not in every micro-batch")
            elif info.world_size > 1:  # (tests/test_gpu_multi.py's fsdp2_fp8_experts)
                out.notes.append("the experts sharded by FSDP2 with the rest, gathered in bf16 and cast to FP8 in "
                                 "every micro-batch (on 2 H200 0.70 of one GPU's rate, against 0.78-0.80 with the "
                                 "experts spread by distributed.ep: docs/gpt_oss.md)")  # fmt: skip
    return recompute_and_offload(out, perf, info.device)
