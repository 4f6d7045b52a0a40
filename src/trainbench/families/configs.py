"""The models' config sections (``RunConfig.model``): a model's shape and switches as plain dataclasses, no torch.

Each model module imports its own from here; a benchmark's presets build them without loading any model, so
`trainbench list` and `--help` start without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainbench.config import option
from trainbench.errors import ConfigError


@dataclass(kw_only=True)
class BertConfig:
    vocab_size: int = option(30522, "Rows of the word-embedding table (and MLM output classes).", at_least=1)
    hidden_size: int = option(1024, "Width of the encoder.", at_least=1)
    num_layers: int = option(24, "Encoder layers.", at_least=1)
    num_heads: int = option(16, "Attention heads per layer.", at_least=1)
    intermediate_size: int = option(4096, "Width of the feed-forward layer.", at_least=1)
    max_position_embeddings: int = option(512, "Rows of the position-embedding table.", at_least=1)
    type_vocab_size: int = option(2, "Segment (token type) ids.", at_least=1)
    hidden_dropout: float = option(
        0.1, "Dropout after embeddings, attention output and feed-forward output.", at_least=0, below=1
    )
    attention_dropout: float = option(0.1, "Dropout on attention probabilities.", at_least=0, below=1)
    layer_norm_eps: float = option(1e-12, "LayerNorm epsilon.", above=0, below=1)
    init_std: float = option(0.02, "Std of the normal initialisation of weights.", above=0)
    packed_attention: str = option(
        "auto",
        "Attention for packed rows: varlen (flash attention over variable-length sequences, with dropout; CUDA, "
        "bf16/fp16), cudnn (cuDNN's fused attention over the same sequences, read in place from the QKV "
        "projection, with dropout; CUDA, bf16/fp16, needs the cuDNN frontend: pip install -e '.[cudnn]'), flex "
        "(FlexAttention with a block-sparse document mask; no dropout), sdpa (SDPA with a dense boolean mask), or "
        "auto: cudnn on CUDA in bf16/fp16 where the cuDNN frontend is installed, else varlen there, else flex where "
        "it can run, else sdpa.",
        choices=("auto", "varlen", "cudnn", "flex", "sdpa"),
    )
    low_precision_residual: bool = option(
        True,
        "Under bf16 autocast, keep the residual stream (every LayerNorm's output) in bf16 instead of fp32. "
        "LayerNorm still computes in fp32; this halves the bytes of the residual adds, LayerNorms and their "
        "casts. No effect without autocast.",
    )
    init_checkpoint: str | None = option(
        None, "Weights to start from: a .pt/.bin state dict (HF or MLPerf names) or HF .safetensors."
    )


@dataclass(kw_only=True)
class DecoderConfig:
    vocab_size: int = option(128256, "Token ids (rows of the embedding and of the output layer).", at_least=1)
    hidden_size: int = option(4096, "Model width.", at_least=1)
    num_layers: int = option(32, "Transformer blocks.", at_least=1)
    num_heads: int = option(32, "Query heads.", at_least=1)
    num_kv_heads: int | None = option(
        8, "Key/value heads (grouped-query attention); None: as many as query heads.", at_least=1
    )
    intermediate_size: int = option(14336, "MLP width.", at_least=1)
    max_seq_length: int = option(8192, "Longest sequence (rows of the learned position table, if any).", at_least=1)
    arch: str = option("llama", "llama: RoPE, RMSNorm, SwiGLU, no biases; gpt3: learned positions, LayerNorm, "
                       "GELU, biases.", choices=("llama", "gpt3"))  # fmt: skip
    rope_theta: float = option(500000.0, "RoPE base (llama).", above=0)
    norm_eps: float = option(1e-5, "Epsilon of RMSNorm / LayerNorm.", above=0, below=1)
    tie_embeddings: bool = option(False, "Share the input embedding with the output layer.")
    init_std: float = option(
        0.02, "Std of the normal initialisation; output projections get std / sqrt(2 x layers).", above=0
    )
    fused_qkv: bool = option(
        False,
        "One qkv_proj for queries, keys and values (rows q, then k, then v) instead of q/k/v_proj: the layout "
        "of MLPerf's Llama-2-70B checkpoint and of the llama31-8b preset (in FP8 the attention's input is cast "
        "once instead of three times). No tensor-parallel plan.",
    )
    precision: str = option(
        "auto",
        "The blocks' linear layers: auto (the run's precision: bf16 on a GPU) or fp8 (torchao's float8 training: "
        "forward, input and weight gradients on FP8 tensor cores with a scale per tensor; weights, gradients and "
        "optimizer state stay as before). fp8 needs torchao (pip install -e '.[fp8]' in trainbench's clone) and a GPU "
        "of compute capability 8.9 or newer.",
        choices=("auto", "fp8"),
    )
    output_precision: str = option(
        "auto",
        "The output layer over the vocabulary: auto (the run's precision: bf16 on a GPU) or fp8 (with precision=fp8: "
        "its three products on FP8 tensor cores with a scale per tensor, the logits' gradient written in FP8 by the "
        "loss's backward at a fixed scale, its known bound; the loss itself stays in fp32). Needs a vocabulary and "
        "width that are multiples of 16 and untied embeddings.",
        choices=("auto", "fp8"),
    )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_params(self, embeddings: bool = True) -> int:
        h, i, kv = self.hidden_size, self.intermediate_size, self.kv_heads * self.head_dim
        bias = self.arch == "gpt3"
        attn = h * h * 2 + 2 * h * kv + (2 * h + 2 * kv if bias else 0)
        mlp = (3 if self.arch == "llama" else 2) * h * i + ((i + h) if bias else 0)
        norms = (4 if bias else 2) * h
        per_layer = attn + mlp + norms
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        if self.arch == "gpt3":
            emb += self.max_seq_length * h
        return self.num_layers * per_layer + (2 if bias else 1) * h + (emb if embeddings else 0)


BLOCKS = ("reference", "gpt_oss")
ATTENTION_KERNELS = ("auto", "flex", "flash", "cudnn")


@dataclass(kw_only=True)
class GptOssConfig(DecoderConfig):
    """The reference's gpt_oss_20b by default; ``intermediate_size`` is each expert's width."""

    vocab_size: int = option(128256, "Token ids (Llama 3.1's tokenizer in the reference; GPT-OSS's own has 201,088).",
                             at_least=1)  # fmt: skip
    hidden_size: int = option(2880, "Model width.", at_least=1)
    num_layers: int = option(24, "Transformer blocks, each with a mixture of experts.", at_least=1)
    num_heads: int = option(64, "Query heads.", at_least=1)
    num_kv_heads: int | None = option(8, "Key/value heads (grouped-query attention).", at_least=1)
    intermediate_size: int = option(2880, "Each expert's SwiGLU width.", at_least=1)
    attention_head_dim: int = option(64, "Width of an attention head (heads x head width need not be the model's).",
                                     at_least=1)  # fmt: skip
    rope_theta: float = option(150000.0, "RoPE base.", above=0)
    norm_eps: float = option(1e-6, "Epsilon of RMSNorm.", above=0, below=1)
    init_std: float = option(
        0.008, "Std of the normal initialisation; output projections get std / sqrt(2 x layers).", above=0
    )
    block: str = option(
        "reference",
        "reference: MLCommons' block (no biases, no sinks, SiLU experts, plain RoPE); gpt_oss: GPT-OSS's own "
        "(biases, attention sinks, clamped SwiGLU, YaRN RoPE), as NVIDIA submitted it and transformers defines it.",
        choices=BLOCKS,
    )
    attention: str = option(
        "auto",
        "Kernel of the blocks without a window, where the blocks compile on CUDA: flex (FlexAttention), flash (flash "
        "attention), cudnn (cuDNN's fused attention; with flash and cudnn GPT-OSS's sinks are applied outside the "
        "kernel's forward and backward) or auto (cudnn on compute capability 9.0 or newer in 16 bits, else flex).",
        choices=ATTENTION_KERNELS,
    )
    window_attention: str = option(
        "flex",
        "Kernel of the windowed blocks, where the blocks compile on CUDA: flex (FlexAttention with the window's block "
        "mask) or flash (flash attention with its own window).",
        choices=ATTENTION_KERNELS[1:3],
    )
    num_experts: int = option(32, "Experts in each block's mixture.", at_least=1, at_most=4096)
    expert_weight_grad: str = option(
        "fp8",
        "With precision=fp8, the experts' weight gradient: fp8 (an FP8 grouped product, a scale per expert and "
        "operand) or bf16 (a bf16 grouped product).",
        choices=("fp8", "bf16"),
    )
    experts_per_token: int = option(4, "Experts each token is routed to (top-k).", at_least=1)
    sliding_window: int = option(
        129,
        "Keys a query sees in the windowed blocks, its own included (0: no block has a window). The reference's "
        "129 is Transformer Engine's window_size=(128, 0); transformers' GPT-OSS sees 128.",
        at_least=0,
    )
    window_every: int = option(
        2, "Blocks 0, N, 2N, ... slide the window; the others attend to the whole causal prefix.", at_least=1
    )
    aux_loss_coeff: float = option(
        0.0, "Weight of the Switch load-balancing loss summed over blocks (0: none, as the reference).", at_least=0
    )
    yarn_factor: float = option(
        1.0, "YaRN's context scaling of the rotary frequencies (1: plain RoPE; GPT-OSS: 32).", at_least=1
    )
    yarn_original_positions: int = option(4096, "YaRN: the context the frequencies were made for.", at_least=1)
    yarn_beta_fast: float = option(32.0, "YaRN: rotations above which a frequency is kept.", above=0)
    yarn_beta_slow: float = option(1.0, "YaRN: rotations below which a frequency is fully interpolated.", above=0)

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim

    @property
    def gpt_oss_block(self) -> bool:
        return self.block == "gpt_oss"

    def windowed(self, index: int) -> bool:
        """Whether block ``index`` slides a window (transformers' GPT-OSS: the even ones)."""
        return self.sliding_window > 0 and index % self.window_every == 0

    def num_params(self, embeddings: bool = True, active: bool = False) -> int:
        """Parameters; ``active``: those a token passes through (its top-k experts, not all)."""
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        bias = self.gpt_oss_block
        q, kv = self.num_heads * d, self.kv_heads * d
        attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv + h + self.num_heads) if bias else 2 * d)
        expert = 3 * h * f + ((2 * f + h) if bias else 0)
        experts = self.experts_per_token if active else self.num_experts
        moe = h * self.num_experts + (self.num_experts if bias else 0) + experts * expert
        per_layer = attn + moe + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + h + (emb if embeddings else 0)


