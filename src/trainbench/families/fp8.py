"""A frozen base in FP8: each frozen ``nn.Linear`` weight quantised once to e4m3 with one scale per output channel.

The forward quantises its input per row (one scale per token) and multiplies on the FP8 tensor cores
(``torch._scaled_mm``, rowwise scales, bf16 out). The backward needs the gradient of the input only (the weight is
frozen): ``dx = dy @ W = (dy * s) @ Wq`` with ``s`` the weight's per-output-channel scales, so the scaled gradient is
quantised per row and multiplied by the same FP8 weight, transposed on the fly (a copy of one layer at a time, not a
second copy of the model) by a tiled Triton transpose, about a tenth of the time of torch's float8 copy
(perf/fp8_transpose.py; the figures: docs/performance.md, "Llama-2-70B LoRA"). LoRA adapters (a forward hook on the same
layer) stay in bf16/fp32.

Off CUDA (tests) the product is taken with the dequantised weight, in the input's precision: the same numbers
stored, another kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainbench.distributed import Placed
from trainbench.errors import ConfigError
from trainbench.families.triton_kernels import lazy_kernel

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, cols] as e4m3 with one fp32 scale per row ([rows, 1]): x ~ q * scale."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor, dtype,
        fast_accum: bool = False) -> torch.Tensor:  # fmt: skip
    """(a * a_scale) @ (b_t * b_scale).T for FP8 ``a`` [m, k] and ``b_t`` [n, k], scales [m, 1] and [n, 1] (a scale
    a row) or 0-d fp32 (one a tensor); ``fast_accum``: cuBLAS's faster, less precise accumulation."""
    if a.is_cuda:
        return torch._scaled_mm(a, b_t.t(), scale_a=a_scale, scale_b=b_scale.t(), out_dtype=dtype,
                                use_fast_accum=fast_accum)  # fmt: skip
    return ((a.float() * a_scale) @ (b_t.float() * b_scale).t()).to(dtype)


