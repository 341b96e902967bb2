"""attn's functions on CUDA torch tensors: the same arguments and semantics, run by
attn's GPU kernels on the tensors' device and on PyTorch's current stream there,
without copies (outputs are allocated with torch on that device).

``attn.scaled_dot_product_attention`` and ``attn.attention_backward`` route here when
``query`` is a CUDA tensor; every other tensor of the call must then be on the same
device. What the GPU path takes (see ``attn/attention.hpp``): bfloat16 or float16
inputs, head dims 64, 96, 128 or 256 with dv = d, and every option, the mask's gradient
included. A ``block_mask``'s tables are copied to the device.
"""

import torch as _torch

from . import _attn

_DTYPES = {_torch.float32: "float32", _torch.bfloat16: "bfloat16", _torch.float16: "float16",
           _torch.bool: "bool", _torch.int32: "int32"}


def _view(t, name, device, keep):
    """A DeviceTensor over t's memory (no copy), on `device` and its current stream. t is
    appended to `keep`, which the caller holds until the kernels are enqueued: a
    temporary (a reshaped copy, a table moved to the device) freed earlier could be
    handed by PyTorch's caching allocator to the next allocation before the kernels
    read it. (After the launch, freeing is safe: later work on the stream runs after.)"""
    if t is None:
        return None
    keep.append(t)
    if not type(t).__module__.startswith("torch"):
        raise TypeError("%s: expected a torch tensor on %s (where query is), got %s" % (name, device, type(t).__name__))
    if t.device != device:
        raise ValueError("%s is on %s but query is on %s: every tensor of one call must be on the same device"
                         % (name, t.device, device))
    if t.dtype not in _DTYPES:
        raise TypeError("%s: expected dtype bfloat16 or float16 (float32 or bool for masks, int32 for lengths), "
                        "got %s" % (name, t.dtype))
    stream = _torch.cuda.current_stream(device).cuda_stream
    return _attn.DeviceTensor(t.data_ptr(), _DTYPES[t.dtype], list(t.shape), list(t.stride()), device.index, stream)


def _merged(t, hq_shape):
    """t [..., a, b, c] as [B, a, b, c] (a view when torch can make one)."""
    return t.reshape((-1,) + tuple(hq_shape))


def _bshd(t):
    return t.transpose(1, 2)


def _mask(attn_mask, batch, hq, lq, lk):
    if attn_mask is None:
        return None
    full = tuple(batch) + (hq, lq, lk)
    try:
        shape = tuple(_torch.broadcast_shapes(tuple(attn_mask.shape), full))
    except RuntimeError:
        raise ValueError("attn_mask of shape %s does not broadcast to %s" % (tuple(attn_mask.shape), full))
    if shape != full:
        raise ValueError("attn_mask of shape %s would enlarge the output shape %s" % (tuple(attn_mask.shape), full))
    if len(batch) <= 1 and attn_mask.dim() <= 4:
        return attn_mask.detach()  # the kernels broadcast it themselves
    return attn_mask.detach().expand(full).reshape((-1, hq, lq, lk))


def _alibi(alibi_slopes, batch, hq):
    if alibi_slopes is not None and alibi_slopes.dim() == len(batch) + 1 and len(batch) > 1:
        return alibi_slopes.detach().reshape(-1, hq)
    return None if alibi_slopes is None else alibi_slopes.detach()


def _block_mask(block_mask, batch, hq, lq, lk, device, keep):
    """The kernel arguments of an attn.BlockMask, its tables copied to `device`."""
    import attn
    args = attn._block_mask(block_mask, batch, hq, lq, lk)  # checks it against the call's shapes
    for key in ("block_table", "block_tiles"):
        if args.get(key) is not None:
            args[key] = _view(_torch.from_numpy(args[key]).to(device), "block_mask", device, keep)
    return args


