"""The experts' grouped products in FP8 (``model.precision=fp8``): a speed path of the mixture of experts
(:class:`~trainbench.families.decoder.moe.MoE`), set on each layer by the placement (:func:`experts_in_fp8`) as its
``expert_product``.

The forward and the input's gradient are FP8 grouped products (torch's ``_scaled_grouped_mm``: e4m3, a power-of-two
scale per row and per expert's output column), and the weights' gradient one too, with a scale per expert
(``model.expert_weight_grad=fp8``, :func:`fp8_weight_grad`), or a bf16 one (:class:`_FP8Grouped`). FP8's grouped
product needs each expert's rows to start on a multiple of 16: the layer pads each expert's group of rows to that
(``MoE.align_rows``). The weights' casts may be made once a step instead of in every micro-batch
(:func:`cache_fp8_weight_casts`). CUDA only (Hopper and newer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from trainbench.distributed import exchange_rows
from trainbench.families.decoder.moe import MoE
from trainbench.families.fp8 import (
    E4M3,
    E4M3_MAX,
    add_grad_into,
    cast_transpose_e4m3,
    grad_adders,
    grad_as_fp32,
    grad_leaf,
    min_capability,
    once_a_step,
)
from trainbench.families.triton_kernels import lazy_kernel

ALIGN_ROWS = 16  # FP8's grouped product: each expert's rows start on a multiple of this


def _e4m3(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in e4m3 with a scale per slice along ``dim`` (a power of two: the slice's largest magnitude brought
    just under 448), and the scales' reciprocals (what multiplies the product back), ``dim`` squeezed out."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    q = (t.detach().float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.reciprocal().squeeze(dim)


@functools.cache
def _compiled_row_cast() -> Callable:
    """:func:`_e4m3` compiled for a fixed row width and any number of rows (:func:`_rows_e4m3` marks the rows
    dynamic): one graph a width. With every dimension dynamic, as first written, the width was unknown to the
    compiler and the cast ran at about a fifth of the memory's bandwidth (docs/notes/node.md)."""
    return torch.compile(_e4m3, dynamic=False)