def _define_transpose(triton, tl):
    """A tiled transpose of a byte matrix."""

    @triton.jit
    def tb_transpose_bytes(src, dst, rows, cols, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        tile = tl.load(src + r[:, None] * cols + c[None, :], mask=mask)
        tl.store(dst + c[:, None] * rows + r[None, :], tl.trans(tile), mask=tl.trans(mask))

    return tb_transpose_bytes


_transpose_kernel = lazy_kernel(_define_transpose)


def transpose_fp8(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``w.t().contiguous()`` for a 2-d float8 tensor: on CUDA through a tiled Triton transpose of its bytes (torch's
    own copy kernel for float8 moves a 70B block's weights at about a tenth of the GPU's copy bandwidth), else
    torch's copy."""
    built = _transpose_kernel() if w.is_cuda else None
    if built is None:
        return w.t().contiguous()
    kernel, cdiv = built
    rows, cols = w.shape
    src = w.contiguous().view(torch.uint8)
    out = torch.empty(cols, rows, dtype=torch.uint8, device=w.device)
    kernel[(cdiv(rows, block), cdiv(cols, block))](src, out, rows, cols, BLOCK=block, num_warps=8 if block > 64 else 4)
    return out.view(w.dtype)


def _define_cast_transpose(triton, tl):
    """A tiled cast of a bf16 matrix to e4m3, each row divided by its own divisor, written transposed."""

    @triton.jit
    def tb_cast_transpose(src, div, dst, rows, cols, limit, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        tile = tl.load(src + r[:, None] * cols + c[None, :], mask=mask).to(tl.float32)
        d = tl.load(div + r, mask=r < rows, other=1.0)
        q = tl.clamp(tile / d[:, None], -limit, limit).to(dst.dtype.element_ty)
        tl.store(dst + c[:, None] * rows + r[None, :], tl.trans(q), mask=tl.trans(mask))

    return tb_cast_transpose


_cast_transpose_kernel = lazy_kernel(_define_cast_transpose)


@torch.library.custom_op("trainbench::cast_transpose_e4m3", mutates_args=())
def cast_transpose_e4m3(t: torch.Tensor, row_divisors: torch.Tensor) -> torch.Tensor:
    """``(t / row_divisors[:, None])`` [rows, cols] in e4m3 (clamped to its range), transposed: [cols, rows],
    row-major. On CUDA one tiled Triton pass (the compiler's own transposing cast, fused into a backward, ran at
    about a quarter of the copy bandwidth); elsewhere torch's operations, to the same values."""
    built = _cast_transpose_kernel() if t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) else None
    if built is None:
        return (t.float() / row_divisors[:, None].float()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).t().contiguous()
    kernel, cdiv = built
    rows, cols = t.shape
    out = torch.empty(cols, rows, dtype=E4M3, device=t.device)
    kernel[(cdiv(rows, 64), cdiv(cols, 64))](t.contiguous(), row_divisors.float().contiguous(), out, rows, cols,
                                             E4M3_MAX, BLOCK_R=64, BLOCK_C=64, num_warps=4)  # fmt: skip
    return out


@cast_transpose_e4m3.register_fake
def _(t, row_divisors):
    return t.new_empty(t.shape[1], t.shape[0], dtype=E4M3)


@torch.library.custom_op("trainbench::fp8_grad_input", mutates_args=())
def fp8_grad_input(
    grad_q: torch.Tensor, grad_scale: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``grad_q * grad_scale`` [m, out] times the e4m3 weight [out, in]. One opaque op, so that a compiler cannot
    hoist the weight's transposed copy into the forward and keep one per layer alive until the backward."""
    ones = torch.ones(weight.shape[1], 1, device=weight.device)
    return scaled_mm(grad_q, grad_scale, transpose_fp8(weight), ones, dtype)


@fp8_grad_input.register_fake
def _(grad_q, grad_scale, weight, dtype):
    return grad_q.new_empty(grad_q.shape[0], weight.shape[1], dtype=dtype)


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, scale):
        shape = x.shape
        out_dtype = x.dtype if x.dtype != torch.float32 or not x.is_cuda else torch.bfloat16
        xq, xs = quantize_rows(x.reshape(-1, shape[-1]))
        y = scaled_mm(xq, xs, weight, scale, out_dtype)
        ctx.save_for_backward(weight, scale)
        ctx.in_dtype = x.dtype
        return y.reshape(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        shape = grad.shape
        gq, gs = quantize_rows(grad.reshape(-1, shape[-1]).float() * scale.t())
        # dx = gq @ Wq: Wq's transpose [in, out] as the second operand; a transient copy of this layer only.
        dx = fp8_grad_input(gq, gs, weight, ctx.in_dtype)
        return dx.reshape(*shape[:-1], weight.shape[1]), None, None


class _SiluMulFp8Saved(torch.autograd.Function):
    """``silu(gate) * up`` whose backward reads both inputs from e4m3 copies with one scale per row (half the bytes of
    bf16): a 70B block keeps 448 MiB of them instead of 896 MiB. The forward's output is exact; the gradients see the
    inputs rounded to FP8 (about 2^-4 relative), as the FP8 base's GEMMs already see their inputs."""

    @staticmethod
    def forward(ctx, gate, up):
        out = F.silu(gate) * up
        width = gate.shape[-1]
        gq, gs = quantize_rows(gate.detach().reshape(-1, width))
        uq, us = quantize_rows(up.detach().reshape(-1, width))
        ctx.save_for_backward(gq, gs, uq, us)
        ctx.shape, ctx.dtypes = gate.shape, (gate.dtype, up.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        gq, gs, uq, us = ctx.saved_tensors
        gate = (gq.float() * gs).reshape(ctx.shape)
        up = (uq.float() * us).reshape(ctx.shape)
        sig = torch.sigmoid(gate)
        grad = grad.float()
        d_gate = grad * up * sig * (1 + gate * (1 - sig))
        d_up = grad * gate * sig
        return d_gate.to(ctx.dtypes[0]), d_up.to(ctx.dtypes[1])


def silu_mul_fp8_saved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`trainbench.families.decoder.model.silu_mul` keeping its inputs for the backward in FP8 (where grad is
    on)."""
    if not torch.is_grad_enabled() or not (gate.requires_grad or up.requires_grad):
        return F.silu(gate) * up
    return _SiluMulFp8Saved.apply(gate, up)


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight is held as ``weight_fp8`` (e4m3) and ``weight_scale`` buffers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        y = _Fp8Matmul.apply(x.to(dtype), self.weight_fp8, self.weight_scale)
        return y if self.bias is None else y + self.bias.to(y.dtype)


@torch.no_grad()
def quantize_linear(module: nn.Linear, as_parameters: bool = False) -> None:
    """Turn a frozen ``nn.Linear`` into an :class:`Fp8Linear` in place (its forward hooks, e.g. LoRA, stay).
    ``as_parameters``: the FP8 weight and its scales as frozen parameters instead of buffers, which FSDP2 shards."""
    if module.weight.requires_grad:
        raise ValueError("only frozen weights are quantised: a trained weight needs its high-precision copy")
    q, s = quantize_rows(module.weight.detach())
    del module.weight
    if as_parameters:
        module.weight_fp8 = nn.Parameter(q, requires_grad=False)
        module.weight_scale = nn.Parameter(s, requires_grad=False)
    else:
        module.register_buffer("weight_fp8", q)
        module.register_buffer("weight_scale", s)
    module.__class__ = Fp8Linear


def quantize_frozen(model: nn.Module, skip: tuple[str, ...] = ("lm_head", "lora_A", "lora_B"),
                    as_parameters: bool = False) -> int:  # fmt: skip
    """Quantise every frozen linear layer of ``model`` whose name ends with none of ``skip``; returns how many."""
    count = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and not name.endswith(skip) and not module.weight.requires_grad:
            quantize_linear(module, as_parameters)
            count += 1
    return count


def dequantized(module: Fp8Linear) -> torch.Tensor:
    return module.weight_fp8.float() * module.weight_scale


# -- training in FP8 (weights that change every step) ------------------------------------------------------------
#
# The frozen-base path above quantises each weight once; a trained weight changes every step, and its gradient is
# wanted too. torchao's float8 training (the library torchtitan uses) does the three GEMMs of each linear layer in
# FP8 with scales computed from the tensors of the step; it is used as it is, not rewritten here.

TRAINING_RECIPE = "tensorwise"  # measured fastest of torchao's recipes on an 8B block (docs/llm.md)


def min_capability(device: torch.device, needed: tuple[int, int] = (8, 9), what: str = "FP8 tensor cores",
                   gpus: str = "Ada, Hopper, Blackwell") -> None:  # fmt: skip
    """FP8 GEMMs need tensor cores of compute capability 8.9 or newer (``what`` may need ``needed``, on ``gpus``);
    one sentence otherwise."""
    if device.type != "cuda":
        raise ConfigError(
            f"model.precision=fp8 trains on FP8 tensor cores: it needs an NVIDIA GPU, not the {device.type}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < needed:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"model.precision=fp8 needs {what} (compute capability {needed[0]}.{needed[1]} or newer: "
                          f"{gpus}); {name} has {major}.{minor}")  # fmt: skip


NO_TORCHAO = (
    "model.precision=fp8 uses torchao's float8 training, which is not installed: pip install -e '.[fp8]' in "
    "trainbench's clone"
)


def require(device: str) -> None:
    """One sentence, before any run folder is made, where ``model.precision=fp8`` cannot run: on the CPU, or without
    torchao. (The GPU's compute capability is checked where the model is placed: :func:`min_capability`.)"""
    import importlib.util

    if device == "cpu":
        raise ConfigError("model.precision=fp8 trains on FP8 tensor cores: it needs an NVIDIA GPU of compute "
                          "capability 8.9 or newer (device=cuda or auto), not the CPU")  # fmt: skip
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(NO_TORCHAO)


def in_decoder_blocks(name: str) -> bool:
    """A decoder's block layers (``model.layers.*``): not its output layer or embedding, nor a mixture of experts'
    router (which routes in fp32)."""
    return name.startswith("model.layers.") and not name.endswith(".router")


def train_blocks_in_fp8(model: nn.Module, recipe: str = TRAINING_RECIPE, sharded: bool = False,
                        in_blocks: Callable[[str], bool] = in_decoder_blocks) -> int:  # fmt: skip
    """Swap every linear layer whose name ``in_blocks`` accepts (by default a decoder's blocks, ``model.layers.*``)
    for torchao's ``Float8Linear``, on any device (the meta device included: before sharding and compilation, as
    torchao expects); the other layers stay as they are. Parameter names do not change. ``sharded``: FSDP2 will shard
    the weights, and gathers each in FP8 with its scale (half the bytes of a bf16 gather), the scales computed once a
    step after the optimizer (:func:`precompute_scales`). Returns how many layers were swapped."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(NO_TORCHAO) from None

    def chosen(module: nn.Module, name: str) -> bool:
        return (in_blocks(name) and isinstance(module, nn.Linear)
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)  # fmt: skip

    config = Float8LinearConfig.from_recipe_name(recipe)
    if sharded:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=chosen)
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def finish_placement(placed: Placed, sharded: bool, unchanged: str) -> None:
    """A placed model whose blocks train in FP8 (:func:`train_blocks_in_fp8`): the console's line on how many layers
    do and what stays as it was (``unchanged``), and, where FSDP2 shards it (``sharded``), the scales' update after
    each optimizer step. A decoder's output layer (``lm_head``) is named on whichever side it is: in FP8 where the
    model's loss says its products are (``output_in_fp8``: :func:`trainbench.families.decoder.fp8_output.lm_loss_fp8`,
    ``model.output_precision=fp8``)."""
    n = sum(type(m).__name__ == "Float8Linear" for m in placed.module.modules())
    head = getattr(placed.module, "lm_head", None)
    output = getattr(getattr(placed.module, "loss_fn", None), "output_in_fp8", False)
    if head is not None and not output:
        unchanged = f"the output layer and {unchanged}"
    also = ", the output layer and its loss too (FP8 products, the logits' gradient at a fixed scale)" if output else ""
    placed.notes.append(f"{n} linear layers of the blocks train in FP8 (torchao's float8 training, {TRAINING_RECIPE} "
                        f"scales){also}; {unchanged} as before")  # fmt: skip
    if sharded:
        placed.after_step = precompute_scales(placed.module)
        placed.notes.append("FSDP2 gathers their weights in FP8, the scales computed once a step after the optimizer")


def grad_as_fp32(grad: torch.Tensor) -> torch.Tensor:
    """A micro-batch's bf16 gradient of an fp32 weight as its first fp32 ``.grad``."""
    return grad.float()


def add_grad_into(total: torch.Tensor, grad: torch.Tensor) -> None:
    """A micro-batch's bf16 gradient added into the fp32 ``.grad`` ``total`` in one pass (compiled where it runs on
    CUDA: torch's eager kernels for mixed dtypes run at about 60 % of the bandwidth of the compiled ones)."""
    total.add_(grad)


def grad_adders(compiled: bool, adders: tuple[Callable, Callable] | None = None) -> tuple[Callable, Callable]:
    """``adders`` (None: :func:`grad_as_fp32` and :func:`add_grad_into`), compiled where ``compiled`` (one graph a
    weight's shape)."""
    return tuple(torch.compile(f, dynamic=False) if compiled else f for f in adders or (grad_as_fp32, add_grad_into))


def add_micro_batch_grad(w: torch.Tensor, grad: torch.Tensor, as_fp32: Callable, add_into: Callable) -> None:
    """A micro-batch's bf16 gradient ``grad`` of the fp32 weight ``w`` into ``w.grad``: cast into it by ``as_fp32``
    where it has none yet, else added in one pass by ``add_into`` (:func:`grad_adders`)."""
    with torch.no_grad():
        if w.grad is None:
            w.grad = as_fp32(grad)
        else:
            add_into(w.grad, grad)


def grad_leaf(t: torch.Tensor, w: torch.Tensor, as_fp32: Callable, add_into: Callable,
              transposed: bool = False) -> torch.Tensor:  # fmt: skip
    """``t``, which products read in the place of the fp32 weight ``w`` (a cast of it made beforehand, or a stand-in
    with no values), as a leaf of autograd of its own: each time autograd has accumulated its bf16 gradient (one a
    micro-batch; ``transposed``: of ``w.t()``), a hook adds that into ``w.grad`` in one pass and drops it
    (:func:`add_micro_batch_grad`). Autograd would cast the bf16 gradient to fp32 in a pass of its own and add that
    copy in another: 8 bytes more a weight in every micro-batch after the first, for the same sum bit for bit. A
    leaf's accumulation runs as soon as its gradient is made (autograd ranks accumulation above every other node), so
    each block's weight gradients are added and freed as the backward leaves the block; a node made before the first
    block (as by a pre-hook of the model) would run only once the whole backward is done, and hold them all until
    then (docs/notes/llm.md)."""
    leaf = t.detach().requires_grad_()

    def add(leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        add_micro_batch_grad(w, grad.t() if transposed else grad, as_fp32, add_into)

    leaf.register_post_accumulate_grad_hook(add)
    return leaf


def _float8_forward(self, input: torch.Tensor) -> torch.Tensor:
    """torchao's ``Float8Linear.forward`` with the weight's cast made once a step (``_trainbench_weight_t``, set by
    :func:`cast_weights_once_a_step` before each forward of the model) where there is one."""
    cast_t = getattr(self, "_trainbench_weight_t", None)
    if cast_t is None:
        return type(self).forward(self, input)
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    if torch.is_autocast_enabled():  # as torchao's forward: the output in the autocast precision
        input = input.to(torch.get_autocast_gpu_dtype())
    output = matmul_with_hp_or_float8_args.apply(input, cast_t, self.linear_mm_config, self.config)
    return output if self.bias is None else output + self.bias.to(output.dtype)


def _weight_bytes(w: torch.Tensor, float8_dtype: torch.dtype, round_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 weight ``w`` (2-D) cast as torchao casts it, by torchao's own functions: its scale from its absolute
    maximum (computed in float64, the same compiled or not) and its bytes, saturated. The maximum is taken a row at a
    time, then over the rows' (the same value: a maximum is exact in any order): compiled for every size, one
    reduction over the whole tensor ran as one program on one SM (about 5 ms for flux1's 3,072 x 12,288 weights), the
    rows spread it over the GPU."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    amax = w.abs().amax(dim=-1).amax()
    scale = amax_to_scale(amax, float8_dtype, round_scales_to_power_of_2=round_scales)
    return to_fp8_saturated(w.to(torch.float32) * scale, float8_dtype), scale


@functools.cache
def _compiled_weight_bytes() -> Callable:
    """:func:`_weight_bytes` compiled once for every weight's size (dynamic)."""
    return torch.compile(_weight_bytes, dynamic=True)


def _weight_cast(m: nn.Module, compiled: bool = False) -> torch.Tensor:
    """``m.weight.t()`` cast as torchao's float8 layer casts it in each call (the same amax, scale and bytes), as a
    tensor that reports bf16: the precision of the products' gradients, so that none is cast on its way back. The cast
    reads the weight in its own (row-major) order and the result is transposed as a view, the layout torchao's cast of
    the transposed weight has. ``compiled`` (a CUDA weight): two compiled passes, the maximum then the cast, in place
    of torch's eager kernels, a pass each for the absolute value, the maximum, the product, the clamp and the cast
    (docs/flux1.md, "The weights cast once a step")."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    c = m.config.cast_config_weight
    w = m.weight.detach()
    cast = _compiled_weight_bytes() if compiled and w.is_cuda else _weight_bytes
    data, scale = cast(w, c.target_dtype, m.config.round_scales_to_power_of_2)
    return Float8TrainingTensor(data.t(), scale, torch.bfloat16, m.linear_mm_config,
                                GemmInputRole.WEIGHT, None)  # fmt: skip


def once_a_step(weights: Callable[[], list[torch.Tensor]],
                recast: Callable[[], None]) -> tuple[Callable[[], None], Callable[[], None]]:  # fmt: skip
    """The bookkeeping of casts made once a step: ``(refresh, after_step)``. ``refresh`` runs ``recast`` (without
    autograd) where the casts are due: after ``after_step`` has marked them stale (the fused optimizer updates the
    weights without touching their version counters, so the step itself must say so), or where one of ``weights()``
    changed its version or storage otherwise, as a checkpoint's load does."""
    state: dict = {"stale": True, "seen": None}

    def seen() -> list[tuple[int, int]]:
        return [(w._version, w.data_ptr()) for w in weights()]

    def refresh() -> None:
        if state["stale"] or state["seen"] != seen():
            with torch.no_grad():
                recast()
            state.update(stale=False, seen=seen())

    def after_step() -> None:
        state["stale"] = True

    return refresh, after_step


def cast_weights_once_a_step(model: nn.Module, compiled: bool = True) -> Callable[[], None] | None:
    """The FP8 layers of ``model`` (torchao's ``Float8Linear``, tensorwise scales, one unsharded rank without data
    parallelism: the weights' gradients do not pass through autograd's accumulation, which DDP's hooks watch) cast
    their weights once a step instead of in each micro-batch's forward and again in its backward: before a forward
    of ``model``, each weight whose value changed since its last cast is cast as torchao casts it, and handed to the
    layer as a leaf of its own (:func:`grad_leaf`), whose gradient is added into the weight's fp32 ``.grad`` in one
    pass as soon as it is made (``compiled``: the add compiled, on CUDA). torchao's matmul takes a weight already in
    FP8 as it is, in the forward and for the input's gradient. The casts hold a byte a weight. Returns what must run
    after every optimizer step (the fused optimizer leaves the weights' version counters alone, so the step itself
    marks the casts stale; a weight's version or storage changed otherwise, as by a checkpoint's load, marks them
    too); None where no layer qualifies (no FP8 layer, or not tensorwise). Blocks that keep their saved tensors in
    host memory (``models.offload``) are left to torchao's casts in each call."""
    from torchao.float8.config import ScalingGranularity

    layers = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    layers = [m for m in layers if m.config.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE
              and m.config.cast_config_weight_for_grad_input == m.config.cast_config_weight]  # fmt: skip
    if not layers:
        return None
    gradients = grad_adders(compiled)
    casts: dict = {}

    def recast() -> None:
        casts.update({m: grad_leaf(_weight_cast(m, compiled), m.weight, *gradients, transposed=True) for m in layers})

    refresh_casts, after_step = once_a_step(lambda: [m.weight for m in layers], recast)
    state: dict = {}  # whether the blocks keep their saved tensors in host memory, seen at the first forward

    def refresh(module: nn.Module, args) -> None:
        if state.setdefault("offloaded", any(getattr(b, "saved_to_host", None) is not None for b in model.modules())):
            return  # (blocks whose saved tensors go to the host: their layers cast in each call, as torchao does)
        refresh_casts()
        for m in layers:
            m._trainbench_weight_t = casts[m]

    for m in layers:
        m.forward = _float8_forward.__get__(m)
    model.register_forward_pre_hook(refresh)
    return after_step


def cast_placed_weights_once_a_step(placed: Placed, model: nn.Module, compiled: bool) -> None:
    """:func:`cast_weights_once_a_step` on ``model`` (the hook's module: one rank's whole model, or its compiled
    wrapper, whose hooks run eagerly outside the graph), its casts marked stale after every step of ``placed``, and
    the console told, where any layer qualifies."""
    after_step = cast_weights_once_a_step(model, compiled)
    if after_step is not None:
        placed.also_after_step(after_step)
        placed.notes.append("their weights cast to FP8 once a step, their gradients added into fp32 in one pass")


def precompute_scales(model: nn.Module) -> Callable[[], None]:
    """What runs after each optimizer step of a model whose FP8 weights FSDP2 gathers in FP8: every weight's scale from
    its amax over all ranks' shards, in one all-reduce, so that the next step's gathers need none of their own. The
    step's FP8 shards are then cast once, at the step's first gather, and reused by its other gathers (each
    micro-batch's forward, and the backward's where a block is resharded after its forward): the weights and their
    scales change only at the optimizer step, and this function, run right after it, drops the cached casts."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    _cache_fp8_shards(WeightWithDynamicFloat8CastTensor)
    shards = [getattr(p, "_local_tensor", p) for p in model.parameters()]  # (torchao sets scales on these)
    shards = [s for s in shards if isinstance(s, WeightWithDynamicFloat8CastTensor)]

    def drop_casts() -> None:  # the next gather casts the stepped weight with its new scale
        for shard in shards:
            shard._trainbench_cast = None

    def after_step() -> None:
        precompute_float8_dynamic_scale_for_fsdp(model)
        drop_casts()

    drop_casts()  # (and marks the shards as tracked)
    return after_step


def _cache_fp8_shards(cls) -> None:
    """Wrap (once) torchao's ``fsdp_pre_all_gather`` of an FP8-gathered weight so that, for a shard that
    :func:`precompute_scales` tracks (``_trainbench_cast`` set) and has a precomputed scale, the cast is kept and
    returned again until that scale is replaced; every other shard is cast as torchao casts it."""
    if getattr(cls.fsdp_pre_all_gather, "_trainbench_cached", False):
        return
    cast = cls.fsdp_pre_all_gather

    def fsdp_pre_all_gather(self, mesh):
        scale = self._precomputed_scale
        if scale is None or not hasattr(self, "_trainbench_cast"):
            return cast(self, mesh)
        kept = self._trainbench_cast
        if kept is None or kept[0] is not scale:
            kept = self._trainbench_cast = (scale, cast(self, mesh))
        return kept[1]

    fsdp_pre_all_gather._trainbench_cached = True
    cls.fsdp_pre_all_gather = fsdp_pre_all_gather
