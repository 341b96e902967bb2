"""attn's kernels as a ``torch.autograd.Function``, so PyTorch training can use them.

    import attn.torch
    out = attn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()   # q.grad, k.grad, v.grad from attn's fused backward

Same arguments as ``attn.scaled_dot_product_attention``; a float32 ``attn_mask`` that
requires grad receives its gradient too (summed over its broadcast dimensions). For
float32 inputs the arithmetic follows ``torch.get_float32_matmul_precision()`` unless
``precision`` says otherwise: "highest" computes in float32, "high" splits each value
into two bfloat16 pieces ("bf16x3", ~5e-6 relative error, about twice as fast on CPUs
with AMX tiles), "medium" rounds to bfloat16. With
``dropout_p > 0`` the forward draws a seed (or takes ``seed``) and the backward reuses it.
The backward is once-differentiable, as PyTorch's own fused attention kernels: asking
for a second derivative raises instead of silently returning zero. bfloat16 and float16
calls on the CPU keep their output before its rounding (float32, out's size again until
the backward) and take the backward's D = rowsum(dO ∘ O) from it, not from the rounded
output as FlashAttention and PyTorch do: on sharply peaked softmax rows that rounding
otherwise dominates dq and dk (attn/attention.hpp, "Dtypes"). The returned output is
the same either way. ``attn::sdpa``'s third output carries it (empty for other calls).

With PyTorch 2.4 or later the forward and backward are also registered as
``torch.library`` custom operators, ``attn::sdpa`` and ``attn::sdpa_backward``, with fake
(meta) implementations and autograd, so ``torch.compile`` traces a model that calls
``attn.torch.scaled_dot_product_attention`` without graph breaks (and
``torch.library.opcheck`` passes); ``attn.torch.varlen_attention``, the packed
variable-length attention with gradients, is ``attn::varlen`` and
``attn::varlen_backward``. Eager calls on CPU tensors skip the operator's dispatch, which costs more than the kernel of a short sequence: they call the kernels
directly, through the ``torch.autograd.Function`` below when a gradient is wanted,
with the same results. Older PyTorch (Debian's 1.13) always takes that path.
"""

import secrets

import numpy as _np
import torch as _torch
from torch.autograd.function import once_differentiable as _once_differentiable

import attn as _attn

# The 16-bit dtypes whose CPU calls keep a float32 output for the backward (_Attention).
_NARROW = (_torch.bfloat16, _torch.float16)


def _keeps_wide_out(query):
    """Whether a call keeps its float32 output for the backward (_Attention's reason)."""
    return query.dtype in _NARROW and not query.is_cuda


