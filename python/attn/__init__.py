"""attn: fused, exact attention kernels for the CPU.

A drop-in for PyTorch's ``scaled_dot_product_attention`` (layout ``[..., H, L, d]``,
same argument names and semantics) that is faster and takes more options: sliding
windows, bottom-right causal alignment, soft-capping, ALiBi, grouped-query heads,
packed variable-length batches, dropout that the backward reproduces, and the
log-sum-exp. Inputs are NumPy arrays or CPU PyTorch tensors (float32, float16,
bfloat16); they are read in place, whatever their strides, and the result has the
input's type. The kernels run with the GIL released. CUDA torch tensors (bfloat16,
float16) run on attn's GPU kernels, on PyTorch's current stream, when the build has the
CUDA backend (``attn.cuda_status()``).

    import attn
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    out, lse = attn.scaled_dot_product_attention(q, k, v, window=(128, 0), return_lse=True)
    dq, dk, dv = attn.attention_backward(grad_out, q, k, v, out, lse, window=(128, 0))

For PyTorch training, ``attn.torch.scaled_dot_product_attention`` is the same function
as a ``torch.autograd.Function``.
"""

import math as _math
import secrets as _secrets
import threading as _threading

import numpy as _np

from . import _attn
from ._attn import Error, num_threads, set_num_threads
from .masks import BlockMask, and_masks, block_mask, or_masks

__all__ = ["scaled_dot_product_attention", "attention_backward", "varlen_attention", "varlen_attention_backward",
           "merge_attention_states", "attention_with_kvcache", "kvcache_append",
           "block_mask", "BlockMask", "and_masks", "or_masks",
           "last_dropout_seed", "set_num_threads", "num_threads", "cpu_info", "cuda_status", "Error", "copies_made"]
from ._version import __version__

_copies = 0  # copies the wrapper had to make (see copies_made)


def copies_made():
    """How many array copies this module has made since import.

    The kernels read their inputs in place; the wrapper copies only when several leading
    batch dimensions cannot be viewed as one (NumPy's reshape rule), or to broadcast a mask
    over several such dimensions. Tests use this to check zero-copy behaviour."""
    return _copies


def _is_torch(x):
    return type(x).__module__.startswith("torch")


def _wants_autograd(*xs):
    """Whether a torch tensor among xs requires grad while autograd records."""
    tensors = [x for x in xs if x is not None and _is_torch(x)]
    if not tensors or not any(getattr(x, "requires_grad", False) for x in tensors):
        return False
    import torch
    return torch.is_grad_enabled()


def _is_cuda(x):
    """A torch tensor in CUDA memory: the call runs on attn's GPU backend (attn/_cuda.py)."""
    return _is_torch(x) and getattr(x, "is_cuda", False)  # (is_cuda: ~0.05 µs; device.type: ~0.5)


def cuda_status(device=0):
    """Whether attn can run on CUDA device ``device``: a dict with ``built`` (this build
    has the CUDA backend) and ``unusable`` ("" when the device can run the kernels, else
    why not: no backend, no driver, no such device, older than sm_80)."""
    return _attn.cuda_status(int(device))


def _array(x, name, kinds=("f",), allow_none=False):
    """A NumPy view of x (a NumPy array, a CPU torch tensor or an array-like)."""
    if x is None:
        if allow_none:
            return None
        raise TypeError("%s: expected an array, got None" % name)
    if _is_torch(x):
        if not x.is_cpu:
            raise ValueError("%s: expected a CPU tensor, got one on %s (of attn's functions, only "
                             "scaled_dot_product_attention and attention_backward take CUDA tensors, and "
                             "all of a call's tensors must be on one device)" % (name, x.device))
        if str(x.dtype) == "torch.bfloat16":
            if "f" not in kinds:
                raise TypeError("%s: expected dtype %s, got torch.bfloat16" % (name, " or ".join(kinds)))
            import torch
            return x.detach().view(torch.int16).numpy()  # NumPy has no bfloat16: the bits, as int16
        x = (x.detach() if x.requires_grad else x).numpy()  # a view, never a copy
    elif not isinstance(x, _np.ndarray):
        x = _np.asarray(x)
    ok = (x.dtype in (_np.float32, _np.float16) and "f" in kinds) or (x.dtype == _np.bool_ and "b" in kinds) or (
        x.dtype == _np.int32 and "i" in kinds)
    if not ok:
        want = {"f": "float32, float16 or bfloat16", "b": "bool", "i": "int32"}
        raise TypeError("%s: expected dtype %s, got %s" % (name, " or ".join(want[k] for k in kinds), x.dtype))
    return x


def _merge_batch(x, name, batch):
    """x [..., a, b, c] as [B, a, b, c] with B the product of the leading dims (a view when possible)."""
    global _copies
    if len(batch) == 1:
        return x  # already [B, a, b, c]
    merged = x.reshape((_math.prod(batch),) + x.shape[len(batch):])
    # One leading dim or none always reshapes to a view; only merging several may copy.
    # (shares_memory is exact but slow: ~1 µs, three times a call.)
    if len(batch) > 1 and x.size and not _np.shares_memory(merged, x):
        _copies += 1
    return merged


def _bshd(x):
    """[B, H, L, d] seen as [B, L, H, d]: the kernels' layout, by strides only."""
    return x.transpose(0, 2, 1, 3)


def _causal_code(is_causal, alignment):
    if not is_causal:
        return 0
    if alignment == "top_left":
        return 1
    if alignment == "bottom_right":
        return 2
    raise ValueError("causal_alignment must be \"top_left\" or \"bottom_right\", got %r" % (alignment,))


def _window(window):
    if window is None:
        return -1, -1
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError("window must be a pair (left, right) of ints (-1 = unbounded), got %r" % (window,))
    return int(left), int(right)


def _check_common(q, k, v, enable_gqa):
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.ndim < 3:
            raise ValueError("%s: expected shape [..., H, L, d] (at least 3 dimensions), got %s" % (name, t.shape))
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError("query, key and value must have the same number of dimensions, got %s, %s, %s"
                         % (q.shape, k.shape, v.shape))
    if q.shape[:-3] != k.shape[:-3] or q.shape[:-3] != v.shape[:-3]:
        raise ValueError("query, key and value must have the same batch dimensions, got %s, %s, %s"
                         % (q.shape, k.shape, v.shape))
    if q.shape[-1] != k.shape[-1]:
        raise ValueError("query and key must have the same head dimension d, got %d and %d" % (q.shape[-1], k.shape[-1]))
    if k.shape[-2] != v.shape[-2] or k.shape[-3] != v.shape[-3]:
        raise ValueError("key and value must have the same heads and length, got %s and %s" % (k.shape, v.shape))
    for name, t in (("query", q), ("key", k), ("value", v)):
        # the kernels read rows of d contiguous values; say so in the caller's terms (the
        # library's own message would show its [B, L, H, d] view of the array)
        step = t.stride()[-1] if _is_torch(t) else t.strides[-1] // t.itemsize
        if t.shape[-1] > 1 and 0 not in t.shape and step != 1:
            raise ValueError("%s: the last dimension must be contiguous (stride 1), got a stride of %d elements; "
                             "pass a contiguous copy (np.ascontiguousarray, or .contiguous() in torch)" % (name, step))
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq == 0 or hkv == 0:
        raise ValueError("query and key/value need at least one head each, got %d and %d heads" % (hq, hkv))
    if hq != hkv and not enable_gqa:
        raise ValueError("query has %d heads and key/value %d: pass enable_gqa=True for grouped-query attention"
                         % (hq, hkv))
    if hq % hkv != 0:
        raise ValueError("the number of key/value heads (%d) must divide the number of query heads (%d)" % (hkv, hq))


