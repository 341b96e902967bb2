"""Block-sparse masks from a Python predicate (FlexAttention's ``create_block_mask``
without a compiler).

    doc = numpy.repeat(numpy.arange(8), 4096)                    # 8 documents, 32k tokens
    bm = attn.block_mask(lambda b, h, q, k: doc[q] == doc[k], None, None, 32768, 32768,
                         probe="border")                          # ~10 ms, see below
    out = attn.scaled_dot_product_attention(q, k, v, block_mask=bm)

The [Lq, Lk] plane is cut into blocks (64 × 64 by default, the kernels' tile). Each block
is *empty* (the kernels skip it), *full* (no mask work) or *partial* (its boolean tile is
stored and applied). The predicate ``mask_mod(b, h, q_idx, kv_idx)`` is called with
NumPy integer arrays that broadcast against each other and returns booleans (True =
may attend), as FlexAttention's ``mask_mod`` does with tensors; it is called a few times
with large arrays, never once per element.

Two ways to classify the blocks:

``probe="full"`` (default) evaluates the predicate at every position: exact for any
    predicate. It costs one evaluation per element: about 0.3 s for a 32k × 32k document
    mask on one core of the machine in docs/PERFORMANCE.md.
``probe="border"`` evaluates it only on each block's border (its first and last rows
    and columns), then at every position of the blocks found partial. A block whose
    border is all True is taken as full, all False as empty. That is exact when no block
    holds an island of True (or of False) that touches none of its four edges, which holds
    for the masks people use: causal and sliding windows, documents laid out as
    contiguous runs, prefix-LM, global tokens, dilated or strided patterns (any
    predicate whose True region inside a block is bounded by lines that cross the
    block's edges). It fails, for example, for a document split into non-contiguous
    runs shorter than a block. Cost: 4/block_size of the full evaluation plus the
    partial blocks (a few ms to tens of ms at 32k).
"""

import numpy as _np

EMPTY = -1  # BlockMask::kEmpty
FULL = -2   # BlockMask::kFull

# Elements one predicate call may produce (bounds the memory of the evaluation).
_CHUNK_ELEMENTS = 1 << 20


class BlockMask:
    """A block-sparse boolean mask for ``attn.scaled_dot_product_attention(block_mask=...)``.

    blocks: int32 [Bm, Hm, ceil(Lq/block_q), ceil(Lk/block_k)] (Bm, Hm = 1 broadcast over
        batch and heads); each entry EMPTY (-1), FULL (-2) or the index of the block's
        tile in ``tiles``.
    tiles: bool [T, block_q, block_k], the partial blocks' masks (True = may attend).
    shape: (B or None, H or None, Lq, Lk) the mask was built for.
    """

    def __init__(self, blocks, tiles, block_size, shape):
        self.blocks = _np.ascontiguousarray(blocks, dtype=_np.int32)
        bq, bk = block_size
        self.block_size = (int(bq), int(bk))
        t = _np.asarray(tiles, dtype=_np.bool_) if tiles is not None else _np.zeros((0, bq, bk), _np.bool_)
        self.tiles = _np.ascontiguousarray(t)
        self.shape = tuple(shape)
        if self.blocks.ndim != 4:
            raise ValueError("blocks: expected int32 [B, H, q blocks, kv blocks], got shape %s" % (self.blocks.shape,))
        if self.tiles.ndim != 3 or self.tiles.shape[1:] != self.block_size:
            raise ValueError("tiles: expected bool [T, %d, %d], got shape %s" % (bq, bk, self.tiles.shape))

    def counts(self):
        """Numbers of empty, full and partial blocks (over the stored batch and heads)."""
        return {"empty": int(_np.count_nonzero(self.blocks == EMPTY)),
                "full": int(_np.count_nonzero(self.blocks == FULL)),
                "partial": int(_np.count_nonzero(self.blocks >= 0))}

    def sparsity(self):
        """The fraction of blocks that are empty (the work the kernels skip)."""
        return self.counts()["empty"] / max(1, self.blocks.size)

    def to_dense(self):
        """The boolean mask it stands for, [Bm, Hm, Lq, Lk] (for checking; Lq × Lk memory)."""
        lq, lk = self.shape[2], self.shape[3]
        bq, bk = self.block_size
        nqb, nkb = self.blocks.shape[2], self.blocks.shape[3]
        full = _np.zeros(self.blocks.shape[:2] + (nqb * bq, nkb * bk), _np.bool_)
        for b in range(self.blocks.shape[0]):
            for h in range(self.blocks.shape[1]):
                table = self.blocks[b, h]
                view = full[b, h].reshape(nqb, bq, nkb, bk)
                view[:] = (table == FULL)[:, None, :, None]
                qb, kb = _np.nonzero(table >= 0)
                view[qb, :, kb, :] = self.tiles[table[qb, kb]]
        return full[:, :, :lq, :lk]

    def __repr__(self):
        c = self.counts()
        return ("BlockMask(shape=%s, block_size=%s, empty=%d, full=%d, partial=%d, sparsity=%.1f%%)"
                % (self.shape, self.block_size, c["empty"], c["full"], c["partial"], 100.0 * self.sparsity()))