class _Attention(_torch.autograd.Function):
    # A lean call (options _attn._lean_options takes, eager on plain CPU tensors, no
    # gradient wanted for the mask) runs on the kernels' positional entries
    # (_attn._forward_fast, _attn._backward_fast), which at one token cost a fraction of
    # the checked path's conversions. Any other CPU call, or a lean one the kernels
    # reject, checks and converts its arguments once (attn._prepare_call) and keeps
    # the checked call with its NumPy out and lse for the backward, which then
    # converts only grad_out. CUDA tensors (here with PyTorch older than 2.4, which
    # has no custom operators) take the public functions.
    # bfloat16 and float16 calls on the CPU keep the output before its rounding (float32)
    # for the backward, which takes D = rowsum(dO ∘ O) from it: D from the rounded output
    # (FlashAttention's and PyTorch's way) can dominate dq and dk on sharply peaked rows
    # (attn/attention.hpp, "Dtypes"). It costs out's size again in float32 until the
    # backward.
    @staticmethod
    def forward(ctx, query, key, value, attn_mask, options, lean):
        mask = None if attn_mask is None else attn_mask.detach()
        ctx.mask_is_float = attn_mask is not None and attn_mask.dtype == _torch.float32
        ctx.options = options
        ctx.lean_lse = None
        wide = _keeps_wide_out(query)
        if lean:
            fast = _attn._forward_fast(query, key, value, mask, options["is_causal"], options["scale"],
                                       options["enable_gqa"], options["causal_alignment"], None,
                                       options["precision"], True, wide)
            if fast is not None:
                out, ctx.lean_lse, ctx.lean_args = fast
                ctx.save_for_backward(query, key, value, out, None, attn_mask)  # PyTorch's in-place checks
                return out.to(query.dtype) if wide else out
        mask = _mask_rows(mask)
        if query.is_cuda:
            ctx.call = None
            out, lse = _attn.scaled_dot_product_attention(_rows(query), _rows(key), _rows(value), mask,
                                                          return_lse=True, **options)
            ctx.save_for_backward(query, key, value, out, lse, attn_mask)
            return out
        call = _attn._prepare_call(_rows(query), _rows(key), _rows(value), mask, **options)
        out, lse = _attn._run_forward(call, True, wide)
        ctx.call, ctx.out, ctx.lse = call, out, lse
        result = _attn._narrowed(out, query) if wide else _attn._like(out, query)
        # PyTorch's in-place checks (the result shares ctx.out's memory unless wide)
        ctx.save_for_backward(query, key, value, None if wide else result, None, attn_mask)
        return result

    @staticmethod
    @_once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse, attn_mask = ctx.saved_tensors
        want_mask = ctx.mask_is_float and ctx.needs_input_grad[3]
        mask = None if attn_mask is None else attn_mask.detach()
        if ctx.lean_lse is not None:
            o = ctx.options
            grads = _attn._backward_fast(ctx.lean_args, ctx.lean_lse, query, key, value, out, grad_out,
                                         _attn._causal_code(o["is_causal"], o["causal_alignment"]), o["scale"],
                                         o["precision"])
            if grads is None:  # rejected: the checked function says why
                grads = _attn.attention_backward(grad_out.contiguous(), query.detach(), key.detach(), value.detach(),
                                                 out.detach(), ctx.lean_lse, mask, **o)
        elif ctx.call is None:
            grads = _attn.attention_backward(grad_out.contiguous(), _rows(query), _rows(key), _rows(value), out,
                                             lse, _mask_rows(mask), return_mask_grad=want_mask, **ctx.options)
        else:
            # out and lse are the forward's own, and autograd gives grad_out out's shape.
            grad = _attn._array(grad_out.contiguous(), "grad_out")
            grads = [_attn._like(x, query) for x in _attn._run_backward(ctx.call, ctx.out, grad, ctx.lse, mask,
                                                                          want_mask)]
        return grads[0], grads[1], grads[2], grads[3] if want_mask else None, None, None


def _as_numpy_ready(t):
    return None if t is None else t.detach()


def _rows(t, broadcast_ok=False):
    """t detached, or a copy of it whose last dimension is contiguous. attn's kernels read
    rows of contiguous values, and its NumPy functions reject other layouts rather than
    copy behind the caller's back; PyTorch's SDPA takes any layout (a transposed or
    column-major view, a stepped slice), and so does this drop-in for it, at the cost of
    one copy of such a tensor. broadcast_ok: a last dimension of stride 0 (a mask's
    broadcast keys) is read as it is."""
    if t is None:
        return None
    t = t.detach()
    if t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1 or (broadcast_ok and t.stride(-1) == 0):
        return t
    return t.contiguous()


def _mask_rows(m):
    return _rows(m, broadcast_ok=True)


_HAS_CUSTOM_OP = hasattr(_torch, "library") and hasattr(_torch.library, "custom_op")