def _rows_e4m3(t: torch.Tensor, compiled: bool | str = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_e4m3` along the rows of ``t`` [rows, n]. Inside a compiled block the plain tensor operations, which
    the compiler fuses into the kernels that make ``t``. Outside one on CUDA, where ``compiled`` (the run compiles
    its blocks, and the expert-parallel dispatch runs outside them), one compiled function for every number of rows:
    torch's eager operations made a float32 copy of the rows and took 5 passes over it, the largest cost of FP8's
    experts under expert parallelism (docs/notes/node.md). Where ``compiled`` is ``"kernel"``
    (``distributed.expert_row_casts=kernel``), bf16 rows there go through one Triton pass a row instead
    (:func:`_wire_cast`, the same values): the compiled function reads each row twice."""
    if compiled == "kernel" and t.is_cuda and t.dtype == torch.bfloat16 and not torch.compiler.is_compiling():
        q, exponent = _wire_cast(t)
        return q, torch.exp2(exponent.float())
    if not compiled or not t.is_cuda or torch.compiler.is_compiling():
        return _e4m3(t, -1)
    torch._dynamo.maybe_mark_dynamic(t, 0)
    return _compiled_row_cast()(t, -1)


def _e4m3_with_exponent(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_e4m3` along the rows of ``t`` [rows, n], each row's scale's reciprocal given by its base-2 exponent as
    one signed byte [rows] (the reciprocal is ``2 ** exponent`` exactly: the scale is a power of two)."""
    amax = t.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    exponent = torch.floor(torch.log2(E4M3_MAX / amax))
    q = (t.detach().float() * torch.exp2(exponent)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, (-exponent).squeeze(-1).to(torch.int8)


def _from_e4m3(q: torch.Tensor, exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``q`` [rows, n] in e4m3 times ``2 ** exponent`` [rows], in ``dtype`` (bf16 or wider holds every such value
    exactly)."""
    return (q.float() * torch.exp2(exponent.float())[:, None]).to(dtype)


def _define_wire_kernels(triton, tl):
    """One pass a row each way: a row cast to e4m3 with its exponent (:func:`_e4m3_with_exponent`), and rebuilt."""

    @triton.jit
    def tb_rows_to_e4m3(src, q_out, e_out, width, limit, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        inside = c < width
        x = tl.load(src + row * width + c, mask=inside, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)
        # floor(log2(448 / amax)) from amax's bits: 448 is 1.75 x 2**8, so it is 8 less amax's exponent, and one less
        # where amax's mantissa is above 1.75 (what torch's division and log2 give for a bf16 row's largest value)
        bits = amax.to(tl.int32, bitcast=True)
        k = 135 - ((bits >> 23) & 0xFF) - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        scale = ((k + 127) << 23).to(tl.float32, bitcast=True)  # 2 ** k
        q = tl.clamp(x * scale, -limit, limit)
        tl.store(q_out + row * width + c, q.to(q_out.dtype.element_ty), mask=inside)
        tl.store(e_out + row, (-k).to(tl.int8))

    @triton.jit
    def tb_e4m3_to_rows(q_in, e_in, dst, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        inside = c < width
        q = tl.load(q_in + row * width + c, mask=inside, other=0.0).to(tl.float32)
        recip = ((tl.load(e_in + row).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)  # 2 ** exponent
        tl.store(dst + row * width + c, (q * recip).to(dst.dtype.element_ty), mask=inside)

    return tb_rows_to_e4m3, tb_e4m3_to_rows


_wire_kernels = lazy_kernel(_define_wire_kernels)


def _wire_cast(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_e4m3_with_exponent` of ``t`` [rows, n]: on CUDA for bf16 rows one Triton pass a row (the compiled
    function reads each row twice, once for its largest value and once to cast it: 0.45 ms for 65,536 rows of 2,880
    on an H200, 2.4 times a bf16 copy of them; docs/gpt_oss.md); elsewhere torch's operations."""
    built = _wire_kernels() if t.is_cuda and t.dtype == torch.bfloat16 and t.dim() == 2 else None
    if built is None:
        return _e4m3_with_exponent(t)
    rows, width = t.shape
    q = torch.empty(rows, width, dtype=E4M3, device=t.device)
    exponent = torch.empty(rows, dtype=torch.int8, device=t.device)
    _by_row(built[0][0], rows, width, t.contiguous(), q, exponent, width, E4M3_MAX)
    return q, exponent


def _wire_uncast(q: torch.Tensor, exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_from_e4m3`: on CUDA to bf16 one Triton pass a row; elsewhere torch's operations."""
    built = _wire_kernels() if q.is_cuda and dtype == torch.bfloat16 and q.dim() == 2 else None
    if built is None:
        return _from_e4m3(q, exponent, dtype)
    rows, width = q.shape
    out = torch.empty(rows, width, dtype=dtype, device=q.device)
    _by_row(built[0][1], rows, width, q.contiguous(), exponent.contiguous(), out, width)
    return out


def _by_row(kernel, rows: int, width: int, *args) -> None:
    """``kernel`` launched with one program a row (none for no rows), a row of ``width`` in one block."""
    if rows:
        block = 1 << (width - 1).bit_length()
        kernel[(rows,)](*args, BLOCK=block, num_warps=8 if block > 2048 else 4)


def expert_parallel_cast_seconds(rows: int, hidden: int, ffn: int, device: torch.device,
                                  row_casts: bool = True) -> dict[str, float]:  # fmt: skip
    """Seconds on ``device`` (CUDA) of the casts that expert parallelism in FP8 adds outside the compiled blocks, a
    block and micro-batch, at ``rows`` rows (each token's top-k choices): where ``row_casts``, the experts' products'
    four row casts (the rows and the activation forward, the two products' output gradients backward; widths
    ``hidden``, ``ffn``, ``hidden``, ``2 ffn``), compiled (``compiled_s``) and by the kernel (``kernel_s``); and the
    FP8 wire's cast and rebuild of the rows of its two exchanges (``wire_s``). Each the median of 5 calls after one."""

    def timed(fn: Callable[[], object]) -> float:
        fn()  # (compiles, or builds the kernel)
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[2]

    out = {"compiled_s": 0.0, "kernel_s": 0.0} if row_casts else {}
    for width in (hidden, ffn, hidden, 2 * ffn) if row_casts else ():
        t = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
        out["compiled_s"] += timed(lambda: _rows_e4m3(t, True))  # noqa: B023 (called before the loop moves on)
        out["kernel_s"] += timed(lambda: _rows_e4m3(t, "kernel"))  # noqa: B023
    t = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    q, exponent = _wire_cast(t)
    out["wire_s"] = 2 * (timed(lambda: _wire_cast(t)) + timed(lambda: _wire_uncast(q, exponent, t.dtype)))
    return out


def _exchange_e4m3(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """:func:`trainbench.distributed.exchange_rows` with each row sent in e4m3 and its scale's exponent (a byte a
    value and one a row, against bf16's two a value), arriving in ``t``'s dtype: the row as FP8's grouped product
    casts it (:func:`_e4m3` with a power-of-two scale per row). Its cast there then gives the same e4m3 values, or
    each doubled with its scale halved (a row whose largest magnitude rounded down to 224): the same products."""
    q, exponent = _wire_cast(t)
    q = exchange_rows(q.view(torch.uint8), out_splits, in_splits, group).view(E4M3)
    return _wire_uncast(q, exchange_rows(exponent, out_splits, in_splits, group), t.dtype)


class _ExchangeInFP8(torch.autograd.Function):
    """:meth:`MoE.to_experts`'s exchange with one way in e4m3 on the wire (:func:`_exchange_e4m3`) and the other in
    the rows' own dtype: the forward's where ``forward_fp8`` (the rows to the experts), else the backward's (the
    gradients of the experts' outputs on their way to the experts: as FP8's grouped product casts them for the
    input's gradient and the weights', whose cast per expert from those rows gives the same values but where a value
    falls among e4m3's subnormals; the output biases take their gradient from the rows as they arrive)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                forward_fp8: bool) -> torch.Tensor:  # fmt: skip
        ctx.splits, ctx.group, ctx.backward_fp8 = (in_splits, out_splits), group, not forward_fp8
        return (_exchange_e4m3 if forward_fp8 else exchange_rows)(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send = _exchange_e4m3 if ctx.backward_fp8 else exchange_rows
        return send(grad, *ctx.splits, ctx.group), None, None, None, None


def exchange_in_fp8(moe: MoE) -> None:
    """``moe``'s expert-parallel exchange with FP8 on the wire (``distributed.expert_exchange=fp8``,
    :class:`_ExchangeInFP8`): the rows to the experts in e4m3, and the gradients of the experts' outputs on their way
    back to them; the outputs and the rows' gradients stay in bf16. Half the bytes of two of the four
    all-to-alls a block and micro-batch, for a cast before and a rebuild after each (:func:`_wire_cast`). The forward
    is the same to the bit: the rows arrive as the grouped product casts them."""
    moe.to_experts = functools.partial(_fp8_one_way, True)
    moe.from_experts = functools.partial(_fp8_one_way, False)


def _fp8_one_way(forward_fp8: bool, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                 group) -> torch.Tensor:  # fmt: skip
    """:class:`_ExchangeInFP8` with :meth:`MoE.to_experts`'s signature (``apply`` takes no keywords)."""
    return _ExchangeInFP8.apply(rows, out_splits, in_splits, group, forward_fp8)


def _weight_for_forward(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weights ``w`` [groups, a, b] in e4m3 with a scale per (group, output column), each group's matrix
    column-major, as the FP8 grouped product requires; and the scales' reciprocals."""
    qw, sw = _e4m3(w, -2)
    return qw.transpose(-2, -1).contiguous().transpose(-2, -1), sw


def _weight_for_input_grad(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` in e4m3 with a scale per (group, row): ``w^T``'s output columns are ``w``'s rows, and row-major ``w`` is
    column-major ``w^T``; and the scales' reciprocals."""
    return _e4m3(w, -1)


def fp8_weight_casts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts' weights ``w`` as :class:`_FP8Grouped` multiplies them, for the forward and for the input's
    gradient (each cast with its scales' reciprocals)."""
    return *_weight_for_forward(w), *_weight_for_input_grad(w)


def _group_scaled_transpose(t: torch.Tensor, row_scales: torch.Tensor, group: torch.Tensor,
                            groups: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``t`` [rows, n] (rows sorted by group, ``group`` [rows] each one's) transposed into e4m3 [n, rows], row-major,
    with one power-of-two scale a group: that of its largest row, whose reciprocal ``row_scales`` [rows] (from
    :func:`_e4m3` along the rows) holds; and the groups' reciprocals [groups] (1 for a group of no rows)."""
    recip = row_scales.new_ones(groups).scatter_reduce(0, group, row_scales, "amax", include_self=False)
    return cast_transpose_e4m3(t.detach(), recip[group]), recip


def fp8_weight_grad(x: torch.Tensor, x_scales: torch.Tensor, grad: torch.Tensor, grad_scales: torch.Tensor,
                    group: torch.Tensor, groups: int, offsets: torch.Tensor,
                    fast_accum: bool = True) -> torch.Tensor:  # fmt: skip
    """The experts' weights' gradient [groups, a, b], each group's ``x^T grad`` over its rows (``x`` [rows, a],
    ``grad`` [rows, b], sorted by group, ``offsets`` the groups' ends) as one FP8 grouped product: both operands in
    e4m3 with a power-of-two scale per group (the sum runs along the rows, so the scale cannot vary along them),
    found from the rows' own scales (``x_scales``, ``grad_scales``: the reciprocals the row casts made). Fast
    accumulation (``fast_accum``), as the other products: against full fp32 sums it measured the same error at 4,096
    and 32,768 rows a group (docs/gpt_oss.md), the operands' rounding being most of it."""
    qx, rx = _group_scaled_transpose(x, x_scales, group, groups)
    qg, rg = _group_scaled_transpose(grad, grad_scales, group, groups)
    a, b = x.shape[1], grad.shape[1]
    return torch._scaled_grouped_mm(qx, qg.t(), rx[:, None].expand(groups, a).reshape(-1),
                                    rg[:, None].expand(groups, b).reshape(-1), offs=offsets,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum)  # fmt: skip


class _FP8Grouped(torch.autograd.Function):
    """``x`` [rows, a] (bf16, sorted by group, each group's rows ending at ``offsets``, every group a multiple of 16
    rows) times its group's ``w`` [groups, a, b]: the forward and the input's gradient as FP8 grouped products
    (torch's ``_scaled_grouped_mm``; e4m3, a scale per row of the left operand and per output column of each group's
    right one). The weights' gradient is one too where ``group`` (each row's group) is given
    (:func:`fp8_weight_grad`), else a bf16 grouped product. The casts are plain tensor operations, which a compiled
    block fuses into the kernels that make their inputs (the rows' gather, the activation, the gradients' gathers).
    ``casts``: ``w``'s casts (:func:`fp8_weight_casts`) made once a step rather than in every micro-batch's forward
    and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                casts: tuple[torch.Tensor, ...] | None = None, group: torch.Tensor | None = None,
                compiled_casts: bool | str = False) -> torch.Tensor:  # fmt: skip
        qx, sx = _rows_e4m3(x, compiled_casts)
        ctx.cast_weights, ctx.compiled_casts = casts is None, compiled_casts
        if casts is None:
            qw, sw = _weight_for_forward(w)
            weight = ()
        else:
            qw, sw = casts[:2]
            weight = casts[2:]
        ctx.fp8_weight_grad = group is not None
        rows = (sx, group) if group is not None else ()
        ctx.save_for_backward(x, w, offsets, *rows, *weight)
        return torch._scaled_grouped_mm(qx, qw, sx, sw, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, offsets, *rest = ctx.saved_tensors
        sx, group = rest[:2] if ctx.fp8_weight_grad else (None, None)
        cast = rest[2:] if ctx.fp8_weight_grad else rest
        grad = grad.contiguous()
        qg, sg = _rows_e4m3(grad, ctx.compiled_casts)
        qw, sw = _weight_for_input_grad(w) if ctx.cast_weights else cast
        grad_x = torch._scaled_grouped_mm(qg, qw.transpose(-2, -1), sg, sw, offs=offsets, out_dtype=torch.bfloat16,
                                          use_fast_accum=True)  # fmt: skip
        if ctx.fp8_weight_grad:
            grad_w = fp8_weight_grad(x, sx, grad, sg, group, w.shape[0], offsets)
        else:
            grad_w = torch._grouped_mm(x.transpose(0, 1), grad.to(x.dtype), offs=offsets)
        return grad_x, grad_w, None, None, None, None


def fp8_product(moe: MoE, weight_grad_fp8: bool, compiled_casts: bool | str, x: torch.Tensor, w: torch.Tensor,
                counts: torch.Tensor, group: torch.Tensor, name: str) -> torch.Tensor:  # fmt: skip
    """``MoE.expert_product`` in FP8 (:class:`_FP8Grouped`: CUDA, bf16 rows, every count a multiple of 16), the
    weights' casts those made beforehand where there are (:func:`_casts`); the weights' gradient in FP8 too where
    ``weight_grad_fp8`` (from ``group``, each row's expert), else in bf16; the rows' casts compiled where they run
    outside a compiled block where ``compiled_casts`` (:func:`_rows_e4m3`)."""
    casts = _casts(moe, name, w)
    # Where the weights are read through their casts, their gradients go to their stand-ins (if this forward takes
    # gradients)
    if casts is not None:
        w = moe._grad_standins.get(name, w)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return _FP8Grouped.apply(x, w, offsets, casts, group if weight_grad_fp8 else None, compiled_casts)


def _casts(moe: MoE, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The FP8 casts of ``moe``'s weight ``name`` made once a step (:func:`cache_fp8_weight_casts`), where ``weight``
    is that parameter itself or, under expert parallelism, this rank's share of it (what
    ``MoE._experts_parallel`` hands on; the casts are of that share), and they exist; else None (cast in each
    call)."""
    if f"_fp8_{name}_0" not in moe._buffers:
        return None
    if weight is not moe.get_parameter(name) and moe.ep_group is None:
        return None
    return tuple(moe._buffers[f"_fp8_{name}_{i}"] for i in range(4))


def in_fp8(moe: MoE) -> bool:
    """Whether ``moe`` multiplies its experts in FP8 (:func:`fp8_product`)."""
    product = vars(moe).get("expert_product")
    return isinstance(product, functools.partial) and product.func is fp8_product


def fp8_products(moe: MoE, weight_grad: str = "fp8", compiled_casts: bool | str = False) -> None:
    """``moe``'s experts multiplied in FP8 (:func:`fp8_product`, set as its ``expert_product``), its groups aligned
    to 16 rows, the weights' gradient in ``weight_grad`` (fp8 or bf16), the rows' casts outside a compiled block
    compiled where ``compiled_casts`` (``"kernel"``: by one Triton pass a row, :func:`_rows_e4m3`). No check of the
    device: :func:`experts_in_fp8` makes it."""
    moe.expert_product = functools.partial(fp8_product, moe, weight_grad == "fp8", compiled_casts)
    moe.align_rows = ALIGN_ROWS
    # With the weights' FP8 casts made once a step (cache_fp8_weight_casts): for each weight, where this forward
    # takes gradients, the tensor its products take the place of the weight with (_fp32_grad_stand_in)
    moe._grad_standins = {}


def _fp32_grad_stand_in(w: torch.Tensor, as_fp32: Callable = grad_as_fp32,
                        add_into: Callable = add_grad_into) -> torch.Tensor:  # fmt: skip
    """What stands in for an fp32 weight ``w`` in products that read it through casts made beforehand and give its
    gradient in bf16 (:class:`_FP8Grouped` with ``casts``): a bf16 tensor of ``w``'s shape with no storage of its own
    (zero strides), a leaf whose gradient is added into ``w.grad`` in one pass as soon as autograd has it, reading the
    bf16 values as they are (:func:`fp8.grad_leaf`; the first micro-batch's gradient cast into ``w.grad`` by
    ``as_fp32``, the next added by ``add_into``). Compile the two functions on CUDA: torch's eager kernels for mixed
    dtypes run at about 60 % of the bandwidth of the compiled ones."""
    values = torch.empty_strided(w.shape, (0,) * w.dim(), dtype=torch.bfloat16, device=w.device)
    return grad_leaf(values, w, as_fp32, add_into)


def _own_share(w: torch.Tensor) -> torch.Tensor:
    """``w`` itself, or this rank's share of it where expert parallelism spread it (a DTensor), without autograd."""
    return w.to_local().detach() if hasattr(w, "to_local") else w.detach()


def cache_fp8_weight_casts(model: nn.Module, compiled: bool = True) -> Callable[[], None]:
    """The FP8 experts of ``model`` cast their weights once a step instead of in each micro-batch's forward and
    backward: before a forward of ``model``, each :class:`MoE`'s weights (on one unsharded rank, or each rank's share
    of the experts under expert parallelism, which FSDP2 leaves alone) are cast (:func:`fp8_weight_casts`, compiled
    where ``compiled``) into buffers that its grouped products read, where the weights changed since the last casts.
    On one rank a forward that takes gradients hands the products a stand-in for each weight
    (:func:`_fp32_grad_stand_in`), through which their bf16 gradients are added into the fp32 ``.grad`` directly;
    under expert parallelism the gradients take autograd's way back to the shared weight, as uncached. Returns what
    must run after every optimizer step: the fused optimizer updates the weights without touching their version
    counters, so the step itself marks the casts stale (a weight's version or storage that changed otherwise, as a
    checkpoint's load does, marks them too)."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and in_fp8(m)]
    names = ("gate_up_proj", "down_proj")
    cast = torch.compile(fp8_weight_casts, dynamic=False) if compiled else fp8_weight_casts
    gradients = grad_adders(compiled)

    def refresh(module: nn.Module, args) -> None:
        refresh_casts()
        grads = torch.is_grad_enabled()
        for m in layers:  # new stand-ins for each forward: the hook of each adds that micro-batch's gradient
            standins = grads and m.ep_group is None
            m._grad_standins = {n: _fp32_grad_stand_in(w, *gradients) for n in names
                                if standins and (w := m.get_parameter(n)).requires_grad}  # fmt: skip

    def recast() -> None:
        for m in layers:
            for name in names:
                for i, t in enumerate(cast(_own_share(m.get_parameter(name)))):
                    key = f"_fp8_{name}_{i}"
                    if key in m._buffers:
                        m._buffers[key].copy_(t)
                    else:
                        m.register_buffer(key, t, persistent=False)

    refresh_casts, after_step = once_a_step(
        lambda: [_own_share(m.get_parameter(n)) for m in layers for n in names], recast
    )

    model.register_forward_pre_hook(refresh)
    return after_step


def experts_in_fp8(model: nn.Module, device: torch.device, weight_grad: str = "fp8",
                   compiled_casts: bool = False) -> int:  # fmt: skip
    """Every :class:`MoE` of ``model`` multiplies its experts in FP8 (:func:`fp8_products`), its groups aligned to 16
    rows, the weights' gradient in ``weight_grad`` (fp8 or bf16), the rows' casts outside a compiled block compiled
    where ``compiled_casts`` (the run compiles its blocks); returns how many. torch's FP8 grouped product runs on
    Hopper (compute capability 9.0) and newer."""
    if weight_grad not in ("fp8", "bf16"):
        raise ValueError(f"the experts' weight gradient is fp8 or bf16, not {weight_grad!r}")
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if layers:
        min_capability(device, (9, 0), "the experts' FP8 grouped products", "Hopper, Blackwell")
    for moe in layers:
        fp8_products(moe, weight_grad, compiled_casts)
    return len(layers)