def _mask(attn_mask, batch, hq, lq, lk):
    """The mask as the kernels read it: broadcast over [B, Hq, Lq, Lk] by NumPy's rules."""
    global _copies
    m = _array(attn_mask, "attn_mask", kinds=("f", "b"), allow_none=True)
    if m is None:
        return None
    try:
        full = _np.broadcast_shapes(m.shape, tuple(batch) + (hq, lq, lk))
    except ValueError:
        raise ValueError("attn_mask of shape %s does not broadcast to %s" % (m.shape, tuple(batch) + (hq, lq, lk)))
    if full != tuple(batch) + (hq, lq, lk):
        raise ValueError("attn_mask of shape %s would enlarge the output shape %s"
                         % (m.shape, tuple(batch) + (hq, lq, lk)))
    if len(batch) <= 1 and m.ndim <= 4:
        return m  # the kernels broadcast it themselves
    m = _np.broadcast_to(m, full).reshape((-1, hq, lq, lk))
    _copies += 1
    return m


def _block_mask(block_mask, batch, hq, lq, lk):
    """The kernel arguments for a BlockMask (its batch merged like the inputs')."""
    if block_mask is None:
        return {}
    if not isinstance(block_mask, BlockMask):
        raise TypeError("block_mask must be an attn.BlockMask (from attn.block_mask()), got %r" % (type(block_mask),))
    B, H, mlq, mlk = block_mask.shape
    nb = int(_np.prod(batch)) if len(batch) else 1
    if (mlq, mlk) != (lq, lk):
        raise ValueError("block_mask was built for Lq=%d, Lk=%d; query and key have L=%d, S=%d" % (mlq, mlk, lq, lk))
    if B is not None and B != nb:
        raise ValueError("block_mask was built for B=%d; the inputs have a batch of %d" % (B, nb))
    if H is not None and H != hq:
        raise ValueError("block_mask was built for H=%d; query has %d heads" % (H, hq))
    return dict(block_q=block_mask.block_size[0], block_k=block_mask.block_size[1], block_table=block_mask.blocks,
                block_tiles=block_mask.tiles if block_mask.tiles.shape[0] else None)


def _alibi(alibi_slopes, batch, hq):
    s = _array(alibi_slopes, "alibi_slopes", allow_none=True)
    if s is not None and s.ndim == len(batch) + 1 and len(batch) > 1:
        s = s.reshape(-1, hq)
    return s


_last_seed = _threading.local()


def _seed(seed, dropout_p):
    """The dropout seed to use: the caller's, or a fresh random one (dropout only),
    remembered per thread for ``last_dropout_seed()``."""
    if seed is None:
        seed = _secrets.randbits(63) if dropout_p > 0 else 0
    _last_seed.value = int(seed)
    return int(seed)


def last_dropout_seed():
    """The dropout seed of this thread's latest forward call (drawn at random when the
    call passed ``seed=None``), to hand to ``attention_backward(..., seed=...)``; None
    before any call. ``return_seed=True`` returns it with the result instead."""
    return getattr(_last_seed, "value", None)


def _backward_seed(seed, dropout_p, fn):
    if dropout_p > 0 and seed is None:
        raise ValueError("%s: dropout_p > 0 needs seed=, the seed the forward used (its return_seed=True "
                         "result or attn.last_dropout_seed()); without it the dropout mask cannot be reproduced"
                         % fn)
    return int(seed or 0)


def _like(x, template):
    if _is_torch(template):
        import torch
        t = torch.from_numpy(x)
        return t.view(torch.bfloat16) if x.dtype == _np.int16 else t
    return x


def _narrowed(out32, template):
    """A float32 output (a wide forward's) rounded to template's dtype (to nearest even,
    as the kernels round), as a torch tensor or NumPy array like template."""
    if _is_torch(template):
        import torch
        t = out32 if isinstance(out32, torch.Tensor) else torch.from_numpy(out32)
        return t.to(template.dtype)
    return out32.astype(template.dtype)


_PRECISIONS = {"f32": 0, "bf16": 1, "bf16x3": 2}
_ALIGNMENTS = {"top_left": 1, "bottom_right": 2}  # the kernels' causal codes (_causal_code)


def _precision(precision):
    if precision not in _PRECISIONS:
        raise ValueError("precision must be one of %s, got %r" % (", ".join(map(repr, _PRECISIONS)), precision))
    return _PRECISIONS[precision]


def _no_cuda_reference(reference):
    if reference:
        raise ValueError("reference=True: the float64 reference runs on the CPU; pass CPU tensors")


def _is_bf16(x):
    """True for a torch.bfloat16 tensor (passed to the kernels as its int16 bits)."""
    return _is_torch(x) and str(x.dtype) == "torch.bfloat16"


def _fast_mask(attn_mask):
    """attn_mask as _array makes it for the kernels, or None where _array rejects it
    (the checked path then says why)."""
    try:
        return _array(attn_mask, "attn_mask", kinds=("f", "b"))
    except (TypeError, ValueError, RuntimeError):
        return None


_torch_fast = None  # (torch, to_dlpack, {torch dtype: bf16?}) once a torch tensor has been seen


def _fast_operand(x):
    """(x as the kernels' positional entry takes it, its shape) for a NumPy array or a
    CPU torch tensor of float32, float16 or bfloat16, else None. A tensor goes as a
    DLPack capsule, read in place: ~0.4 µs against ~1.4 for .numpy(), and no buffer
    to describe on the other side."""
    global _torch_fast
    if type(x) is _np.ndarray:
        return x, x.shape
    if _torch_fast is None:
        if not _is_torch(x):
            return None
        import torch
        import torch.utils.dlpack
        _torch_fast = (torch, torch.utils.dlpack.to_dlpack,
                       {torch.float32: False, torch.float16: False, torch.bfloat16: True})
    if getattr(x, "dtype", None) not in _torch_fast[2] or not x.is_cpu:
        return None
    try:
        return _torch_fast[1](x.detach() if x.requires_grad else x), x.shape
    except Exception:  # e.g. a tensor with its negative bit set: the checked path says what is wrong
        return None


def _lean_options(dropout_p, window, softcap, alibi_slopes, block_mask):
    """Whether a call's options leave it to _forward_fast (none it does not take)."""
    return not dropout_p and window is None and not softcap and alibi_slopes is None and block_mask is None


