"""Triton kernels that move bytes: word copies of contiguous parts and tile gathers of strided ones.

Both kernels read a small table built in ``kernels/tables.py``: one row per part
(a contiguous byte range, or a strided source) plus a prefix sum of the programs each part needs.
Each program finds its part by binary search in that prefix sum, so the host never writes one row
per chunk or per tile, and one launch serves any number of tensors. Sources are named by raw device
address (``tensor.data_ptr()``). Copies move bits, never values: data is viewed as same-width
integers, so every dtype (fp8, bool, bf16 under the interpreter) moves alike.
"""
import triton
import triton.language as tl

from .descriptor import DESC_HEAD, DESC_ROW, MAX_DIMS  # noqa: F401  (DESC_ROW: the kernels' row width)

__all__ = ["copy_words_kernel", "gather_tile_kernel"]


@triton.jit
def _find_part(first_ptr, n_parts, pid):
    """The part ``i`` with ``first[i] <= pid < first[i + 1]``: binary search in the prefix sum."""
    lo = tl.zeros([], dtype=tl.int64)
    hi = lo + n_parts  # n_parts may arrive as the constant 1, which has no .to()
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(first_ptr + mid) <= pid:
            lo = mid
        else:
            hi = mid
    return lo


# n_parts is not specialised: triton would otherwise compile one variant for n_parts == 1 and one for
# multiples of 16 (integer arguments' value classes), multiplying the first-call compiles by three for
# a value the kernels only search over.
@triton.jit(do_not_specialize=["n_parts"])
def copy_words_kernel(parts_ptr, first_ptr, n_parts, dst_ptr, WORD: tl.constexpr, VEC: tl.constexpr,
                       BLOCK: tl.constexpr, CHUNK: tl.constexpr, STREAM: tl.constexpr):
    """Move one ``CHUNK``-word chunk of one part: copy from ``src_addr``, or zeros if it is 0.

    The launcher guarantees that each part's source address, destination offset and count are
    multiples of ``VEC`` words (a VEC-word group is 16 bytes for the fast class), so the hints
    below are true and let the compiler issue full-width vector loads and stores. ``STREAM`` marks
    the traffic as touched once (cache-global loads, streaming stores).
    """
    pid = tl.program_id(0).to(tl.int64)
    part = _find_part(first_ptr, n_parts, pid)
    row = parts_ptr + part * 3  # src_addr (0: write zeros), dst word offset, word count
    src_addr = tl.load(row)
    n = tl.load(row + 2)
    start = (pid - tl.load(first_ptr + part)) * CHUNK
    todo = tl.multiple_of(tl.minimum(n - start, CHUNK), VEC)
    dst = dst_ptr.to(tl.pointer_type(WORD)) + tl.multiple_of(tl.load(row + 1) + start, VEC)
    lanes = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), VEC), BLOCK)
    if src_addr == 0:
        zeros = tl.zeros([BLOCK], dtype=WORD)
        for k in range(0, todo, BLOCK):
            idx = k + lanes
            tl.store(dst + idx, zeros, mask=idx < todo)
    else:
        src = tl.multiple_of(src_addr.to(tl.pointer_type(WORD)) + start, VEC * WORD.primitive_bitwidth // 8)
        for k in range(0, todo, BLOCK):
            idx = k + lanes
            mask = idx < todo
            if STREAM:
                values = tl.load(src + idx, mask=mask, cache_modifier=".cg")
                tl.store(dst + idx, values, mask=mask, cache_modifier=".cs")
            else:
                tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["n_parts"])
