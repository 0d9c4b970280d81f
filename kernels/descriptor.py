"""The gather kernel's descriptor of a strided source: shared by the kernel (``copy.py``) and the planner
(``tables.py``), which must not import triton before a launch needs it."""

# A strided source is described by MAX_DIMS sizes, strides and flat weights, leading dims padded.
MAX_DIMS = 8
# Columns of a strided part (see copy.gather_tile_kernel): src_addr, dst element offset of flat index 0,
# flat start, flat end, first row of tiles, p blocks, c blocks, then sizes, strides, flat weights.
DESC_HEAD = 7
DESC_ROW = DESC_HEAD + 3 * MAX_DIMS
