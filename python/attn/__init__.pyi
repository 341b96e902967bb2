from typing import Any, Callable, Dict, Optional, Tuple, TypeVar, Union


ArrayT = TypeVar("ArrayT")  # numpy.ndarray or torch.Tensor: results have the query's type

class Error(ValueError): ...

MaskMod = Callable[[Any, Any, Any, Any], Any]  # (b, h, q_idx, kv_idx) -> bool array

class BlockMask:
    blocks: Any  # numpy int32 [B or 1, H or 1, q blocks, kv blocks]
    tiles: Any  # numpy bool [T, block_q, block_k]
    block_size: Tuple[int, int]
    shape: Tuple[Optional[int], Optional[int], int, int]
    def __init__(self, blocks: Any, tiles: Any, block_size: Tuple[int, int],
                 shape: Tuple[Optional[int], Optional[int], int, int]) -> None: ...
    def counts(self) -> Dict[str, int]: ...
    def sparsity(self) -> float: ...
    def to_dense(self) -> Any: ...

def block_mask(mask_mod: MaskMod, B: Optional[int], H: Optional[int], Lq: int, Lk: int,
               block_size: Union[int, Tuple[int, int]] = ..., *, probe: str = ...) -> BlockMask: ...
def and_masks(*mask_mods: MaskMod) -> MaskMod: ...
def or_masks(*mask_mods: MaskMod) -> MaskMod: ...

def scaled_dot_product_attention(
    query: ArrayT,
    key: ArrayT,
    value: ArrayT,
    attn_mask: Optional[ArrayT] = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    causal_alignment: str = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayT] = ...,
    seed: Optional[int] = ...,
    return_lse: bool = ...,
    return_seed: bool = ...,
    block_mask: Optional["BlockMask"] = ...,
    precision: str = ...,
    reference: bool = ...,
) -> Union[ArrayT, Tuple[Union[ArrayT, int], ...]]: ...
def attention_backward(
    grad_out: ArrayT,
    query: ArrayT,
    key: ArrayT,
    value: ArrayT,
    out: ArrayT,
    lse: ArrayT,
    attn_mask: Optional[ArrayT] = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    *,
    causal_alignment: str = ...,
    window: Optional[Tuple[int, int]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayT] = ...,
    seed: Optional[int] = ...,
    return_mask_grad: bool = ...,
    block_mask: Optional["BlockMask"] = ...,
    precision: str = ...,
    reference: bool = ...,
) -> Tuple[ArrayT, ...]: ...
def varlen_attention(
    q: ArrayT,
    k: ArrayT,
    v: ArrayT,
    cu_seqlens_q: ArrayT,
    cu_seqlens_k: ArrayT,
    max_seqlen_q: Optional[int] = ...,
    max_seqlen_k: Optional[int] = ...,
    dropout_p: float = ...,
    softmax_scale: Optional[float] = ...,
    causal: bool = ...,
    window_size: Tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: Optional[ArrayT] = ...,
    seed: Optional[int] = ...,
    return_lse: bool = ...,
    return_seed: bool = ...,
    reference: bool = ...,
    precision: str = ...,
) -> Union[ArrayT, Tuple[Union[ArrayT, int], ...]]: ...
def varlen_attention_backward(
    grad_out: ArrayT,
    q: ArrayT,
    k: ArrayT,
    v: ArrayT,
    out: ArrayT,
    lse: ArrayT,
    cu_seqlens_q: ArrayT,
    cu_seqlens_k: ArrayT,
    max_seqlen_q: Optional[int] = ...,
    max_seqlen_k: Optional[int] = ...,
    dropout_p: float = ...,
    softmax_scale: Optional[float] = ...,
    causal: bool = ...,
    window_size: Tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: Optional[ArrayT] = ...,
    seed: Optional[int] = ...,
    reference: bool = ...,
    precision: str = ...,
) -> Tuple[ArrayT, ArrayT, ArrayT]: ...
def last_dropout_seed() -> Optional[int]: ...
def set_num_threads(n: int) -> None: ...
def num_threads() -> int: ...
def copies_made() -> int: ...
def merge_attention_states(out_a: ArrayT, lse_a: ArrayT, out_b: ArrayT, lse_b: ArrayT) -> Tuple[ArrayT, ArrayT]: ...
def attention_with_kvcache(q: ArrayT, k_cache: Any, v_cache: Any, k: Optional[Any] = ..., v: Optional[Any] = ...,
                           rotary_cos: Optional[Any] = ..., rotary_sin: Optional[Any] = ...,
                           cache_seqlens: Any = ..., block_table: Optional[Any] = ...,
                           softmax_scale: Optional[float] = ..., causal: bool = ...,
                           window_size: Tuple[int, int] = ..., softcap: float = ..., rotary_interleaved: bool = ...,
                           alibi_slopes: Optional[Any] = ..., num_splits: int = ..., return_softmax_lse: bool = ...,
                           *, k_scale: Optional[Any] = ..., v_scale: Optional[Any] = ...) -> Any: ...
def kvcache_append(k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Optional[Any] = ...,
                   rotary_cos: Optional[Any] = ..., rotary_sin: Optional[Any] = ..., rotary_interleaved: bool = ...,
                   *, k_scale: Optional[Any] = ..., v_scale: Optional[Any] = ...) -> None: ...
def cpu_info() -> dict: ...
def cuda_status(device: int = ...) -> dict: ...