def _forward_fast(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, seed, precision,
                  return_lse, wide=False):
    """The forward of a call with no option beyond these, on 4-D [B, H, L, d] inputs:
    (out like query, lse as a NumPy array or None, the kernels' q, k, v and mask
    arguments for _backward_fast), or None when the call is not such a call or the
    kernels reject its arguments. The library checks every argument itself; this
    path skips the Python-side checks and conversions, which at one token cost ~10x
    the kernel's call (~50 µs against ~5 on a Cascade Lake core), and
    its positional entry skips pybind11's matching of 25 keywords (~4 µs). A rejected
    call is left to the checked path, whose messages name the arguments in PyTorch's
    terms (the kernels check before they write, and out is this call's own). wide:
    out in float32 for 16-bit inputs (as _run_forward's)."""
    if precision not in _PRECISIONS or causal_alignment not in _ALIGNMENTS:
        return None
    q, k, v = _fast_operand(query), _fast_operand(key), _fast_operand(value)
    if q is None or k is None or v is None:
        return None
    (q, q_shape), (k, k_shape), (v, v_shape) = q, k, v
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return None
    if k_shape[1] != q_shape[1] and not enable_gqa:
        return None
    mask = None
    if attn_mask is not None:
        mask = _fast_mask(attn_mask)
        if mask is None or mask.ndim > 4:
            return None
    out_shape = (q_shape[0], q_shape[1], q_shape[2], v_shape[3])
    bf16 = False
    if type(q) is _np.ndarray:
        out = out_arg = _np.empty(out_shape, dtype=_np.float32 if wide else q.dtype)
    else:
        torch, to_dlpack, is_bf16 = _torch_fast
        bf16 = is_bf16[query.dtype]
        out = torch.empty(out_shape, dtype=torch.float32 if wide else query.dtype)
        out_arg = to_dlpack(out)
    lse = _np.empty(out_shape[:3], dtype=_np.float32) if return_lse else None
    try:
        _attn.forward_heads_major(q, k, v, out_arg, lse, mask, None if scale is None else float(scale),
                                  _ALIGNMENTS[causal_alignment] if is_causal else 0, bf16, _PRECISIONS[precision])
    except (Error, TypeError, ValueError):
        return None
    _last_seed.value = 0 if seed is None else int(seed)
    return out, lse, (q, k, v, mask)


def _backward_fast(args, lse, query, key, value, out, grad_out, causal, scale, precision):
    """dq, dk, dv of a call _forward_fast ran with return_lse on torch tensors: args are
    the kernels' q, k, v (capsules) and mask it returned (a capsule is read, not
    consumed, so the forward's serve again; out's is made anew, as one held until the
    backward kept out's memory alive past the caller's tensor and each call then took
    fresh pages: 32 page faults a call at N = 64), lse its lse; then its query,
    key, value and out, grad_out (out's shape), the kernels' causal code, scale and
    precision. New tensors of query's, key's and value's shapes and dtype, or None when
    the kernels reject the call (the caller then takes the checked path, which says
    why). Positional all through, for the reason _forward_fast gives."""
    torch, to_dlpack, is_bf16 = _torch_fast
    if grad_out.dim() and grad_out.stride(-1) != 1:  # e.g. the all-zero strides of out.sum()'s gradient
        grad_out = grad_out.contiguous()
    o, g = _fast_operand(out), _fast_operand(grad_out)
    if o is None or g is None:
        return None
    q, k, v, mask = args
    grads = [torch.empty(t.shape, dtype=query.dtype) for t in (query, key, value)]
    try:
        _attn.backward_heads_major(q, k, v, o[0], lse, g[0], *(to_dlpack(d) for d in grads), mask,
                                   None if scale is None else float(scale), causal, is_bf16[query.dtype],
                                   _PRECISIONS[precision])
    except (Error, TypeError, ValueError):
        return None
    return grads


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, causal_alignment="top_left", window=None, softcap=None,
                                 alibi_slopes=None, seed=None, return_lse=False, return_seed=False, block_mask=None,
                                 precision="f32", reference=False):
    """softmax(query·keyᵀ·scale + mask)·value, fused (never forms the L×S matrix).

    Shapes follow PyTorch: query [..., Hq, L, d], key [..., Hkv, S, d], value [..., Hkv, S, dv];
    the result is [..., Hq, L, dv], a NumPy array or a torch tensor like ``query``.
    Inputs are float32, float16 or bfloat16 (torch only: NumPy has no bfloat16) NumPy
    arrays or CPU torch tensors with any strides (the last dimension contiguous); they are
    not copied. query, key and value share one dtype; the result has it too (scores,
    softmax and sums are float32 inside; lse is float32). CUDA torch tensors (bfloat16 or
    float16; d = dv in 64, 96, 128, 256; every tensor of the call on query's device) run
    on attn's GPU kernels on the current stream, with every option (a block_mask's
    tables are copied to the device).

    attn_mask: boolean (True = take part in attention, PyTorch's rule) or float32 (added
        to the scores), broadcastable to [..., Hq, L, S].
    dropout_p: dropout on the attention probabilities; the decisions come from a
        counter-based generator keyed by ``seed`` (random when None), so
        ``attention_backward`` with the same seed reproduces them.
    is_causal: key j is visible to query i iff j <= i (``causal_alignment="top_left"``,
        PyTorch's) or j <= i + S - L (``"bottom_right"``, FlashAttention's, for KV caches).
        May be combined with ``attn_mask``.
    scale: multiplies query·key; default 1/sqrt(d).
    enable_gqa: allow Hkv < Hq (Hkv must divide Hq); query head h reads kv head h // (Hq/Hkv).
    window: (left, right): key j is visible iff i' - left <= j <= i' + right with
        i' = i + S - L; -1 means unbounded.
    softcap: Gemma-2 soft-capping, score <- softcap·tanh(score/softcap).
    alibi_slopes: float32 [Hq] or [..., Hq]: adds -slope·|i' - j| to each score.
    block_mask: an ``attn.BlockMask`` (``attn.block_mask(mask_mod, ...)``): blocks it
        leaves empty are skipped, full ones need no mask work, partial ones apply their
        stored tile. Combines with attn_mask and every other option.
    return_lse: also return the natural-log log-sum-exp of the scores, [..., Hq, L].
    return_seed: also return the dropout seed used (an int; drawn at random when
        ``seed`` is None), last in the returned tuple. ``attn.last_dropout_seed()``
        gives the same after the call.
    precision: arithmetic for float32 inputs (ignored for 16-bit ones), like
        ``torch.set_float32_matmul_precision``: "f32" (as given; "highest"), "bf16"
        (q, k, v rounded to bfloat16 inside, the bf16 kernels; "medium"), or "bf16x3"
        (each value as two bfloat16 pieces, three products per product on AMX tiles:
        ~2-2.5x the f32 kernel at ~1e-5 relative error; "high"; the f32 kernel where
        the CPU has no AMX). The result stays float32.
    reference: compute the same call with attn's plain float64 reference instead of the
        fused kernels (CPU only; explicit L×S scores, no SIMD, no threads: slow). Every
        option and dtype means what it means for the kernels (inputs rounded as
        ``precision`` says, dropout with the same decisions for a seed); the result is
        rounded once to the output dtype. For checking a kernel, or one's own code,
        against an independent oracle.

    Torch inputs that require grad (with autograd on) make the call
    ``attn.torch.scaled_dot_product_attention``'s, so the result is differentiable; with
    return_lse, return_seed or reference it is not, and a warning says so.

    A query that sees no key gets output 0 and lse -inf (PyTorch gives NaN). NaN and
    +inf scores make their row NaN, as in PyTorch; only -inf (or False) removes a key.
    Raises TypeError for a wrong dtype and ValueError (attn.Error) for wrong shapes or
    options, naming the argument.
    """
    if _wants_autograd(query, key, value, attn_mask):
        # torch tensors that require grad, with autograd on: a result without a gradient
        # would train nothing through this call (silently, next to a residual path), so
        # the call goes to attn.torch's differentiable one, the same kernels.
        if not (return_lse or return_seed or reference):
            from . import torch as _attn_torch
            return _attn_torch.scaled_dot_product_attention(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                causal_alignment=causal_alignment, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                seed=seed, block_mask=block_mask, precision=precision)
        import warnings
        warnings.warn("attn.scaled_dot_product_attention: with return_lse, return_seed or reference the result "
                      "records no gradient, although an input requires grad; use "
                      "attn.torch.scaled_dot_product_attention for gradients (or torch.no_grad() for none)",
                      stacklevel=2)
    if _is_cuda(query):
        _no_cuda_reference(reference)
        from . import _cuda
        _check_common(query, key, value, enable_gqa)
        left, right = _window(window)
        out, lse = _cuda.forward(query, key, value, attn_mask, scale=None if scale is None else float(scale),
                                 causal=_causal_code(is_causal, causal_alignment), window_left=left,
                                 window_right=right, softcap=float(softcap or 0.0), alibi_slopes=alibi_slopes,
                                 dropout_p=float(dropout_p), seed=_seed(seed, dropout_p), return_lse=return_lse,
                                 block_mask=block_mask)
        result = (out,) + ((lse,) if return_lse else ())
        if return_seed:
            result += (last_dropout_seed(),)
        return result if len(result) > 1 else result[0]
    fast = None
    if not reference and _lean_options(dropout_p, window, softcap, alibi_slopes, block_mask):
        fast = _forward_fast(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, seed,
                             precision, return_lse)
    if fast is not None:
        out, lse, _ = fast
    else:
        call = _prepare_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                             window, softcap, alibi_slopes, seed, block_mask, precision, reference=reference)
        out, lse = _run_forward(call, return_lse)
        out = _like(out, query)
    result = (out,) + ((_like(lse, query),) if return_lse else ())
    if return_seed:
        result += (last_dropout_seed(),)
    return result if len(result) > 1 else result[0]


