"""attn's kernels as a ``torch.autograd.Function``, so PyTorch training can use them.

    import attn.torch
    out = attn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()   # q.grad, k.grad, v.grad from attn's fused backward

Same arguments as ``attn.scaled_dot_product_attention``; a float32 ``attn_mask`` that
requires grad receives its gradient too (summed over its broadcast dimensions). With
``dropout_p > 0`` the forward draws a seed (or takes ``seed``) and the backward reuses it.
The backward is once-differentiable, as PyTorch's own fused attention kernels: asking
for a second derivative raises instead of silently returning zero.
"""

import secrets

import torch as _torch
from torch.autograd.function import once_differentiable as _once_differentiable

import attn as _attn


class _Attention(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, attn_mask, options):
        out, lse = _attn.scaled_dot_product_attention(query.detach(), key.detach(), value.detach(),
                                                      None if attn_mask is None else attn_mask.detach(),
                                                      return_lse=True, **options)
        ctx.options = options
        ctx.mask_is_float = attn_mask is not None and attn_mask.dtype == _torch.float32
        ctx.save_for_backward(query, key, value, out, lse, attn_mask)
        return out

    @staticmethod
    @_once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse, attn_mask = ctx.saved_tensors
        want_mask = ctx.mask_is_float and ctx.needs_input_grad[3]
        grads = _attn.attention_backward(grad_out.contiguous(), query.detach(), key.detach(), value.detach(), out,
                                         lse, None if attn_mask is None else attn_mask.detach(),
                                         return_mask_grad=want_mask, **ctx.options)
        dq, dk, dv = grads[:3]
        return dq, dk, dv, grads[3] if want_mask else None, None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, causal_alignment="top_left", window=None, softcap=None,
                                 alibi_slopes=None, seed=None):
    """``attn.scaled_dot_product_attention`` on torch tensors, differentiable.

    query [..., Hq, L, d], key [..., Hkv, S, d], value [..., Hkv, S, dv], float32 CPU
    tensors; returns [..., Hq, L, dv]. See ``attn.scaled_dot_product_attention`` for the
    options. Gradients flow to query, key, value and a float32 attn_mask."""
    if dropout_p > 0 and seed is None:
        seed = secrets.randbits(63)
    if alibi_slopes is not None and isinstance(alibi_slopes, _torch.Tensor):
        alibi_slopes = alibi_slopes.detach()
    options = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                   causal_alignment=causal_alignment, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                   seed=seed)
    return _Attention.apply(query, key, value, attn_mask, options)
