"""Triton kernels that move bytes: table-driven word copies and strided tile gathers.

Both kernels take a work table of int64 rows built by the launchers in ``kernels/pack.py``; one
program handles one row. Sources are named by raw device address (``tensor.data_ptr()``) in the
table, so one launch reads from any number of tensors. Copies move bits, never values: data is
viewed as same-width integers, so every dtype (fp8, bool, bf16 under the interpreter) moves alike.
"""
import triton
import triton.language as tl

# Columns of a row of the word-copy table.
WORD_ROW = 3  # src_addr (0: write zeros), dst word offset, word count
# Columns of a row of the tile table; see _gather_tile_kernel.
TILE_ROW = 6  # descriptor index, outer index, first p, first c, flat start of the piece, flat end
# A strided source is described by MAX_DIMS sizes and strides (leading dims padded with size 1).
MAX_DIMS = 8
# Columns of a descriptor: src_addr, dst element offset minus flat start, sizes, strides, flat weights.
DESC_ROW = 2 + 3 * MAX_DIMS


@triton.jit
def _copy_words_kernel(table_ptr, dst_ptr, WORD: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """Copy ``n`` words from ``src_addr`` to ``dst + dst_off`` words, or write zeros if src_addr is 0.

    The launcher guarantees that source address, destination offset and count are multiples of
    ``VEC`` words (a VEC-word group is 16 bytes for the fast class), so the hints below are true and
    let the compiler issue full-width vector loads and stores.
    """
    row = table_ptr + tl.program_id(0).to(tl.int64) * 3
    src_addr = tl.load(row)
    dst_off = tl.multiple_of(tl.load(row + 1), VEC)
    n = tl.multiple_of(tl.load(row + 2), VEC)
    dst = dst_ptr.to(tl.pointer_type(WORD)) + dst_off
    lanes = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), VEC), BLOCK)
    if src_addr == 0:
        zeros = tl.zeros([BLOCK], dtype=WORD)
        for k in range(0, n, BLOCK):
            idx = k + lanes
            tl.store(dst + idx, zeros, mask=idx < n)
    else:
        src = tl.multiple_of(src_addr.to(tl.pointer_type(WORD)), VEC * WORD.primitive_bitwidth // 8)
        for k in range(0, n, BLOCK):
            idx = k + lanes
            mask = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=mask, cache_modifier=".cg"), mask=mask,
                     cache_modifier=".cs")


@triton.jit
def _gather_tile_kernel(table_ptr, desc_ptr, dst_ptr, WORD: tl.constexpr, MAX_DIMS: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, P_UNIT: tl.constexpr,
                        C_UNIT: tl.constexpr, ALIGN: tl.constexpr):
    """Gather one [BLOCK_P, BLOCK_C] tile of a strided source into the contiguous destination.

    A descriptor lists a source's dims in the order (outer dims..., p, c): c is the last dim of
    the source (weight 1, so that writes walk the destination in order), p the dim whose stride is smallest
    (so that reads of a transposed source still walk memory in order), and the outer dims, padded
    with size-1 dims, are enumerated by ``outer``. Each dim has a size, a source stride and its
    weight in the row-major flattening, which decides where an element goes and whether it is in
    the piece's range ``[flat_start, flat_end)``.

    ``P_UNIT`` / ``C_UNIT`` say that dim p / dim c has source stride 1, and ``ALIGN`` (in elements)
    divides every offset other than the unit-stride walk. Both are promises the launcher checks;
    they let the compiler coalesce and widen the accesses.
    """
    row = table_ptr + tl.program_id(0).to(tl.int64) * 6
    desc = desc_ptr + tl.load(row) * (2 + 3 * MAX_DIMS)
    outer = tl.load(row + 1)
    p0 = tl.multiple_of(tl.load(row + 2), BLOCK_P)
    c0 = tl.multiple_of(tl.load(row + 3), BLOCK_C)
    flat_start = tl.multiple_of(tl.load(row + 4), ALIGN)
    flat_end = tl.multiple_of(tl.load(row + 5), ALIGN)
    src = tl.load(desc).to(tl.pointer_type(WORD))
    dst_shift = tl.load(desc + 1)
    sizes = desc + 2
    strides = sizes + MAX_DIMS
    weights = strides + MAX_DIMS

    # Split `outer` over the outer dims, innermost first.
    src_off = tl.zeros([], dtype=tl.int64)
    flat_off = tl.zeros([], dtype=tl.int64)
    for d in tl.static_range(MAX_DIMS - 3, -1, -1):
        size = tl.load(sizes + d)
        coord = outer % size
        outer = outer // size
        src_off += coord * tl.load(strides + d)
        flat_off += coord * tl.load(weights + d)

    size_p = tl.multiple_of(tl.load(sizes + MAX_DIMS - 2), ALIGN)
    size_c = tl.multiple_of(tl.load(sizes + MAX_DIMS - 1), ALIGN)
    weight_p = tl.multiple_of(tl.load(weights + MAX_DIMS - 2), ALIGN)
    if P_UNIT:
        stride_p = 1
    else:
        stride_p = tl.multiple_of(tl.load(strides + MAX_DIMS - 2), ALIGN)
    if C_UNIT:
        stride_c = 1
    else:
        stride_c = tl.multiple_of(tl.load(strides + MAX_DIMS - 1), ALIGN)
    src_tile = tl.multiple_of(src + src_off, ALIGN * WORD.primitive_bitwidth // 8)
    dst_tile = tl.multiple_of(dst_ptr.to(tl.pointer_type(WORD)) + (dst_shift + flat_off),
                              ALIGN * WORD.primitive_bitwidth // 8)

    p = p0 + tl.arange(0, BLOCK_P).to(tl.int64)
    c = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
    rel = p[:, None] * weight_p + c[None, :]
    src_ptrs = src_tile + p[:, None] * stride_p + c[None, :] * stride_c
    in_tensor = (p[:, None] < size_p) & (c[None, :] < size_c)
    # A tile wholly inside the range needs no per-element range test; that test would hide from
    # the compiler that the mask is constant over aligned groups, and so forbid vector accesses.
    p_last = tl.minimum(p0 + BLOCK_P, size_p) - 1
    c_last = tl.minimum(c0 + BLOCK_C, size_c) - 1
    tile_lo = flat_off + p0 * weight_p + c0
    tile_hi = flat_off + p_last * weight_p + c_last
    if (flat_start <= tile_lo) & (tile_hi < flat_end):
        tl.store(dst_tile + rel, tl.load(src_ptrs, mask=in_tensor), mask=in_tensor)
    else:
        flat = flat_off + rel
        mask = in_tensor & (flat >= flat_start) & (flat < flat_end)
        tl.store(dst_tile + rel, tl.load(src_ptrs, mask=mask), mask=mask)