def gather_tile_kernel(desc_ptr, first_ptr, n_parts, dst_ptr, WORD: tl.constexpr, MAX_DIMS: tl.constexpr,
                        DESC_HEAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                        P_UNIT: tl.constexpr, C_UNIT: tl.constexpr, SRC_ALIGN: tl.constexpr,
                        DST_ALIGN: tl.constexpr, SIZE_ALIGN: tl.constexpr, SMALL: tl.constexpr):
    """Gather one [BLOCK_P, BLOCK_C] tile of a strided source into the contiguous destination.

    A descriptor lists a source's dims in the order (outer dims..., p, c): c is the source's last
    dim (flat weight 1, so that writes walk the destination in order), p the dim whose stride is
    smallest (so that reads of a transposed source still walk memory in order), and the outer dims,
    padded with size-1 dims, are enumerated by ``outer``. Each dim has a size, a source stride and
    its weight in the row-major flattening, which decides where an element goes and whether it is
    in the part's range ``[flat_start, flat_end)``.

    Promises the launcher checks, which let the compiler coalesce and widen the accesses:
    ``P_UNIT`` / ``C_UNIT``: dim p / dim c has source stride 1. ``SRC_ALIGN`` (elements) divides
    the source address and every stride but a unit one; ``DST_ALIGN`` where flat index 0 lands in
    dst and every flat weight; ``SIZE_ALIGN`` the sizes of p and c. ``SMALL``: offsets inside a tile
    fit in int32, so the per-element arithmetic is 32-bit and only the tile's base is 64-bit.
    """
    pid = tl.program_id(0).to(tl.int64)
    part = _find_part(first_ptr, n_parts, pid)
    desc = desc_ptr + part * (DESC_HEAD + 3 * MAX_DIMS)
    src = tl.load(desc).to(tl.pointer_type(WORD))
    dst_first = tl.load(desc + 1)
    flat_start = tl.load(desc + 2)
    flat_end = tl.load(desc + 3)
    p_blocks = tl.load(desc + 5)
    c_blocks = tl.load(desc + 6)
    tile = pid - tl.load(first_ptr + part)
    row = tl.load(desc + 4) + tile // c_blocks  # a row of tiles: (outer index, p block)
    outer = row // p_blocks
    p0 = row % p_blocks * BLOCK_P
    c0 = tile % c_blocks * BLOCK_C
    sizes = desc + DESC_HEAD
    strides = sizes + MAX_DIMS
    weights = strides + MAX_DIMS

    # Split `outer` over the outer dims, innermost first, into the tile's 64-bit base offsets.
    src_off = tl.zeros([], dtype=tl.int64)
    flat_off = tl.zeros([], dtype=tl.int64)
    for d in tl.static_range(MAX_DIMS - 3, -1, -1):
        size = tl.load(sizes + d)
        coord = outer % size
        outer = outer // size
        src_off += coord * tl.load(strides + d)
        flat_off += coord * tl.load(weights + d)
    stride_p = tl.load(strides + MAX_DIMS - 2)
    stride_c = tl.load(strides + MAX_DIMS - 1)
    weight_p = tl.load(weights + MAX_DIMS - 2)
    flat_off += p0 * weight_p + c0
    src_tile = tl.multiple_of(src + (src_off + p0 * stride_p + c0 * stride_c), SRC_ALIGN * WORD.primitive_bitwidth // 8)
    dst_tile = tl.multiple_of(dst_ptr.to(tl.pointer_type(WORD)) + (dst_first + flat_off),
                              DST_ALIGN * WORD.primitive_bitwidth // 8)

    # Offsets inside the tile, relative to its first element.
    if SMALL:
        itype = tl.int32
    else:
        itype = tl.int64
    p_left = tl.multiple_of(tl.minimum(tl.load(sizes + MAX_DIMS - 2) - p0, BLOCK_P).to(itype), SIZE_ALIGN)
    c_left = tl.multiple_of(tl.minimum(tl.load(sizes + MAX_DIMS - 1) - c0, BLOCK_C).to(itype), SIZE_ALIGN)
    if P_UNIT:
        step_p = 1
    else:
        step_p = tl.multiple_of(stride_p.to(itype), SRC_ALIGN)
    if C_UNIT:
        step_c = 1
    else:
        step_c = tl.multiple_of(stride_c.to(itype), SRC_ALIGN)
    jump_p = tl.multiple_of(weight_p.to(itype), DST_ALIGN)
    p = tl.arange(0, BLOCK_P).to(itype)
    c = tl.arange(0, BLOCK_C).to(itype)
    src_ptrs = src_tile + (p[:, None] * step_p + c[None, :] * step_c)
    rel = p[:, None] * jump_p + c[None, :]
    in_tensor = (p[:, None] < p_left) & (c[None, :] < c_left)
    # A tile wholly inside the range needs no per-element range test; that test would hide from
    # the compiler that the mask is constant over aligned groups, and so forbid vector accesses.
    tile_last = (p_left - 1).to(tl.int64) * weight_p + (c_left - 1).to(tl.int64)
    if (flat_start <= flat_off) & (flat_off + tile_last < flat_end):
        tl.store(dst_tile + rel, tl.load(src_ptrs, mask=in_tensor), mask=in_tensor)
    else:
        # Clamped into [-1, tile_last + 1], where they decide the same and fit in itype.
        lo = tl.minimum(tl.maximum(flat_start - flat_off, -1), tile_last + 1).to(itype)
        hi = tl.minimum(tl.maximum(flat_end - flat_off, -1), tile_last + 1).to(itype)
        mask = in_tensor & (rel >= lo) & (rel < hi)
        tl.store(dst_tile + rel, tl.load(src_ptrs, mask=mask), mask=mask)
