"""The MMDiT family (FLUX.1's transformer, flux1): double-stream blocks over the text and image tokens, then
single-stream blocks over both; data-parallel over the ranks (DDP, or FSDP2 block by block with
``perf.activation_checkpointing`` or several ranks: :mod:`.placement`), FP8 blocks through torchao."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from trainbench.config import RunConfig
from trainbench.errors import ConfigError, UserError
from trainbench.families.base import ModelFamily

if TYPE_CHECKING:
    import torch

    from trainbench.distributed import DistInfo, Placed
    from trainbench.families.mmdit.model import Flux


class MMDiTFamily(ModelFamily):
    name = "mmdit"
    hf_twin = "trainbench.families.mmdit.hf"

    def validate(self, cfg: RunConfig) -> None:
        from trainbench.families import fp8

        m = cfg.model
        try:
            axes = m.axes_dim
        except ValueError:
            raise ConfigError(f"model.rope_axes={m.rope_axes!r} is not comma-separated whole numbers") from None
        if len(axes) != 3 or any(a <= 0 or a % 2 for a in axes):
            raise ConfigError(f"model.rope_axes={m.rope_axes!r}: three positive even widths (text, latent row, latent "
                              "column), each a whole number of rotated pairs")  # fmt: skip
        if m.hidden_size % m.num_heads or sum(axes) != m.head_dim:
            raise ConfigError(f"model: hidden_size {m.hidden_size} over {m.num_heads} heads must be whole heads whose "
                              f"width equals the rotary axes' sum, {sum(axes)}")  # fmt: skip
        if m.in_channels % 4 or m.latent_size % 2:
            raise ConfigError(
                f"model.in_channels={m.in_channels} and model.latent_size={m.latent_size}: an image "
                "token is a 2 x 2 patch of the latent's channels, so both must be even (channels x 4)"
            )
        if cfg.distributed.tp != 1:
            raise ConfigError(f"{cfg.benchmark} is data-parallel only: distributed.tp must be 1")
        if m.precision == "fp8":
            fp8.require(cfg.device)
        if cfg.perf.cuda_graphs and (cfg.distributed.world_size > 1 or cfg.perf.activation_checkpointing):
            raise ConfigError(f"perf.cuda_graphs applies to {cfg.benchmark}'s model compiled whole on one rank; with "
                              "several ranks or perf.activation_checkpointing it is compiled block by block, without "
                              "them")  # fmt: skip

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        from trainbench.families.mmdit.model import Flux

        model = Flux(cfg.model)
        init_weights(model)
        return model

    def place(self, model: torch.nn.Module, cfg: RunConfig, info: DistInfo, bf16: bool) -> Placed:
        from trainbench.families.mmdit.placement import place_flux

        return place_flux(model, info, cfg.distributed, cfg.perf, bf16)

    def depth(self, cfg: RunConfig) -> int | None:
        """A block here is one double-stream block and its share of the single-stream ones (single_blocks /
        double_blocks: 2 at FLUX.1's 19 + 38), so that each truncated depth keeps the model's mix of the two kinds
        and the step time grows in a straight line to the model's own depth, the double blocks'."""
        return cfg.model.double_blocks

    def truncated(self, cfg: RunConfig, depth: int) -> RunConfig:
        m = cfg.model
        if not m.double_blocks or m.single_blocks % m.double_blocks:
            raise UserError(f"--blocks: {cfg.benchmark}'s {m.single_blocks} single-stream blocks are not a whole "
                            f"multiple of its {m.double_blocks} double-stream blocks, so no truncated depth keeps "
                            "their mix and the figures could not be extrapolated in a straight line")  # fmt: skip
        ratio = m.single_blocks // m.double_blocks
        return dataclasses.replace(cfg, model=dataclasses.replace(m, double_blocks=depth, single_blocks=depth * ratio))

    def blocks_of(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        from trainbench.families.mmdit.placement import blocks_of

        return blocks_of(model)

    def node_costs(self, cfg: RunConfig, ranks: int, one) -> dict[str, float] | str:
        """FSDP2 over the ranks, a unit a block (families/node_costs.fully_sharded), FP8 blocks gathered in FP8 (their
        modulation, a small share, in bf16)."""
        from trainbench.families.node_costs import fully_sharded, micro_batches, reduce_bytes

        d = cfg.distributed
        gathered = 1 if cfg.model.precision == "fp8" else 2
        return fully_sharded(one, ranks, micro_batches(cfg, ranks), reduce_bytes(d), gathered, d.reduce_once_a_step,
                             d.keep_gathered)  # fmt: skip

    def tokens_per_sample(self, cfg: RunConfig) -> int:
        return cfg.model.text_tokens + (cfg.model.latent_size // 2) ** 2

    def flops_per_sample(self, cfg: RunConfig) -> float | None:
        """Forward and backward: 6 x each matrix's parameters x the tokens it multiplies (a double block's streams
        their own tokens, a single block all of them; the modulations one vector a sample) plus the joint
        attention's QK^T and AV x 3. At FLUX.1-schnell's shape about 20.3 TFLOP, MLPerf's count."""
        m = cfg.model
        h, f = m.hidden_size, m.mlp_width
        img, txt = (m.latent_size // 2) ** 2, m.text_tokens
        stream = 3 * h * h + h * h + 2 * h * f  # q/k/v, out, MLP
        matmuls = m.double_blocks * stream * (img + txt) + m.single_blocks * (3 * h * h + h * f + (h + f) * h) * (
            img + txt)  # fmt: skip
        attention = 4 * (img + txt) ** 2 * h * (m.double_blocks + m.single_blocks)
        return 6.0 * matmuls + 3.0 * attention


def init_weights(model: Flux) -> None:
    """As the reference (DiT's): Xavier-uniform matrices, zero biases, and the last layer's modulation and
    projection zero, so that training starts from a model that predicts no velocity."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight)
                torch.nn.init.zeros_(module.bias)
        for layer in (model.final_layer.adaLN_modulation[1], model.final_layer.linear):
            torch.nn.init.zeros_(layer.weight)
            torch.nn.init.zeros_(layer.bias)