if _HAS_CUSTOM_OP:
    from typing import Optional as _Optional, Tuple as _Tuple

    def _call_options(dropout_p, is_causal, scale, enable_gqa, bottom_right, window_left, window_right, softcap, seed,
                      block_table, block_tiles, block_q, block_k, precision, query, key):
        bm = None
        if block_table is not None:
            # The BlockMask again, from the tensors the operator carries (zero-copy).
            tiles = (block_tiles.numpy() if block_tiles is not None
                     else _np.zeros((0, block_q, block_k), _np.bool_))
            bm = _attn.BlockMask(block_table.numpy(), tiles, (block_q, block_k),
                                 (None, None, query.shape[-2], key.shape[-2]))
        return dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                    causal_alignment="bottom_right" if bottom_right else "top_left",
                    window=(window_left, window_right), softcap=softcap or None, seed=seed, block_mask=bm,
                    precision=precision)

    @_torch.library.custom_op("attn::sdpa", mutates_args=())
    def _sdpa_op(query: _torch.Tensor, key: _torch.Tensor, value: _torch.Tensor, attn_mask: _Optional[_torch.Tensor],
                 alibi_slopes: _Optional[_torch.Tensor], dropout_p: float, is_causal: bool, scale: _Optional[float],
                 enable_gqa: bool, bottom_right: bool, window_left: int, window_right: int, softcap: float,
                 seed: int, block_table: _Optional[_torch.Tensor], block_tiles: _Optional[_torch.Tensor],
                 block_q: int, block_k: int,
                 precision: str) -> _Tuple[_torch.Tensor, _torch.Tensor, _torch.Tensor]:
        # (out, lse, out_wide): out_wide is out before its rounding, float32, for 16-bit
        # CPU calls (_Attention's reason; the backward reads D from it), else empty.
        # detached: the operator's autograd formula is registered below, and the generic
        # function would take inputs that require grad for a request for autograd
        options = _call_options(dropout_p, is_causal, scale, enable_gqa, bottom_right, window_left, window_right,
                                softcap, seed, block_table, block_tiles, block_q, block_k, precision, query, key)
        if _keeps_wide_out(query):
            call = _attn._prepare_call(_rows(query), _rows(key), _rows(value), _mask_rows(attn_mask),
                                       alibi_slopes=_as_numpy_ready(alibi_slopes), **options)
            wide, lse = _attn._run_forward(call, True, True)
            wide = _torch.from_numpy(wide)
            return wide.to(query.dtype), _torch.from_numpy(lse), wide
        out, lse = _attn.scaled_dot_product_attention(
            _rows(query), _rows(key), _rows(value), _mask_rows(attn_mask), return_lse=True,
            alibi_slopes=_as_numpy_ready(alibi_slopes), **options)
        return out, lse, query.new_empty((0,), dtype=_torch.float32)

    @_sdpa_op.register_fake
    def _sdpa_fake(query, key, value, attn_mask, alibi_slopes, dropout_p, is_causal, scale, enable_gqa, bottom_right,
                   window_left, window_right, softcap, seed, block_table, block_tiles, block_q, block_k, precision):
        out = query.new_empty(query.shape[:-1] + (value.shape[-1],))
        lse = query.new_empty(query.shape[:-1], dtype=_torch.float32)
        wide = out.new_empty(out.shape if _keeps_wide_out(query) else (0,), dtype=_torch.float32)
        return out, lse, wide

    @_torch.library.custom_op("attn::sdpa_backward", mutates_args=())
    def _sdpa_backward_op(grad_out: _torch.Tensor, query: _torch.Tensor, key: _torch.Tensor, value: _torch.Tensor,
                          out: _torch.Tensor, lse: _torch.Tensor, attn_mask: _Optional[_torch.Tensor],
                          alibi_slopes: _Optional[_torch.Tensor], dropout_p: float, is_causal: bool,
                          scale: _Optional[float], enable_gqa: bool, bottom_right: bool, window_left: int,
                          window_right: int, softcap: float, seed: int, block_table: _Optional[_torch.Tensor],
                          block_tiles: _Optional[_torch.Tensor], block_q: int, block_k: int, precision: str,
                          want_mask_grad: bool) -> _Tuple[_torch.Tensor, _torch.Tensor, _torch.Tensor, _torch.Tensor]:
        grads = _attn.attention_backward(
            grad_out.contiguous(), _rows(query), _rows(key), _rows(value), _rows(out), lse, _mask_rows(attn_mask),
            return_mask_grad=want_mask_grad, alibi_slopes=_as_numpy_ready(alibi_slopes),
            **_call_options(dropout_p, is_causal, scale, enable_gqa, bottom_right, window_left, window_right,
                            softcap, seed, block_table, block_tiles, block_q, block_k, precision, query, key))
        dmask = grads[3] if want_mask_grad else query.new_empty((0,))
        return grads[0], grads[1], grads[2], dmask

    @_sdpa_backward_op.register_fake
    def _sdpa_backward_fake(grad_out, query, key, value, out, lse, attn_mask, alibi_slopes, dropout_p, is_causal,
                            scale, enable_gqa, bottom_right, window_left, window_right, softcap, seed, block_table,
                            block_tiles, block_q, block_k, precision, want_mask_grad):
        # contiguous, as the real gradients are whatever the inputs' layout (empty_like
        # would copy a transposed input's strides, and opcheck finds the mismatch)
        dmask = attn_mask.new_empty(attn_mask.shape) if want_mask_grad else query.new_empty((0,))
        return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dmask

    def _no_double_backward(ctx, *grads):
        raise RuntimeError("attn.torch's backward is once-differentiable (as PyTorch's fused attention): "
                           "a second derivative is not available")

    _sdpa_backward_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)

    _OPTION_NAMES = ("dropout_p", "is_causal", "scale", "enable_gqa", "bottom_right", "window_left", "window_right",
                     "softcap", "seed", "block_table", "block_tiles", "block_q", "block_k", "precision")

    def _setup_context(ctx, inputs, output):
        query, key, value, attn_mask, alibi_slopes = inputs[:5]
        ctx.options = inputs[5:]
        ctx.want_mask_grad = attn_mask is not None and attn_mask.dtype == _torch.float32 and attn_mask.requires_grad
        out = output[2] if output[2].numel() else output[0]  # out_wide where the forward kept it
        ctx.save_for_backward(query, key, value, out, output[1], attn_mask, alibi_slopes)

    def _backward(ctx, grad_out, grad_lse, grad_wide):
        query, key, value, out, lse, attn_mask, alibi_slopes = ctx.saved_tensors
        dq, dk, dv, dmask = _sdpa_backward_op(grad_out, query, key, value, out, lse, attn_mask, alibi_slopes,
                                              *ctx.options, ctx.want_mask_grad)
        return (dq, dk, dv, dmask if ctx.want_mask_grad else None, None) + (None,) * len(_OPTION_NAMES)

    _sdpa_op.register_autograd(_backward, setup_context=_setup_context)

    # Packed variable-length attention, as operators for the same reason. The output's
    # shape depends on q and v alone, so the fake implementations need no sequence lengths.
    @_torch.library.custom_op("attn::varlen", mutates_args=())
    def _varlen_op(q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor, cu_seqlens_q: _torch.Tensor,
                   cu_seqlens_k: _torch.Tensor, max_seqlen_q: _Optional[int], max_seqlen_k: _Optional[int],
                   alibi_slopes: _Optional[_torch.Tensor], dropout_p: float, softmax_scale: _Optional[float],
                   causal: bool, window_left: int, window_right: int, softcap: float, seed: int,
                   precision: str) -> _Tuple[_torch.Tensor, _torch.Tensor, _torch.Tensor]:
        # (out, lse, out_wide), out_wide as attn::sdpa's
        if _keeps_wide_out(q):
            call = _attn._varlen_call(_rows(q), _rows(k), _rows(v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, dropout_p, softmax_scale, causal, (window_left, window_right),
                                      softcap, _as_numpy_ready(alibi_slopes), seed, False, precision)
            wide, lse = _attn._run_varlen_forward(call, True, True)
            wide = _torch.from_numpy(wide)
            return wide.to(q.dtype), _torch.from_numpy(lse), wide
        out, lse = _attn.varlen_attention(_rows(q), _rows(k), _rows(v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, dropout_p, softmax_scale, causal, (window_left, window_right),
                                          softcap, _as_numpy_ready(alibi_slopes), seed, return_lse=True,
                                          precision=precision)
        return out, lse, q.new_empty((0,), dtype=_torch.float32)

    @_varlen_op.register_fake
    def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p,
                     softmax_scale, causal, window_left, window_right, softcap, seed, precision):
        out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        wide = out.new_empty(out.shape if _keeps_wide_out(q) else (0,), dtype=_torch.float32)
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=_torch.float32), wide

    @_torch.library.custom_op("attn::varlen_backward", mutates_args=())
    def _varlen_backward_op(grad_out: _torch.Tensor, q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor,
                            out: _torch.Tensor, lse: _torch.Tensor, cu_seqlens_q: _torch.Tensor,
                            cu_seqlens_k: _torch.Tensor, max_seqlen_q: _Optional[int], max_seqlen_k: _Optional[int],
                            alibi_slopes: _Optional[_torch.Tensor], dropout_p: float,
                            softmax_scale: _Optional[float], causal: bool, window_left: int, window_right: int,
                            softcap: float, seed: int,
                            precision: str) -> _Tuple[_torch.Tensor, _torch.Tensor, _torch.Tensor]:
        return _attn.varlen_attention_backward(grad_out.contiguous(), _rows(q), _rows(k), _rows(v), _rows(out), lse,
                                               cu_seqlens_q, cu_seqlens_k,
                                               max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                               (window_left, window_right), softcap, _as_numpy_ready(alibi_slopes),
                                               seed, precision=precision)

    @_varlen_backward_op.register_fake
    def _varlen_backward_fake(grad_out, q, k, v, out, lse, *options):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous (_sdpa_backward_fake)

    _varlen_backward_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)

    def _varlen_setup_context(ctx, inputs, output):
        ctx.options = inputs[5:]
        out = output[2] if output[2].numel() else output[0]  # out_wide where the forward kept it
        ctx.save_for_backward(*inputs[:5], out, output[1])

    def _varlen_backward(ctx, grad_out, grad_lse, grad_wide):
        q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
        dq, dk, dv = _varlen_backward_op(grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.options)
        return (dq, dk, dv) + (None,) * 13

    _varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# attn's precision for each of torch.get_float32_matmul_precision()'s settings (what