def forward(query, key, value, attn_mask, *, scale, causal, window_left, window_right, softcap, alibi_slopes,
            dropout_p, seed, return_lse, block_mask):
    """The forward on CUDA tensors (arguments already parsed by attn.scaled_dot_product_attention):
    returns out and, with return_lse, lse."""
    dev = query.device
    keep = []
    q, k, v = query.detach(), key.detach(), value.detach()
    batch = tuple(q.shape[:-3])
    hq, lq, lk, dv = q.shape[-3], q.shape[-2], k.shape[-2], v.shape[-1]
    out = _torch.empty(batch + (hq, lq, dv), dtype=q.dtype, device=dev)
    lse = _torch.empty(batch + (hq, lq), dtype=_torch.float32, device=dev) if return_lse else None
    q4, k4, v4 = _merged(q, q.shape[-3:]), _merged(k, k.shape[-3:]), _merged(v, v.shape[-3:])
    view = lambda t, name: _view(t, name, dev, keep)  # noqa: E731
    _attn.forward(view(_bshd(q4), "query"), view(_bshd(k4), "key"), view(_bshd(v4), "value"),
                  view(_bshd(out.view(-1, hq, lq, dv)), "out"), scale=scale, causal=causal,
                  window_left=window_left, window_right=window_right,
                  mask=view(_mask(attn_mask, batch, hq, lq, lk), "attn_mask"),
                  alibi_slopes=view(_alibi(alibi_slopes, batch, hq), "alibi_slopes"), softcap=softcap,
                  dropout_p=dropout_p, seed=seed, lse=None if lse is None else view(lse.view(-1, hq, lq), "lse"),
                  **_block_mask(block_mask, batch, hq, lq, lk, dev, keep))
    return out, lse


def backward(grad_out, query, key, value, out, lse, attn_mask, *, scale, causal, window_left, window_right, softcap,
             alibi_slopes, dropout_p, seed, return_mask_grad, block_mask):
    """The backward on CUDA tensors: returns (dq, dk, dv) and, with return_mask_grad, the
    float32 attn_mask's gradient; new tensors on the device."""
    dev = query.device
    keep = []
    q, k, v = query.detach(), key.detach(), value.detach()
    batch = tuple(q.shape[:-3])
    hq, lq, lk, dv = q.shape[-3], q.shape[-2], k.shape[-2], v.shape[-1]
    for name, t, shape in (("out", out, batch + (hq, lq, dv)), ("grad_out", grad_out, batch + (hq, lq, dv)),
                           ("lse", lse, batch + (hq, lq))):
        if tuple(t.shape) != shape:
            raise ValueError("%s: expected shape %s, got %s" % (name, shape, tuple(t.shape)))
    dq = _torch.empty(q.shape, dtype=q.dtype, device=dev)
    dk = _torch.empty(k.shape, dtype=q.dtype, device=dev)
    dvv = _torch.empty(v.shape, dtype=q.dtype, device=dev)
    mask = _mask(attn_mask, batch, hq, lq, lk)
    dmask = None
    if return_mask_grad:
        if mask is None or mask.dtype != _torch.float32:
            raise ValueError("return_mask_grad=True needs a float32 attn_mask")
        dmask = _torch.empty(mask.shape, dtype=_torch.float32, device=dev)
    m = lambda t: _merged(t.detach(), t.shape[-3:])  # noqa: E731
    view = lambda t, name: _view(t, name, dev, keep)  # noqa: E731
    _attn.backward(view(_bshd(m(q)), "query"), view(_bshd(m(k)), "key"), view(_bshd(m(v)), "value"),
                   view(_bshd(m(out)), "out"), view(lse.detach().reshape(-1, hq, lq), "lse"),
                   view(_bshd(m(grad_out)), "grad_out"), view(_bshd(m(dq)), "dq"), view(_bshd(m(dk)), "dk"),
                   view(_bshd(m(dvv)), "dv"), scale=scale, causal=causal, window_left=window_left,
                   window_right=window_right, mask=view(mask, "attn_mask"),
                   alibi_slopes=view(_alibi(alibi_slopes, batch, hq), "alibi_slopes"), softcap=softcap,
                   dropout_p=dropout_p, seed=seed, dbias=view(dmask, "mask gradient"),
                   **_block_mask(block_mask, batch, hq, lq, lk, dev, keep))
    if not return_mask_grad:
        return dq, dk, dvv
    if tuple(dmask.shape) != tuple(attn_mask.shape):  # broadcast over several batch dims: sum back
        full = batch + (hq, lq, lk)
        lead = len(full) - attn_mask.dim()
        dims = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(attn_mask.shape)
                                          if n == 1 and full[lead + i] != 1)
        dmask = dmask.reshape(full).sum(dim=dims, keepdim=True).reshape(attn_mask.shape)
    return dq, dk, dvv, dmask