class _Call:
    """One CPU call, checked: the kernels' [B, L, H, d] views of query, key and value
    (the leading batch dimensions merged), the shapes, and the options as the kernels
    take them. The forward runs it; attn.torch keeps it for the backward, which then
    neither converts nor checks those arguments again."""

    __slots__ = ("q", "k", "v", "q4", "k4", "v4", "batch", "hq", "lq", "lk", "dv", "mask", "options")


def _number(x, name):
    """x as a float, or a TypeError naming the argument."""
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError("%s: expected a number, got %r" % (name, x)) from None


def _prepare_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, window,
                  softcap, alibi_slopes, seed, block_mask, precision, forward=True, reference=False):
    """A checked _Call. seed: the forward's draws one when None (_seed); a backward's
    is the forward's, already checked (_backward_seed). reference: run on the float64
    reference rather than the kernels."""
    c = _Call()
    c.q = _array(query, "query")
    c.k = _array(key, "key")
    c.v = _array(value, "value")
    _check_common(c.q, c.k, c.v, enable_gqa)
    c.batch = c.q.shape[:-3]
    c.hq, c.lq, c.lk, c.dv = c.q.shape[-3], c.q.shape[-2], c.k.shape[-2], c.v.shape[-1]
    c.q4, c.k4, c.v4 = (_merge_batch(t, n, c.batch) for t, n in ((c.q, "query"), (c.k, "key"), (c.v, "value")))
    left, right = _window(window)
    c.mask = _mask(attn_mask, c.batch, c.hq, c.lq, c.lk)
    c.options = dict(scale=None if scale is None else _number(scale, "scale"),
                     causal=_causal_code(is_causal, causal_alignment), window_left=left, window_right=right,
                     mask=c.mask, alibi_slopes=_alibi(alibi_slopes, c.batch, c.hq),
                     softcap=_number(softcap or 0.0, "softcap"), dropout_p=_number(dropout_p, "dropout_p"),
                     seed=_seed(seed, dropout_p) if forward else int(seed),
                     bf16=_is_bf16(query), precision=_precision(precision), reference=bool(reference),
                     **_block_mask(block_mask, c.batch, c.hq, c.lq, c.lk))
    return c


def _run_forward(c, return_lse, wide=False):
    """The forward of a prepared call: out [..., Hq, L, dv] and lse [..., Hq, L] (or None)
    as NumPy arrays. wide: out in float32 for 16-bit inputs, before its rounding
    (_narrowed rounds it; attention_backward reads D from it)."""
    out = _np.empty(tuple(c.batch) + (c.hq, c.lq, c.dv), dtype=_np.float32 if wide else c.q.dtype)
    out4 = out.reshape((c.q4.shape[0], c.hq, c.lq, c.dv))
    lse = _np.empty(tuple(c.batch) + (c.hq, c.lq), dtype=_np.float32) if return_lse else None
    _attn.forward(_bshd(c.q4), _bshd(c.k4), _bshd(c.v4), _bshd(out4),
                  lse=None if lse is None else lse.reshape((c.q4.shape[0], c.hq, c.lq)), **c.options)
    return out, lse


def _run_backward(c, o, g, l, attn_mask, return_mask_grad):
    """dq, dk, dv (and d attn_mask with return_mask_grad) of a prepared call, from its
    out, grad_out and lse as NumPy arrays of the forward's shapes (checked by the
    caller), as NumPy arrays shaped like query, key, value (and attn_mask)."""
    q4, k4, v4, batch = c.q4, c.k4, c.v4, c.batch
    o4, g4 = _merge_batch(o, "out", batch), _merge_batch(g, "grad_out", batch)
    l3 = _merge_batch(l, "lse", batch)
    dq = _np.empty(c.q.shape, c.q.dtype)
    dk = _np.empty(c.k.shape, c.q.dtype)
    dvv = _np.empty(c.v.shape, c.q.dtype)
    dmask = None
    if return_mask_grad:
        if c.mask is None or c.mask.dtype != _np.float32:
            raise ValueError("return_mask_grad=True needs a float32 attn_mask")
        dmask = _np.empty(c.mask.shape, _np.float32)
    _attn.backward(_bshd(q4), _bshd(k4), _bshd(v4), _bshd(o4), l3, _bshd(g4), _bshd(dq.reshape(q4.shape)),
                   _bshd(dk.reshape(k4.shape)), _bshd(dvv.reshape(v4.shape)), dbias=dmask, **c.options)
    if not return_mask_grad:
        return dq, dk, dvv
    m = _array(attn_mask, "attn_mask")
    if dmask.shape != m.shape:  # the mask was broadcast over several batch dims: sum back
        full = tuple(batch) + (c.hq, c.lq, c.lk)
        d = dmask.reshape(full)
        lead = len(full) - m.ndim
        axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(m.shape) if n == 1 and full[lead + i] != 1)
        dmask = d.sum(axis=axes, keepdims=True).reshape(m.shape).astype(_np.float32)
    return dq, dk, dvv, dmask