# attn.torch does with float32 tensors when no precision= is given).
TORCH_PRECISIONS = {"highest": "f32", "high": "bf16x3", "medium": "bf16"}


def _torch_float32_precision():
    """attn's name for the precision torch.get_float32_matmul_precision() asks for."""
    get = getattr(_torch, "get_float32_matmul_precision", None)  # PyTorch ≥ 1.12
    return TORCH_PRECISIONS.get(get(), "f32") if get is not None else "f32"


# torch.compile cannot trace a function that returns a str; it takes the setting as a
# constant of the compiled graph instead, as it does for its own matmuls.
_compiler = getattr(_torch, "compiler", None)
if _compiler is not None and hasattr(_compiler, "assume_constant_result"):
    _torch_float32_precision = _compiler.assume_constant_result(_torch_float32_precision)


def _float32_precision(precision):
    """attn's precision name for a call: `precision` when given, else the one that
    torch.get_float32_matmul_precision() asks for."""
    return precision if precision is not None else _torch_float32_precision()


_is_compiling = getattr(getattr(_torch, "compiler", None), "is_compiling", None)  # PyTorch >= 2.3
try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode
except ImportError:  # pragma: no cover (every PyTorch this package supports has it)
    def _dispatch_mode():
        return None


def _traced(*args):
    """Whether this call is being traced (torch.compile, export, a FakeTensor or
    make_fx dispatch mode, tensor subclasses) and so must go through the custom
    operator. Eager calls on plain CPU tensors skip it: the operator's dispatch costs
    ~25 µs a call and ~100 µs with autograd (PyTorch 2.15), where the kernel of a
    short sequence takes a few µs."""
    if not _HAS_CUSTOM_OP:
        return False
    if _is_compiling is not None and _is_compiling():
        return True
    if _dispatch_mode() is not None:
        return True
    for t in args:
        if isinstance(t, _torch.Tensor) and (type(t) is not _torch.Tensor or not t.is_cpu):
            return True
    return False


