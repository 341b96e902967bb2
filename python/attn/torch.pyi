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
