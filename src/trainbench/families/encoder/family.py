"""The encoder family (BERT, bert): BERT-large's encoder with its masked-LM and next-sentence heads, on fixed rows or
packed rows (several sequences a row, attention within each: cuDNN's fused kernel, FlashAttention's varlen kernel or
a dense mask, ``model.packed_attention``); data-parallel over the ranks (DDP, compiled, its gradients clipped by
bucket where ``optimizer.clip=bucket``: :mod:`trainbench.families.data_parallel`). Reads HF-named, MLPerf-converted
or its own weights (``model.init_checkpoint``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainbench.config import RunConfig
from trainbench.errors import ConfigError, DataError
from trainbench.families.base import ModelFamily

if TYPE_CHECKING:
    import torch

    from trainbench.distributed import DistInfo, Placed
    from trainbench.families.encoder.model import BertForPreTraining


class EncoderFamily(ModelFamily):
    name = "encoder"
    hf_twin = "trainbench.families.encoder.hf"

    def validate(self, cfg: RunConfig) -> None:
        import torch

        from trainbench.families.encoder.model import packed_kernel_unavailable

        m, d = cfg.model, cfg.data
        if d.seq_length > m.max_position_embeddings:
            raise ConfigError(
                f"data.seq_length={d.seq_length} exceeds model.max_position_embeddings={m.max_position_embeddings}"
            )
        if m.hidden_size % m.num_heads:
            raise ConfigError(f"model.hidden_size={m.hidden_size} is not a multiple of model.num_heads={m.num_heads}")
        if cfg.distributed.tp != 1:
            raise ConfigError(f"{cfg.benchmark} is data-parallel only: distributed.tp must be 1")
        if d.layout == "packed" and m.packed_attention != "auto":
            cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
            # Training: with gradients, and bf16 on CUDA unless precision=fp32.
            problem = packed_kernel_unavailable(m.packed_attention, cuda=cuda, half=cfg.precision != "fp32",
                                                grad=True, dropout=m.attention_dropout > 0)  # fmt: skip
            if problem is not None:
                raise ConfigError(f"{problem}; use model.packed_attention=auto to pick what runs here")

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        from trainbench.families.encoder.model import BertForPreTraining

        model = BertForPreTraining(cfg.model)
        if cfg.model.init_checkpoint:
            load_checkpoint(model, cfg.model.init_checkpoint)
        return model

    def place(self, model: torch.nn.Module, cfg: RunConfig, info: DistInfo, bf16: bool) -> Placed:
        from trainbench.families.data_parallel import place_data_parallel

        bucket_clip = cfg.optimizer.max_grad_norm if cfg.optimizer.clip == "bucket" else None
        return place_data_parallel(model, info, cfg.distributed, cfg.perf, bucket_clip)

    def node_costs(self, cfg: RunConfig, ranks: int, one) -> dict[str, float] | str:
        """A replica on each GPU under DDP (families/node_costs.replicated): compiled as one graph (the default on
        one node), every bucket all-reduced after the backward; eager, or the graph split at the buckets
        (``distributed.overlap_compiled=true``), the last bucket left after it."""
        from trainbench.families.node_costs import reduce_bytes, replicated

        d = cfg.distributed
        reduce = reduce_bytes(d)
        split = not cfg.perf.compile or d.overlap_compiled == "true"
        return replicated(one, ranks, reduce, d.bucket_cap_mb * 2**20 * reduce / 4 if split else None)

    def _bench_lengths(self, cfg: RunConfig) -> np.ndarray:
        from trainbench.data.synthetic_bert import mlperf_like_lengths

        return mlperf_like_lengths(np.random.default_rng(0), 65_536, cfg.data.seq_length).astype(np.float64)

    def tokens_per_sample(self, cfg: RunConfig) -> int:
        """A fixed row's positions (padding is computed); on packed rows, a sample's mean real length."""
        if cfg.data.layout == "packed":
            return round(float(self._bench_lengths(cfg).mean()))
        return cfg.data.seq_length

    def flops_per_sample(self, cfg: RunConfig) -> float | None:
        """Forward and backward of the encoder on a sample's row positions (a fixed row pays for its padding; on
        packed rows, the mean over MLPerf's length mix, attention within each sequence), the MLM head at
        max_predictions positions and the NSP head: 3 x the forward's 2 x multiply-adds."""
        m, s = cfg.model, cfg.data.seq_length
        h, layers = m.hidden_size, m.num_layers
        if cfg.data.layout == "packed":
            lengths = self._bench_lengths(cfg)
            tokens, squares = float(lengths.mean()), float((lengths**2).mean())
        else:
            tokens, squares = float(s), float(s * s)
        dense = 2 * tokens * layers * (4 * h * h + 2 * h * m.intermediate_size)
        attention = 2 * layers * 2 * h * squares
        heads = 2 * cfg.data.max_predictions * (h * h + h * m.vocab_size)
        return 3.0 * (dense + attention + heads)

    def model_notes(self, cfg: RunConfig, device: torch.device, bf16: bool) -> list[str]:
        from trainbench.families.encoder.model import choose_packed_kernel

        if cfg.data.layout != "packed":
            return []
        m = cfg.model
        kernel = choose_packed_kernel(m.packed_attention, cuda=device.type == "cuda", half=bf16, grad=True,
                                      dropout=m.attention_dropout > 0)  # fmt: skip
        return [f"attention over packed rows: {kernel} (model.packed_attention={m.packed_attention})"]


def load_checkpoint(model: BertForPreTraining, path: str | Path) -> None:
    """Load HF-named, MLPerf-converted or our own weights into ``model``; a mismatch is a DataError."""
    import torch

    from trainbench.families.encoder.model import from_hf_state_dict

    path = checkpoint_file(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a pickle error, a truncated file...
            raise DataError(f"model.init_checkpoint {path} could not be read as a torch checkpoint: {exc}") from None
        for key in ("model", "state_dict"):
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
    ours = set(model.state_dict())
    if not set(state) <= ours:
        try:
            state = from_hf_state_dict(state)
        except KeyError as exc:
            raise DataError(f"model.init_checkpoint {path}: {exc.args[0]}") from None
    missing = ours - set(state)
    if missing:
        raise DataError(f"model.init_checkpoint {path} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise DataError(f"model.init_checkpoint {path} does not fit the model config: {str(exc)[:300]}") from None


def checkpoint_file(path: str | Path) -> Path:
    """``model.init_checkpoint`` as a file that exists, or a DataError saying what it is instead."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"model.init_checkpoint {path} is a folder; give the checkpoint file (.pt, .bin or "
                        ".safetensors) inside it")  # fmt: skip
    if not path.is_file():
        raise DataError(f"model.init_checkpoint {path} does not exist")
    return path