def _eager_cpu(query, key, value, attn_mask):
    """Whether a call is eager on plain CPU tensors (and so needs no custom operator):
    _traced's answer, cheaper for the common case."""
    for t in (query, key, value, attn_mask):
        if t is not None and (type(t) is not _torch.Tensor or not t.is_cpu):
            return False
    return not ((_is_compiling is not None and _is_compiling()) or _dispatch_mode() is not None)


def _needs_grad(*tensors):
    return _torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _options(dropout_p, is_causal, scale, enable_gqa, causal_alignment, window, softcap, alibi_slopes, seed, block_mask,
             precision):
    """A call's options as attn.scaled_dot_product_attention's keywords."""
    return dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                causal_alignment=causal_alignment, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                seed=seed, block_mask=block_mask, precision=precision)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, causal_alignment="top_left", window=None, softcap=None,
                                 alibi_slopes=None, seed=None, block_mask=None, precision=None):
    """``attn.scaled_dot_product_attention`` on torch tensors, differentiable.

    query [..., Hq, L, d], key [..., Hkv, S, d], value [..., Hkv, S, dv]: CPU tensors
    (float32, bfloat16, float16) or CUDA tensors (bfloat16, float16; see
    ``attn.cuda_status()``); returns [..., Hq, L, dv] on the same device. See ``attn.scaled_dot_product_attention`` for the
    options (``block_mask``: an ``attn.BlockMask``). Any layout PyTorch's SDPA takes is
    taken: one whose last dimension is not contiguous is read through a contiguous copy. Gradients flow to query, key, value and
    a float32 attn_mask. ``precision`` ("f32", "bf16" or "bf16x3"; float32 inputs only,
    forward and backward alike): None follows ``torch.get_float32_matmul_precision()``,
    "highest" → "f32", "high" → "bf16x3", "medium" → "bf16"."""
    precision = _float32_precision(precision)
    lean = (_attn._lean_options(dropout_p, window, softcap, alibi_slopes, block_mask)
            and _eager_cpu(query, key, value, attn_mask))
    if lean:
        # The common eager call, on the lean path (_attn._forward_fast): at one token
        # the checked path below cost ~5x PyTorch's own call. A call that path
        # rejects takes the checked path, which says why.
        if not _needs_grad(query, key, value, attn_mask):
            fast = _attn._forward_fast(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment,
                                       seed, precision, False)
            if fast is not None:
                return fast[0]
        elif attn_mask is None or not attn_mask.requires_grad:  # a mask's own gradient needs the checked dbias
            return _Attention.apply(query, key, value, attn_mask,
                                    _options(dropout_p, is_causal, scale, enable_gqa, causal_alignment, window,
                                             softcap, alibi_slopes, seed, block_mask, precision), True)
    _attn._precision(precision)  # an unknown name is a ValueError here, before any work
    if dropout_p > 0 and seed is None:
        seed = secrets.randbits(63)
    if alibi_slopes is not None and isinstance(alibi_slopes, _torch.Tensor):
        alibi_slopes = alibi_slopes.detach()
    traced = _traced(query, key, value, attn_mask, alibi_slopes)
    if traced and (alibi_slopes is None or isinstance(alibi_slopes, _torch.Tensor)):
        if causal_alignment not in ("top_left", "bottom_right"):
            raise ValueError("causal_alignment must be \"top_left\" or \"bottom_right\", got %r" % (causal_alignment,))
        left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
        table = tiles = None
        bq = bk = 0
        if block_mask is not None:
            if not isinstance(block_mask, _attn.BlockMask):
                raise TypeError("block_mask must be an attn.BlockMask (from attn.block_mask()), got %r"
                                % (type(block_mask),))
            table = _torch.from_numpy(block_mask.blocks)
            tiles = _torch.from_numpy(block_mask.tiles) if block_mask.tiles.shape[0] else None
            bq, bk = block_mask.block_size
        out, _, _ = _sdpa_op(query, key, value, attn_mask, alibi_slopes, float(dropout_p), bool(is_causal),
                          None if scale is None else float(scale), bool(enable_gqa),
                          causal_alignment == "bottom_right", left, right, float(softcap or 0.0), int(seed or 0),
                          table, tiles, bq, bk, precision)
        return out
    options = _options(dropout_p, is_causal, scale, enable_gqa, causal_alignment, window, softcap, alibi_slopes, seed,
                       block_mask, precision)
    if traced or _needs_grad(query, key, value, attn_mask):
        return _Attention.apply(query, key, value, attn_mask, options, False)
    return _attn.scaled_dot_product_attention(_rows(query), _rows(key), _rows(value), _mask_rows(attn_mask), **options)