@dataclass(kw_only=True)
class LoraModelConfig(DecoderConfig):
    """A decoder with a frozen base read from a checkpoint, and LoRA adapters."""

    base_weights: str | None = option(
        None, "Folder of the frozen base model: HF safetensors (model.safetensors.index.json and its shards), "
        "q/k/v separate or fused in qkv_proj. None: the base is initialised from the seed (throughput runs only).",
    )  # fmt: skip
    lora_rank: int = option(16, "Rank of each adapter (MLPerf: 16).", at_least=1)
    lora_alpha: float = option(32.0, "Adapter scale numerator: outputs are scaled by alpha / rank (MLPerf: 32).",
                               above=0)  # fmt: skip
    lora_dropout: float = option(0.1, "Dropout on each adapter's input (MLPerf: 0.1).", at_least=0, below=1)
    lora_targets: str = option(
        "qkv_proj,o_proj", "Linear layers given adapters: last parts of their names, comma-separated."
    )
    base_precision: str = option(
        "auto",
        "Frozen base weights: auto (the run's precision: bf16 on a GPU) or fp8 (e4m3 with a scale per output "
        "channel, quantised once at load, multiplied on FP8 tensor cores; the whole base on every rank, adapters' "
        "gradients all-reduced).",
        choices=("auto", "fp8"),
    )
    base_sharding: str = option(
        "replicate",
        "With base_precision=fp8: replicate (the whole FP8 base on every rank, adapters' gradients all-reduced) or "
        "fsdp (the FP8 base sharded by FSDP2 over the ranks and gathered in FP8 a block at a time: for GPUs that "
        "cannot hold a replica beside the activations).",
        choices=("replicate", "fsdp"),
    )

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())