def attention_backward(grad_out, query, key, value, out, lse, attn_mask=None, dropout_p=0.0, is_causal=False,
                       scale=None, enable_gqa=False, *, causal_alignment="top_left", window=None, softcap=None,
                       alibi_slopes=None, seed=None, return_mask_grad=False, block_mask=None, precision="f32",
                       reference=False):
    """Gradients of ``scaled_dot_product_attention`` (FlashAttention-2's backward).

    Takes grad_out (d loss / d out, shaped like out), the forward's inputs, its ``out`` and
    ``lse`` (``return_lse=True``), and the same options: with dropout_p > 0 the ``seed``
    the forward used is required (ValueError without it). For float16/bfloat16 inputs on
    the CPU, ``out`` may be the float32 output before its rounding; D = rowsum(grad_out ·
    out) is then taken from it, which keeps dq and dk near the exact gradient on sharply
    peaked rows, where D from the rounded output (FlashAttention's and PyTorch's way)
    can dominate their error. ``attn.torch`` keeps that output for its backward.
    Returns (dq, dk, dv) shaped like query, key, value; with grouped-query heads dk and dv
    sum over each group. With ``return_mask_grad=True`` and a float32 ``attn_mask``, also
    d loss / d attn_mask, summed over the mask's broadcast dimensions. ``precision`` as
    for the forward. Deterministic: identical for any number of threads. ``reference=True``
    computes the same gradients with the float64 reference (CPU only, slow), as for the
    forward.
    """
    seed = _backward_seed(seed, dropout_p, "attention_backward")
    if _is_cuda(query):
        _no_cuda_reference(reference)
        from . import _cuda
        _check_common(query, key, value, enable_gqa)
        left, right = _window(window)
        return _cuda.backward(grad_out, query, key, value, out, lse, attn_mask,
                              scale=None if scale is None else float(scale),
                              causal=_causal_code(is_causal, causal_alignment), window_left=left, window_right=right,
                              softcap=float(softcap or 0.0), alibi_slopes=alibi_slopes, dropout_p=float(dropout_p),
                              seed=seed, return_mask_grad=return_mask_grad, block_mask=block_mask)
    call = _prepare_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                         window, softcap, alibi_slopes, seed, block_mask, precision, forward=False, reference=reference)
    o = _array(out, "out")
    g = _array(grad_out, "grad_out")
    l = _array(lse, "lse")
    _check_saved(call, o, g, l)
    grads = _run_backward(call, o, g, l, attn_mask, return_mask_grad)
    return tuple(_like(x, query) for x in grads)


def _check_saved(c, o, g, l):
    """out, grad_out and lse must have the shapes the forward of call c gives them."""
    for name, t, shape in (("out", o, tuple(c.batch) + (c.hq, c.lq, c.dv)),
                           ("grad_out", g, tuple(c.batch) + (c.hq, c.lq, c.dv)),
                           ("lse", l, tuple(c.batch) + (c.hq, c.lq))):
        if t.shape != shape:
            raise ValueError("%s: expected shape %s, got %s" % (name, shape, t.shape))


class _VarlenCall:
    """One checked varlen call: q, k, v as NumPy views ([total, H, d]), the shapes, and
    the options as the kernels take them (cu_seqlens included)."""

    __slots__ = ("q", "k", "v", "options")


def _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                 window_size, softcap, alibi_slopes, seed, reference, precision="f32", forward=True):
    """A checked _VarlenCall. seed: the forward's draws one when None (_seed); a
    backward's is the forward's, already checked (_backward_seed)."""
    c = _VarlenCall()
    c.q, c.k, c.v = _array(q, "q"), _array(k, "k"), _array(v, "v")
    cq = _array(cu_seqlens_q, "cu_seqlens_q", kinds=("i",))
    ck = _array(cu_seqlens_k, "cu_seqlens_k", kinds=("i",))
    for name, t in (("q", c.q), ("k", c.k), ("v", c.v)):
        if t.ndim != 3:
            raise ValueError("%s: expected shape [total, H, d], got %s" % (name, t.shape))
    for name, cu, total in (("cu_seqlens_q", cq, c.q.shape[0]), ("cu_seqlens_k", ck, c.k.shape[0])):
        if cu.ndim != 1 or cu.size < 2:
            raise ValueError("%s: expected int32 [B+1] with B >= 1, got shape %s" % (name, cu.shape))
        # Tokens outside every sequence would be left unwritten in the output.
        if int(cu[0]) != 0 or int(cu[-1]) != total:
            raise ValueError("%s must start at 0 and end at the number of packed tokens (%d), got %s[0]=%d, "
                             "%s[-1]=%d" % (name, total, name, int(cu[0]), name, int(cu[-1])))
    for name, cu, given in (("max_seqlen_q", cq, max_seqlen_q), ("max_seqlen_k", ck, max_seqlen_k)):
        longest = int(_np.max(_np.diff(cu)))
        if given is not None and longest > int(given):
            raise ValueError("%s=%d is smaller than the longest sequence (%d)" % (name, given, longest))
    left, right = _window(window_size)
    c.options = dict(scale=None if softmax_scale is None else _number(softmax_scale, "softmax_scale"),
                     causal=2 if causal else 0, window_left=left, window_right=right,
                     alibi_slopes=_array(alibi_slopes, "alibi_slopes", allow_none=True),
                     softcap=_number(softcap or 0.0, "softcap"), cu_seqlens_q=cq, cu_seqlens_k=ck,
                     dropout_p=_number(dropout_p, "dropout_p"), bf16=_is_bf16(q),
                     precision=_precision(precision), reference=bool(reference))
    c.options["seed"] = _seed(seed, c.options["dropout_p"]) if forward else int(seed)
    return c


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     seed=None, return_lse=False, return_seed=False, reference=False, precision="f32"):
    """Attention over a packed batch of variable-length sequences, as FlashAttention's
    ``flash_attn_varlen_func``.

    q [total_q, Hq, d], k [total_k, Hkv, d], v [total_k, Hkv, dv] (Hkv divides Hq: query
    head h reads kv head h // (Hq/Hkv)); cu_seqlens_q and cu_seqlens_k are int32 [B+1]
    prefix sums of the sequence lengths. ``causal`` is bottom-right aligned
    (FlashAttention >= 2.1); window_size = (left, right), -1 unbounded.
    max_seqlen_q/k are accepted for compatibility and checked when given. As in
    FlashAttention, the sequences must cover the packed tokens exactly:
    cu_seqlens[0] == 0 and cu_seqlens[-1] == total (ValueError otherwise). Returns
    out [total_q, Hq, dv] (and lse [Hq, total_q] with return_lse=True, then the
    dropout seed with return_seed=True). ``reference=True``: the float64 reference, and
    ``precision`` ("f32", "bf16", "bf16x3"; float32 inputs), as for
    ``scaled_dot_product_attention``. ``varlen_attention_backward`` gives the gradients.

    Torch inputs that require grad (with autograd on) make the call
    ``attn.torch.varlen_attention``'s, so the result is differentiable; with return_lse,
    return_seed or reference it is not, and a warning says so.
    """
    if _wants_autograd(q, k, v):
        if not (return_lse or return_seed or reference):
            from . import torch as _attn_torch
            return _attn_torch.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                dropout_p, softmax_scale, causal, window_size, softcap,
                                                alibi_slopes, seed, precision=precision)
        import warnings
        warnings.warn("attn.varlen_attention: with return_lse, return_seed or reference the result records no "
                      "gradient, although an input requires grad; use attn.torch.varlen_attention for gradients "
                      "(or torch.no_grad() for none)", stacklevel=2)
    c = _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                     causal, window_size, softcap, alibi_slopes, seed, reference, precision)
    out, lse = _run_varlen_forward(c, return_lse)
    result = (_like(out, q),) + ((_like(lse, q),) if return_lse else ())
    if return_seed:
        result += (last_dropout_seed(),)
    return result if len(result) > 1 else result[0]


