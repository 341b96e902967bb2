from typing import Any, Optional, Tuple

import torch

TORCH_PRECISIONS: dict[str, str]

def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    causal_alignment: str = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[torch.Tensor] = ...,
    seed: Optional[int] = ...,
    block_mask: Optional[Any] = ...,
    precision: Optional[str] = ...,
) -> torch.Tensor: ...
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Optional[int] = ...,
    max_seqlen_k: Optional[int] = ...,
    dropout_p: float = ...,
    softmax_scale: Optional[float] = ...,
    causal: bool = ...,
    window_size: Tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: Optional[Any] = ...,
    seed: Optional[int] = ...,
    *,
    precision: Optional[str] = ...,
) -> torch.Tensor: ...

class patch_sdpa:
    calls: int
    def __init__(self) -> None: ...
    def __enter__(self) -> "patch_sdpa": ...
    def __exit__(self, *exc: Any) -> bool: ...