def _block_sizes(block_size):
    bq, bk = (block_size, block_size) if _np.isscalar(block_size) else tuple(block_size)
    if int(bq) < 1 or int(bk) < 1:
        raise ValueError("block_size must be >= 1, got %s" % (block_size,))
    return int(bq), int(bk)


def _evaluate(mask_mod, b, h, q_idx, kv_idx, shape):
    """mask_mod on broadcasting index arrays, as a bool array of `shape`."""
    r = mask_mod(b, h, q_idx, kv_idx)
    if hasattr(r, "numpy") and not isinstance(r, _np.ndarray):  # a torch tensor
        r = r.numpy()
    r = _np.asarray(r)
    if r.dtype != _np.bool_:
        raise TypeError("mask_mod must return booleans (True = may attend), got dtype %s" % r.dtype)
    try:
        return _np.broadcast_to(r, shape)
    except ValueError:
        raise ValueError("mask_mod returned shape %s, which does not broadcast to the index arrays' %s"
                         % (r.shape, shape)) from None


def _groups(x, axis, block, op):
    """x reduced with op (logical_or: any, logical_and: all) over consecutive groups of
    `block` along `axis` (the last group may be shorter): a reshape when `block`
    divides the axis, else reduceat."""
    n = x.shape[axis]
    if n % block == 0:
        shape = x.shape[:axis] + (n // block, block) + x.shape[axis + 1:]
        return op.reduce(x.reshape(shape), axis=axis + 1)
    return op.reduceat(x, _np.arange(0, n, block), axis=axis)


def _kept_removed(m, axis, block):
    """Per group of `block` along `axis`: (some element True, some element False)."""
    return _groups(m, axis, block, _np.logical_or), ~_groups(m, axis, block, _np.logical_and)


def _classify_full(mask_mod, b, h, lq, lk, bq, bk, nqb, nkb, table, tiles):
    """Exact: every position, a band of query blocks per predicate call."""
    rows_per_call = max(1, _CHUNK_ELEMENTS // max(1, lk * bq))
    kv = _np.arange(lk, dtype=_np.int64)[None, :]
    for qb0 in range(0, nqb, rows_per_call):
        qb1 = min(nqb, qb0 + rows_per_call)
        r0, r1 = qb0 * bq, min(lq, qb1 * bq)
        m = _evaluate(mask_mod, b, h, _np.arange(r0, r1, dtype=_np.int64)[:, None], kv, (r1 - r0, lk))
        kept, removed = _kept_removed(m, 1, bk)
        kept, removed = _groups(kept, 0, bq, _np.logical_or), _groups(removed, 0, bq, _np.logical_or)
        part = table[qb0:qb1]
        part[:] = _np.where(kept, _np.where(removed, 0, FULL), EMPTY)
        qb, kb = _np.nonzero(kept & removed)  # row-major, as the numbering
        if qb.size:
            if m.shape != ((qb1 - qb0) * bq, nkb * bk):  # ragged edge: pad to whole blocks
                m = _np.pad(m, ((0, (qb1 - qb0) * bq - m.shape[0]), (0, nkb * bk - lk)))
            tiles.append(m.reshape(qb1 - qb0, bq, nkb, bk)[qb, :, kb, :])
            part[qb, kb] = -3  # partial: numbered by block_mask() in row-major order


def _classify_border(mask_mod, b, h, lq, lk, bq, bk, nqb, nkb, table, tiles):
    """Blocks from their borders; partial ones evaluated at every position. The
    evaluations run in chunks of ~1 MB: fresh large arrays cost more in page faults
    than the predicate itself."""
    first_q = _np.arange(nqb, dtype=_np.int64) * bq
    first_k = _np.arange(nkb, dtype=_np.int64) * bk
    rows = _np.concatenate([first_q, _np.minimum(first_q + bq, lq) - 1])
    cols = _np.concatenate([first_k, _np.minimum(first_k + bk, lk) - 1])
    # Each block's first and last rows against every key: [2·nqb, nkb].
    kept_r = _np.empty((rows.size, nkb), _np.bool_)
    removed_r = _np.empty_like(kept_r)
    kv = _np.arange(lk, dtype=_np.int64)[None, :]
    step = max(1, _CHUNK_ELEMENTS // lk)
    for s in range(0, rows.size, step):
        r = rows[s:s + step]
        kept_r[s:s + r.size], removed_r[s:s + r.size] = _kept_removed(
            _evaluate(mask_mod, b, h, r[:, None], kv, (r.size, lk)), 1, bk)
    kept = kept_r.reshape(2, nqb, nkb).any(axis=0)
    removed = removed_r.reshape(2, nqb, nkb).any(axis=0)
    # Every query against each block's first and last columns: [nqb, 2·nkb].
    step = max(1, _CHUNK_ELEMENTS // (bq * cols.size)) * bq
    for r0 in range(0, lq, step):
        r1 = min(lq, r0 + step)
        k, rm = _kept_removed(_evaluate(mask_mod, b, h, _np.arange(r0, r1, dtype=_np.int64)[:, None],
                                        cols[None, :], (r1 - r0, cols.size)), 0, bq)
        kept[r0 // bq:(r1 + bq - 1) // bq] |= k.reshape(-1, 2, nkb).any(axis=1)
        removed[r0 // bq:(r1 + bq - 1) // bq] |= rm.reshape(-1, 2, nkb).any(axis=1)
    table[:] = _np.where(kept, _np.where(removed, 0, FULL), EMPTY)
    qb, kb = _np.nonzero(kept & removed)
    # The partial blocks at every position, in batches; indices past the plane are
    # clamped for the call (the predicate may index arrays of length Lq / Lk) and
    # the answers there dropped.
    per_call = max(1, _CHUNK_ELEMENTS // (bq * bk))
    rq, rk = _np.arange(bq, dtype=_np.int64), _np.arange(bk, dtype=_np.int64)
    for s in range(0, qb.size, per_call):
        q_idx = qb[s:s + per_call, None, None] * bq + rq[None, :, None]
        k_idx = kb[s:s + per_call, None, None] * bk + rk[None, None, :]
        m = _evaluate(mask_mod, b, h, _np.minimum(q_idx, lq - 1), _np.minimum(k_idx, lk - 1),
                      (q_idx.shape[0], bq, bk))
        tiles.append(m & (q_idx < lq) & (k_idx < lk) if lq % bq or lk % bk else m)
    if qb.size:
        table[qb, kb] = -3


def block_mask(mask_mod, B, H, Lq, Lk, block_size=64, *, probe="full"):
    """Builds a BlockMask from ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend).

    B, H: batch and head counts the predicate depends on, or None when it does not (the
    mask then broadcasts over them and the predicate is called with b = 0 / h = 0).
    Lq, Lk: query and key lengths. block_size: an int or (block_q, block_k); 64, the
    kernels' tile, skips the most work. probe: "full" (exact for any predicate) or
    "border" (much faster; exact unless a block holds an island that touches none of its
    edges; see the module's documentation).
    """
    if not callable(mask_mod):
        raise TypeError("mask_mod must be callable as mask_mod(b, h, q_idx, kv_idx), got %r" % (mask_mod,))
    if probe not in ("full", "border"):
        raise ValueError("probe must be \"full\" or \"border\", got %r" % (probe,))
    for name, n in (("Lq", Lq), ("Lk", Lk)):
        if int(n) < 1:
            raise ValueError("%s must be >= 1, got %s" % (name, n))
    for name, n in (("B", B), ("H", H)):
        if n is not None and int(n) < 1:
            raise ValueError("%s must be >= 1 or None, got %s" % (name, n))
    lq, lk = int(Lq), int(Lk)
    bq, bk = _block_sizes(block_size)
    nqb, nkb = -(-lq // bq), -(-lk // bk)
    bm, hm = (1 if B is None else int(B)), (1 if H is None else int(H))
    blocks = _np.empty((bm, hm, nqb, nkb), _np.int32)
    tiles = []
    classify = _classify_full if probe == "full" else _classify_border
    for b in range(bm):
        for h in range(hm):
            table = blocks[b, h]
            before = sum(t.shape[0] for t in tiles)
            classify(mask_mod, _np.int64(b), _np.int64(h), lq, lk, bq, bk, nqb, nkb, table, tiles)
            # Number the partial blocks (marked -3) in row-major order, which is the
            # order their tiles were appended in.
            marked = table == -3
            table[marked] = before + _np.arange(int(marked.sum()), dtype=_np.int32)
    all_tiles = _np.concatenate(tiles) if tiles else _np.zeros((0, bq, bk), _np.bool_)
    return BlockMask(blocks, all_tiles, (bq, bk), (B, H, lq, lk))


def _combine(mask_mods, op, start):
    def combined(b, h, q, k):
        r = start
        for m in mask_mods:
            r = op(r, m(b, h, q, k))
        return r
    return combined


def and_masks(*mask_mods):
    """A predicate that is True where every one of mask_mods is."""
    return _combine(mask_mods, _np.logical_and, True)


def or_masks(*mask_mods):
    """A predicate that is True where any one of mask_mods is."""
    return _combine(mask_mods, _np.logical_or, False)