class _VarlenAttention(_torch.autograd.Function):
    # The checked call and the forward's NumPy out and lse are kept for the backward,
    # which then converts only grad_out (as _Attention's checked path); 16-bit CPU calls
    # keep their float32 output for D, as _Attention's do.
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, options):
        call = _attn._varlen_call(_rows(q), _rows(k), _rows(v), cu_seqlens_q, cu_seqlens_k, **options)
        wide = _keeps_wide_out(q)
        out, lse = _attn._run_varlen_forward(call, True, wide)
        ctx.call, ctx.out, ctx.lse = call, out, lse
        result = _attn._narrowed(out, q) if wide else _attn._like(out, q)
        # PyTorch's in-place checks (the result shares ctx.out's memory unless wide)
        ctx.save_for_backward(q, k, v, None if wide else result)
        return result

    @staticmethod
    @_once_differentiable
    def backward(ctx, grad_out):
        q = ctx.saved_tensors[0]  # (raises if an input was modified in place since the forward)
        grad = _attn._array(grad_out.contiguous(), "grad_out")
        dq, dk, dv = (_attn._like(x, q) for x in _attn._run_varlen_backward(ctx.call, ctx.out, grad, ctx.lse))
        return dq, dk, dv, None, None, None


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     seed=None, *, precision=None):
    """``attn.varlen_attention`` on CPU torch tensors, differentiable (FlashAttention's
    ``flash_attn_varlen_func`` with its gradients).

    q [total_q, Hq, d], k [total_k, Hkv, d], v [total_k, Hkv, dv] (float32, bfloat16,
    float16), cu_seqlens_q/k int32 [B+1]; returns out [total_q, Hq, dv]. Gradients flow to
    q, k and v (attn's fused backward, deterministic for any thread count). With
    ``dropout_p > 0`` the forward draws a seed (or takes ``seed``) and the backward reuses
    it. ``precision`` (float32 inputs) as for ``scaled_dot_product_attention``: None follows
    ``torch.get_float32_matmul_precision()``. Once-differentiable, as
    ``scaled_dot_product_attention``. With PyTorch 2.4 or later
    it is also the custom operator ``attn::varlen`` (with ``attn::varlen_backward``), which
    ``torch.compile`` traces without a graph break; eager CPU calls skip its dispatch."""
    precision = _float32_precision(precision)
    _attn._precision(precision)  # an unknown name is a ValueError here, before any work
    if _traced(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
        if dropout_p > 0 and seed is None:
            seed = secrets.randbits(63)
        cu_q, cu_k = (t if isinstance(t, _torch.Tensor) else _torch.as_tensor(_np.asarray(t))
                      for t in (cu_seqlens_q, cu_seqlens_k))
        left, right = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
        alibi = alibi_slopes if alibi_slopes is None or isinstance(alibi_slopes, _torch.Tensor) else \
            _torch.as_tensor(_np.asarray(alibi_slopes))
        out, _, _ = _varlen_op(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, alibi, float(dropout_p),
                            None if softmax_scale is None else float(softmax_scale), bool(causal), left, right,
                            float(softcap or 0.0), int(seed or 0), precision)
        return out
    if isinstance(alibi_slopes, _torch.Tensor):
        alibi_slopes = alibi_slopes.detach()
    if not _needs_grad(q, k, v):
        return _attn.varlen_attention(_rows(q), _rows(k), _rows(v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                                      alibi_slopes, seed, precision=precision)
    # (With dropout and no seed, the forward's _varlen_call draws one; the backward reuses that call.)
    options = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                   softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, seed=seed, reference=False, precision=precision)
    return _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, options)