def _run_varlen_forward(c, return_lse, wide=False):
    """The forward of a prepared varlen call: out [total_q, Hq, dv] and lse [Hq, total_q]
    (or None) as NumPy arrays; wide as _run_forward's."""
    out = _np.empty((c.q.shape[0], c.q.shape[1], c.v.shape[2]), _np.float32 if wide else c.q.dtype)
    lse = _np.empty((c.q.shape[1], c.q.shape[0]), _np.float32) if return_lse else None
    _attn.forward(c.q, c.k, c.v, out, lse=lse, **c.options)
    return out, lse


def _run_varlen_backward(c, o, g, l):
    """dq, dk, dv of a prepared varlen call from its out, grad_out and lse (NumPy
    arrays), checked here against the shapes the forward gives them."""
    total_q, hq = c.q.shape[:2]
    for name, t, shape in (("out", o, (total_q, hq, c.v.shape[2])), ("grad_out", g, (total_q, hq, c.v.shape[2])),
                           ("lse", l, (hq, total_q))):
        if t.shape != shape:
            raise ValueError("%s: expected shape %s, got %s" % (name, shape, t.shape))
    dq = _np.empty(c.q.shape, c.q.dtype)
    dk = _np.empty(c.k.shape, c.q.dtype)
    dv = _np.empty(c.v.shape, c.q.dtype)
    _attn.backward(c.q, c.k, c.v, o, l, g, dq, dk, dv, **c.options)
    return dq, dk, dv


