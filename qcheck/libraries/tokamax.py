"""tokamax 0.0.17: its TPU ragged_dot kernel's operand roles. Not machinery: a tokamax site is located inside
tokamax unless the user names it (``machinery=("tokamax",)``), as qcheck's tokamax client tests pin."""

from __future__ import annotations

from qcheck.libraries._kernel import KernelRoles, KnownKernel
from qcheck.libraries._library import Library

#: tokamax 0.0.17's TPU ragged_dot, forward: ``PallasMosaicTpuRaggedDot._fwd`` (ops/ragged_dot/pallas_mosaic_tpu.py
#: 173-185) calls ``gmm(lhs [m, k], rhs [g, k, n], ...)`` (pallas_mosaic_tpu_kernel.py 330-614), whose
#: ``common.custom_buffered_pallas_call`` (_src/mosaic_tpu.py 165-261) makes a ``pallas_call`` named
#: ``pallas_tpu_ragged_dot_gmm`` (kernel.py 38, 574-576) with no scalar prefetch of its own: all its operands are
#: inputs, ``(grid_dynamic, group_metadata, group_offset, lhs, rhs)`` (mosaic_tpu.py 258, kernel.py 606): five
#: int32 metadata inputs (dynamic grid bound, group offsets, group ids, m-tile ids, group offset), then lhs and
#: rhs, each a qwix ``QArray`` (codes, then its scale repeated to tile: mosaic_tpu.py 100-162) or an array. So 9
#: inputs (both QArrays), 8 (one) or 7 (none): counted as QArrays, lhs is input 5, rhs 6 in every case. Its
#: backward ``gmm`` (transpose_rhs=True, rhs [g, n, k]) shares its frames and metadata keys (kernel.py 577-582):
#: told apart by its name, ``pallas_tpu_ragged_dot_gmm_transpose_rhs``, not in this table (nor is ``tgmm``).
KERNEL = KnownKernel("tokamax", (("tokamax/_src/ops/ragged_dot/pallas_mosaic_tpu_kernel.py", "gmm"),),
                     frozenset({"prefer_element_type", "tiling", "transpose_rhs", "input_buffer_count"}),
                     KernelRoles("pallas_tpu_ragged_dot_gmm", 5, 6, qarrays=True, lhs_contracting=(1,),
                                 rhs_contracting=(1,)), named=True)

LIBRARY = Library("tokamax", kernels=(KERNEL,))