@dataclass(kw_only=True)
class FluxConfig:
    """FLUX.1-schnell's shape by default (about 11.9 B parameters)."""

    in_channels: int = option(64, "Channels of an image token: 16 latent channels in 2 x 2 patches.", at_least=1)
    hidden_size: int = option(3072, "Model width.", at_least=1)
    num_heads: int = option(24, "Attention heads.", at_least=1)
    double_blocks: int = option(19, "Double-stream blocks (text and image with weights of their own).", at_least=0)
    single_blocks: int = option(38, "Single-stream blocks (one sequence of text and image tokens).", at_least=0)
    mlp_ratio: float = option(4.0, "MLP width / model width.", above=0, at_most=64)
    context_dim: int = option(4096, "Width of a prompt token's encoding (T5-XXL).", at_least=1)
    vector_dim: int = option(768, "Width of the pooled prompt vector (CLIP).", at_least=1)
    rope_axes: str = option("16,56,56", "Channels of a head each rotary axis turns (text, latent row, latent column), "
                            "comma-separated; their sum is a head's width.")  # fmt: skip
    rope_theta: float = option(10000.0, "RoPE base.", above=0)
    text_tokens: int = option(256, "Prompt tokens a sample's T5 encoding holds (must match the data).", at_least=1)
    latent_size: int = option(32, "Height and width of a sample's latent (must match the data; 256 px images).",
                              at_least=2)  # fmt: skip
    precision: str = option(
        "auto",
        "The blocks' linear layers: auto (the run's precision: bf16 on a GPU) or fp8 (torchao's float8 training: "
        "forward, input and weight gradients on FP8 tensor cores with a scale per tensor; the modulation's layers, "
        "a few rows each, stay as they are, as do weights, gradients and optimizer state). fp8 needs torchao "
        "(pip install -e '.[fp8]' in trainbench's clone) and a GPU of compute capability 8.9 or newer.",
        choices=("auto", "fp8"),
    )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def axes_dim(self) -> tuple[int, ...]:
        return tuple(int(a) for a in self.rope_axes.split(","))

    @property
    def mlp_width(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    def num_params(self) -> int:
        h, m, d = self.hidden_size, self.mlp_width, self.head_dim
        stream = (h * 6 * h + 6 * h) + (h * 3 * h + 3 * h) + 2 * d + (h * h + h) + (h * m + m) + (m * h + h)
        single = (h * 3 * h + 3 * h) + (h * (3 * h + m) + 3 * h + m) + 2 * d + ((h + m) * h + h)
        embed = (self.in_channels * h + h) + (256 * h + h) + (h * h + h) + (self.vector_dim * h + h)
        embed += (h * h + h) + (self.context_dim * h + h)
        final = (h * 2 * h + 2 * h) + (h * self.in_channels + self.in_channels)
        return embed + self.double_blocks * 2 * stream + self.single_blocks * single + final


# -- dlrmv4: the HSTU ranker ----------------------------------------------------------------------------------------
# The columns of an anchor event a cross feature may combine (data/yambda.py computes each anchor's).
CROSS_KEYS = ("uid", "item_id", "artist_id", "album_id", "hour_of_day", "is_organic")
# The reference's seven crosses and their table sizes (dlrm_v3/configs.py, YAMBDA_5B_CROSS_SPECS).
REFERENCE_CROSSES = ("uid*artist_id:100000000,uid*album_id:40000000,uid*hour_of_day:24000000,"
                     "item_id*hour_of_day:40000000,artist_id*hour_of_day:32000000,uid*is_organic:2000000,"
                     "uid*artist_id*hour_of_day:40000000")  # fmt: skip
ACTIONS = 9  # an event's pool bits (listen-plus 1, like 2, skip 4: 0..7) and 8, the candidate's unknown action
CANDIDATE_ACTION = 8


@dataclass(frozen=True)
class Cross:
    """A hashed cross feature: its anchor columns and its table's rows."""

    keys: tuple[str, ...]
    rows: int

    @property
    def name(self) -> str:
        return "_x_".join(self.keys)


def parse_crosses(spec: str) -> list[Cross]:
    """``model.cross_features`` (``a*b:rows,...``) as crosses; one sentence where it is malformed or names a column
    an anchor event does not have."""
    crosses = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        keys, sep, rows = part.partition(":")
        if not sep or not rows.strip().isdigit() or int(rows) < 1:
            raise ConfigError(f"model.cross_features: {part!r} is not COLUMN*COLUMN:ROWS (e.g. uid*artist_id:1000)")
        names = tuple(k.strip() for k in keys.split("*"))
        missing = [k for k in names if k not in CROSS_KEYS]
        if missing:
            raise ConfigError(f"model.cross_features: {part!r} names {', '.join(missing)}, which the data has no "
                              f"column for (an anchor event has {', '.join(CROSS_KEYS)})")  # fmt: skip
        crosses.append(Cross(names, int(rows)))
    return crosses


@dataclass(kw_only=True)
class HstuConfig:
    """The run config's ``model`` section for dlrmv4 (defaults: the reference's shape, dlrm_v3/configs.py)."""

    embedding_dim: int = option(512, "Width of every embedding table's rows.", at_least=1)
    model_dim: int = option(512, "Width of the HSTU layers' residual stream (the reference's transducer dim).",
                            at_least=1)  # fmt: skip
    num_layers: int = option(5, "HSTU layers.", at_least=1)
    num_heads: int = option(4, "Attention heads of each HSTU layer.", at_least=1)
    attention_dim: int = option(128, "Query and key width per head.", at_least=1)
    linear_dim: int = option(128, "Value and gate (U) width per head.", at_least=1)
    input_dropout: float = option(0.2, "Dropout on the sequence's input embeddings.", at_least=0, below=1)
    linear_dropout: float = option(0.1, "Dropout on each layer's gated output before its projection.", at_least=0,
                                   below=1)  # fmt: skip
    uid_rows: int = option(1_000_000, "Rows of the user table: user ids must lie below it.", at_least=1)
    item_rows: int = option(9_390_000, "Rows of the track table (history and candidate).", at_least=1)
    artist_rows: int = option(1_290_000, "Rows of the artist table.", at_least=1)
    album_rows: int = option(3_370_000, "Rows of the album table.", at_least=1)
    cross_features: str = option(REFERENCE_CROSSES, "Hashed cross features, COLUMN*COLUMN:ROWS,... over the anchor "
                                 f"event's columns ({', '.join(CROSS_KEYS)}).")  # fmt: skip
    history_length: int = option(2048, "History events a sample keeps: the newest third of each pool (listen-plus, "
                                 "like, skip) before the candidate.", at_least=3)  # fmt: skip

    @property
    def crosses(self) -> list[Cross]:
        return parse_crosses(self.cross_features)

    @property
    def contextual(self) -> int:
        """Contextual tokens: the user's and one per cross feature."""
        return 1 + len(self.crosses)

    @property
    def history(self) -> int:
        """History positions of a sample: three pools of ``history_length // 3``."""
        return 3 * (self.history_length // 3)

    @property
    def sequence_length(self) -> int:
        return self.contextual + self.history + 1

    def table_rows(self) -> dict[str, int]:
        """Every embedding table and its rows, in the order the model holds them."""
        rows = {"uid": self.uid_rows, "item": self.item_rows, "artist": self.artist_rows, "album": self.album_rows}
        return rows | {c.name: c.rows for c in self.crosses}