class patch_sdpa:
    """Makes PyTorch's own modules run their attention on attn, in one line:

        with attn.torch.patch_sdpa():
            y = model(x)          # nn.TransformerEncoder, nn.MultiheadAttention, ...

    Inside the block ``torch.nn.functional.scaled_dot_product_attention`` is attn's
    (differentiable) version, which ``nn.MultiheadAttention`` and the ``nn.Transformer``
    layers call (``MultiheadAttention`` does so when ``need_weights=False``, as the
    Transformer layers pass); their native fast path, which would bypass it, is switched
    off for the duration. Calls attn cannot take (other dtypes; on a GPU: a build
    without the CUDA backend, float32, head dims other than 64, 96, 128, 256) go to
    PyTorch's function unchanged. float32 calls follow ``torch.get_float32_matmul_precision()``
    as PyTorch's matmuls do ("high": bf16x3, "medium": bf16; see
    ``scaled_dot_product_attention``). ``calls`` counts the calls attn took. Not thread-safe:
    it patches module globals, as any monkey-patch does.
    """

    def __init__(self):
        self.calls = 0
        self._saved = None

    _gpu_usable = {}  # CUDA device index -> whether attn's GPU kernels run there

    def _attn_takes(self, query, key, value, attn_mask):
        tensors = [t for t in (query, key, value, attn_mask) if t is not None]
        if any(t.is_nested or t.device != query.device for t in tensors):
            return False
        if query.device.type == "cpu":
            return (query.dtype in (_torch.float32, _torch.bfloat16, _torch.float16)
                    and (attn_mask is None or attn_mask.dtype in (_torch.bool, _torch.float32, query.dtype)))
        if query.device.type != "cuda":
            return False
        index = query.device.index if query.device.index is not None else _torch.cuda.current_device()
        if index not in self._gpu_usable:
            self._gpu_usable[index] = _attn.cuda_status(index)["unusable"] == ""
        return (self._gpu_usable[index] and query.dtype in (_torch.bfloat16, _torch.float16)
                and query.shape[-1] == value.shape[-1] and query.shape[-1] in (64, 96, 128, 256)
                and (attn_mask is None or attn_mask.dtype in (_torch.bool, _torch.float32)))

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not self._attn_takes(query, key, value, attn_mask):
            return self._saved(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                               scale=scale, enable_gqa=enable_gqa)
        self.calls += 1
        return scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    def __enter__(self):
        import torch.nn.functional as F
        if not hasattr(F, "scaled_dot_product_attention"):
            raise RuntimeError("attn.torch.patch_sdpa needs PyTorch 2.x (torch.nn.functional.scaled_dot_product_attention); "
                               "this is torch %s" % _torch.__version__)
        self._saved = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._sdpa
        mha = getattr(_torch.backends, "mha", None)
        self._fastpath = mha.get_fastpath_enabled() if mha is not None and hasattr(mha, "get_fastpath_enabled") else None
        if self._fastpath is not None:
            mha.set_fastpath_enabled(False)
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F
        F.scaled_dot_product_attention = self._saved
        if self._fastpath is not None:
            _torch.backends.mha.set_fastpath_enabled(self._fastpath)
        return False