def varlen_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                              max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, seed=None, reference=False,
                              precision="f32"):
    """Gradients of ``varlen_attention`` (FlashAttention-2's backward, per sequence).

    Takes grad_out (d loss / d out, [total_q, Hq, dv]), the forward's inputs, its ``out``
    and ``lse`` ([Hq, total_q] float32, ``return_lse=True``), and the same options; with
    dropout_p > 0 the ``seed`` the forward used is required (ValueError without it).
    ``out`` may be float32 for 16-bit inputs, as for ``attention_backward``.
    Returns (dq, dk, dv) shaped like q, k, v, in their dtype; with grouped-query heads dk
    and dv sum over each group. Deterministic: identical for any number of threads.
    ``precision`` as for the forward; ``reference=True`` computes them with the float64
    reference (slow).
    """
    seed = _backward_seed(seed, dropout_p, "varlen_attention_backward")
    c = _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                     causal, window_size, softcap, alibi_slopes, seed, reference, precision, forward=False)
    grads = _run_varlen_backward(c, _array(out, "out"), _array(grad_out, "grad_out"), _array(lse, "lse"))
    return tuple(_like(x, q) for x in grads)


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Combine two attentions of the same queries over disjoint sets of keys.

    ``out_a, lse_a = scaled_dot_product_attention(q, k_a, v_a, return_lse=True)`` and the
    same for ``k_b, v_b`` give, merged, the attention of ``q`` over the keys of both (exactly
    in the log-sum-exp sense: float64 inside, rounded once to the output's dtype). Shapes:
    out [..., H, L, dv] (float32, float16 or bfloat16, one dtype), lse [..., H, L] float32.
    Returns ``(out, lse)`` like the inputs (NumPy or torch). A part whose lse is -inf saw
    no key and drops out; a NaN or +inf lse makes the row NaN.
    """
    oa = _array(out_a, "out_a")
    ob = _array(out_b, "out_b")
    la = _array(lse_a, "lse_a")
    lb = _array(lse_b, "lse_b")
    if oa.ndim < 3:
        raise ValueError("out_a: expected shape [..., H, L, dv] (at least 3 dimensions), got %s" % (oa.shape,))
    batch = oa.shape[:-3]
    h, l, dv = oa.shape[-3:]
    if ob.shape != oa.shape:
        raise ValueError("out_b must have out_a's shape %s, got %s" % (oa.shape, ob.shape))
    for name, t in (("lse_a", la), ("lse_b", lb)):
        if t.shape != tuple(batch) + (h, l):
            raise ValueError("%s must have shape %s (out_a's without dv), got %s" % (name, tuple(batch) + (h, l), t.shape))
    oa4, ob4 = _merge_batch(oa, "out_a", batch), _merge_batch(ob, "out_b", batch)
    la3, lb3 = _merge_batch(la, "lse_a", batch), _merge_batch(lb, "lse_b", batch)
    out = _np.empty(oa.shape, dtype=oa.dtype)
    lse = _np.empty(la.shape, dtype=_np.float32)
    _attn.merge(_bshd(oa4), la3, _bshd(ob4), lb3, _bshd(out.reshape(oa4.shape)), lse=lse.reshape(la3.shape),
                bf16=_is_bf16(out_a))
    return _like(out, out_a), _like(lse, out_a)



def _cache_array(x, name):
    """A writable NumPy view of a cache (float32, float16, bfloat16, int8, or fp8 E4M3 as
    torch.float8_e4m3fn, ml_dtypes' float8_e4m3fn or uint8 codes), never a copy."""
    if _is_torch(x) and str(x.dtype) in ("torch.int8", "torch.uint8", "torch.float8_e4m3fn"):
        if x.device.type != "cpu":
            raise ValueError("%s: expected a CPU tensor, got one on %s (of attn's functions, only "
                             "scaled_dot_product_attention and attention_backward take CUDA tensors, and "
                             "all of a call's tensors must be on one device)" % (name, x.device))
        import torch
        x = x.detach().view(torch.uint8 if str(x.dtype) != "torch.int8" else torch.int8).numpy()
    elif not (_is_torch(x)) and isinstance(x, _np.ndarray) and x.dtype in (_np.int8, _np.uint8):
        pass
    elif not (_is_torch(x)) and isinstance(x, _np.ndarray) and x.dtype.name == "float8_e4m3fn":
        x = x.view(_np.uint8)
    else:
        x = _array(x, name)
    if not x.flags.writeable:
        raise ValueError("%s: the cache is written in place, so it must be a writable array" % name)
    return x


def _seqlens(cache_seqlens, batch):
    if cache_seqlens is None:
        raise TypeError("cache_seqlens is required: the tokens already in each sequence's cache (int or int32 [B])")
    if isinstance(cache_seqlens, (int, _np.integer)):
        return _np.full((batch,), int(cache_seqlens), dtype=_np.int32)
    return _array(cache_seqlens, "cache_seqlens", kinds=("i",))


def _kvcache_args(k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table, k_scale, v_scale,
                  batch, cache_batch_idx=None):
    kc, vc = _cache_array(k_cache, "k_cache"), _cache_array(v_cache, "v_cache")
    args = dict(k_scale=_array(k_scale, "k_scale", allow_none=True) if k_scale is not None else None,
                v_scale=_array(v_scale, "v_scale", allow_none=True) if v_scale is not None else None,
                block_table=_array(block_table, "block_table", kinds=("i",), allow_none=True),
                batch_idx=_array(cache_batch_idx, "cache_batch_idx", kinds=("i",), allow_none=True),
                cache_seqlens=_seqlens(cache_seqlens, batch),
                k=_array(k, "k", allow_none=True), v=_array(v, "v", allow_none=True),
                rotary_cos=_array(rotary_cos, "rotary_cos", allow_none=True),
                rotary_sin=_array(rotary_sin, "rotary_sin", allow_none=True),
                cache_bf16=_is_bf16(k_cache), new_bf16=_is_bf16(k))
    for name, t in (("k_scale", args["k_scale"]), ("v_scale", args["v_scale"])):
        if t is not None and not t.flags.writeable:
            raise ValueError("%s: written in place on append, so it must be a writable array" % name)
    return kc, vc, args


def _fast_index(x, batch):
    """cache_seqlens or block_table as _attn.kvcache_lean takes them: an int32 NumPy array,
    an int32 CPU torch tensor as a DLPack capsule, an int as [batch] copies of it; else
    None (the checked path takes the call)."""
    if type(x) is _np.ndarray:
        return x if x.dtype == _np.int32 else None
    if type(x) is int:
        return _np.full((batch,), x, dtype=_np.int32) if -2**31 <= x < 2**31 else None
    if _torch_fast is None or not _is_torch(x) or x.dtype != _torch_fast[0].int32 or not x.is_cpu:
        return None
    try:
        return _torch_fast[1](x)
    except Exception:  # the checked path says what is wrong
        return None


def _kvcache_fast(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
                  return_softmax_lse, precision, rotary_cos, rotary_sin, rotary_interleaved, window, softcap):
    """attention_with_kvcache's result for a call with float caches and no option beyond
    these (no mask, ALiBi or quantized cache), or None when the call is not such a call or
    the library rejects it. The
    checked path's conversions (a NumPy view of each of up to 11 arguments) and its
    keyword call cost ~35 µs of a 64-key decoding call's ~55 µs (Zen 4); here the
    arguments go as they are (torch tensors as DLPack capsules) to a positional entry.
    The library checks every argument before it writes; a rejected call is left to the
    checked path, whose messages name the arguments (a rejected append is harmless to
    repeat: cache_seqlens is not advanced, so the same rows are written again)."""
    if precision not in _PRECISIONS or type(num_splits) is not int:
        return None
    if softmax_scale is not None and type(softmax_scale) not in (int, float):
        return None
    if (type(window) is not tuple or len(window) != 2 or any(type(w) is not int for w in window)
            or type(softcap) not in (int, float) or type(rotary_interleaved) is not bool):
        return None
    ops = [_fast_operand(x) for x in (q, k_cache, v_cache)]
    if any(x is None for x in ops):
        return None
    (qa, q_shape), (kc, _), (vc, v_shape) = ops
    if len(q_shape) != 4 or len(v_shape) != 4:
        return None
    new = [None, None, None, None]  # k, v, rotary_cos, rotary_sin
    for i, x in enumerate((k, v, rotary_cos, rotary_sin)):
        if x is not None:
            op = _fast_operand(x)
            if op is None:
                return None
            new[i] = op[0]
    seqlens = _fast_index(cache_seqlens, q_shape[0])
    table = None if block_table is None else _fast_index(block_table, q_shape[0])
    if seqlens is None or (block_table is not None and table is None):
        return None
    out_shape = (q_shape[0], q_shape[1], q_shape[2], v_shape[3])
    if type(qa) is _np.ndarray:
        out = out_arg = _np.empty(out_shape, dtype=qa.dtype)
    else:
        torch, to_dlpack, _ = _torch_fast
        out = torch.empty(out_shape, dtype=q.dtype)
        out_arg = to_dlpack(out)
    lse = _np.empty((q_shape[0], q_shape[2], q_shape[1]), dtype=_np.float32) if return_softmax_lse else None
    try:
        _attn.kvcache_lean(qa, kc, vc, table, seqlens, new[0], new[1], out_arg, lse,
                           None if softmax_scale is None else float(softmax_scale), 2 if causal else 0, num_splits,
                           _PRECISIONS[precision], new[2], new[3], rotary_interleaved, window[0], window[1],
                           float(softcap))
    except (Error, TypeError, ValueError):
        return None
    return (out, _like(lse, q)) if return_softmax_lse else out


def _leftpad_mask(cache_leftpad, attn_mask, q, k, cache_seqlens):
    """attn_mask with the cache positions before cache_leftpad[b] removed from sequence
    b: a boolean [B, 1, 1, K] mask (True = attend), or attn_mask combined with it (a
    boolean one by and, an additive one by -inf where removed), K = the longest
    cache_seqlens[b] + Lnew (or attn_mask's key dimension, if longer)."""
    qa = _array(q, "q")
    if qa.ndim != 4:
        raise ValueError("q: expected shape [B, Lq, Hq, d], got %s" % (qa.shape,))
    B = qa.shape[0]
    lens = _seqlens(cache_seqlens, B)
    lnew = _array(k, "k").shape[1] if k is not None else 0
    pad = _np.asarray(cache_leftpad.numpy() if _is_torch(cache_leftpad) else cache_leftpad)
    if pad.dtype.kind not in "iu" or pad.ndim > 1 or (pad.ndim == 1 and pad.shape[0] != B):
        raise ValueError("cache_leftpad must be an int or an integer array of shape [B] = [%d], got %r"
                         % (B, cache_leftpad if pad.ndim == 0 else pad.shape))
    pad = _np.broadcast_to(pad.astype(_np.int64), (B,))
    if (pad < 0).any() or (pad > _np.asarray(lens, _np.int64)).any():
        raise ValueError("cache_leftpad[b] must be in 0 .. cache_seqlens[b], got %s for cache_seqlens %s"
                         % (pad.tolist(), _np.asarray(lens).tolist()))
    keys = int(_np.asarray(lens, _np.int64).max()) + lnew
    m = None if attn_mask is None else _array(attn_mask, "attn_mask", kinds=("f", "b"))
    width = max(keys, 1, m.shape[-1] if m is not None and m.ndim >= 1 else 0)
    seen = (_np.arange(width)[None, :] >= pad[:, None]).reshape(B, 1, 1, width)
    if m is None:
        return seen
    if m.dtype == _np.bool_:
        return _np.logical_and(m, seen)
    widened = attn_mask.detach().float().numpy() if _is_bf16(attn_mask) else m.astype(_np.float32)
    return _np.where(seen, widened, _np.float32(-_np.inf)).astype(_np.float32)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                           cache_seqlens=None, block_table=None, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                           num_splits=0, return_softmax_lse=False, *, k_scale=None, v_scale=None, attn_mask=None,
                           precision="f32", cache_batch_idx=None, cache_leftpad=None):
    """Attention of new queries against a KV cache, FlashAttention's ``flash_attn_with_kvcache``.

    Layouts are FlashAttention's (sequence before heads): q [B, Lq, Hq, d]; k_cache, v_cache
    [B, capacity, Hkv, d / dv], or paged [num_blocks, page_size, Hkv, d] with ``block_table``
    int32 [B, max_blocks] (any page size); cache_seqlens int or int32 [B] (tokens already
    cached; not advanced by the call). ``cache_batch_idx`` int32 [B] (contiguous caches):
    the cache row each sequence reads and appends to, as in FlashAttention, so the cache
    may hold any number of rows (a row may serve several sequences, but not be appended
    to twice in one call). ``cache_leftpad`` int or int32 [B] (FlashAttention's): sequence
    b's keys start at cache position cache_leftpad[b] (left-padded prompts); the rows before
    it are removed by a boolean mask over the cache's positions, combined with
    ``attn_mask`` (positions, causal alignment and rotary stay the cache's, as in
    FlashAttention). ``k``, ``v`` [B, Lnew, Hkv, d / dv] are written into the
    cache in place at cache_seqlens (rotated by ``rotary_cos``/``rotary_sin`` [positions,
    rotary_dim / 2] if given: keys at their positions, queries at cache_seqlens + Lnew - Lq + i;
    ``rotary_interleaved`` pairs (0,1),(2,3)… else halves; computed in float32, and rotated
    bfloat16 queries rounded back to bfloat16 as FlashAttention's kernel stores them, float16
    ones kept in float32), then each sequence attends over its
    cache_seqlens[b] + Lnew keys. ``causal`` is bottom-right aligned (the last query sees every
    key). The cache may be float32, float16, bfloat16 (torch), or quantized with ``k_scale``/
    ``v_scale`` float32 [B or num_blocks, capacity or page_size, Hkv]: int8 (key = scale · int8;
    new tokens quantized with scale max|x| / 127) or fp8 E4M3 — torch.float8_e4m3fn, ml_dtypes'
    float8_e4m3fn or NumPy uint8 holding the codes (key = scale · e4m3; new tokens get scale
    max|x| / 448 and the nearest E4M3, ties to even). q, k, v: float32, float16 or bfloat16. ``num_splits``:
    0 = automatic split-KV, else the splits per sequence. ``attn_mask`` (not in FlashAttention):
    boolean (True = attend) or additive float32 / q's dtype, broadcast over [B, Hq, Lq, K] with
    K >= the longest cache_seqlens[b] + Lnew; key j of sequence b (its cache position) reads
    column j, columns past a sequence's keys are not read (a tree mask [Lq, K] for speculative
    decoding, a padding mask [B, 1, 1, K]). ``precision`` (not in FlashAttention): "f32" computes
    at float32's accuracy; "bf16" lets an int8 cache take both products on 16-bit integers
    (queries and each pass's probabilities as fixed point, 2^-16 of their largest: faster, still
    far finer than bf16 rounding), and a bfloat16 cache take both products on vdpbf16ps where it
    has the FMA's rate (AMD Zen 4/5): float32 queries rounded to bf16, and each pass's
    probabilities rounded to bf16 for P·V, as a plain bf16 implementation rounds them; other
    caches ignore it. bfloat16 queries on a bfloat16 cache take those products whatever
    ``precision`` says (bf16 inputs, as ``scaled_dot_product_attention`` treats them; the
    output is bfloat16 anyway), and on an int8 cache the integer ones. Chunked prefill (Lq >= max(24, 128·Hkv/Hq), ``num_splits``
    0) runs on ``scaled_dot_product_attention``'s tiled kernels, with their results for
    those inputs (16-bit: lse within 1e-4): a float cache read by queries of its dtype in
    place; float32 queries on a bfloat16 cache under precision="bf16" on the bf16 kernel;
    other pairs on the float32 kernel at float32's accuracy, an int8/fp8 cache
    dequantized (not under precision="bf16"), a 16-bit cache read by queries of another
    dtype (or float16 by rotated float16 queries) widened, from twice that many queries. Returns out [B, Lq, Hq, dv] in q's
    dtype, and lse float32 [B, Hq, Lq] if ``return_softmax_lse``. NumPy or CPU torch alike.
    """
    if cache_leftpad is not None:
        attn_mask = _leftpad_mask(cache_leftpad, attn_mask, q, k, cache_seqlens)
    if alibi_slopes is None and attn_mask is None and k_scale is None and v_scale is None and cache_batch_idx is None:
        fast = _kvcache_fast(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
                             return_softmax_lse, precision, rotary_cos, rotary_sin, rotary_interleaved, window_size,
                             0.0 if softcap is None else softcap)
        if fast is not None:
            return fast
    qa = _array(q, "q")
    if qa.ndim != 4:
        raise ValueError("q: expected shape [B, Lq, Hq, d], got %s" % (qa.shape,))
    kc, vc, args = _kvcache_args(k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table,
                                 k_scale, v_scale, qa.shape[0], cache_batch_idx)
    if vc.ndim != 4:
        raise ValueError("v_cache: expected 4 dimensions, got %s" % (vc.shape,))
    left, right = _window(window_size)
    out = _np.empty(qa.shape[:3] + (vc.shape[3],), dtype=qa.dtype)
    lse = _np.empty((qa.shape[0], qa.shape[2], qa.shape[1]), dtype=_np.float32) if return_softmax_lse else None
    _attn.kvcache(qa, kc, vc, out=out, lse=lse, scale=softmax_scale, causal=2 if causal else 0,
                  window_left=left, window_right=right, softcap=float(softcap or 0.0),
                  alibi_slopes=_array(alibi_slopes, "alibi_slopes", allow_none=True),
                  mask=_array(attn_mask, "attn_mask", kinds=("f", "b"), allow_none=True),
                  rotary_interleaved=bool(rotary_interleaved), num_splits=int(num_splits), q_bf16=_is_bf16(q),
                  mask_bf16=_is_bf16(attn_mask), precision=_precision(precision), **args)
    out = _like(out, q)
    return (out, _like(lse, q)) if return_softmax_lse else out


def kvcache_append(k_cache, v_cache, k, v, cache_seqlens, block_table=None, rotary_cos=None, rotary_sin=None,
                   rotary_interleaved=True, *, k_scale=None, v_scale=None, cache_batch_idx=None):
    """Only the append of ``attention_with_kvcache``: writes k, v [B, Lnew, Hkv, d / dv] into
    the cache at cache_seqlens (rotated, rounded or quantized the same way; into rows
    ``cache_batch_idx`` of a contiguous cache if given), e.g. a prompt's keys and values
    before decoding. cache_seqlens is not advanced."""
    ka = _array(k, "k")
    kc, vc, args = _kvcache_args(k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table,
                                 k_scale, v_scale, ka.shape[0] if ka.ndim == 4 else 1, cache_batch_idx)
    _attn.kvcache(None, kc, vc, rotary_interleaved=bool(rotary_interleaved), **args)


def cpu_info():
    """What the CPU kernels use here: a dict with ``simd_target`` (the f32 kernels' SIMD
    target), ``amx_bf16`` and ``avx512_bf16`` (what the CPU and OS allow), ``amx_refused``
    (why AMX is unusable although the CPU has it) and ``bf16_path`` ("amx", "avx512bf16"
    or "f32": where bfloat16 inputs run now; "f32" on Intel CPUs without usable AMX, whose
    vdpbf16ps has half the f32 rate). The environment variable ATTN_ISA=amx|avx512bf16|f32
    forces one."""
    return _attn.cpu_info()
