"""Independent references for every number format qcheck checks, in numpy and ml_dtypes only.

The formats' quantizers (:func:`reference_quantize`, :func:`reference_dequantize`,
:func:`reference_qdq`), the integer matmuls the int8 libraries compute exactly,
the rules each library follows under a format's name, and the routed MoE
layers people ship, in float64 (:func:`reference_moe`: Mixtral, Gemma-4 and
DeepSeek styles, with token dropping). Every value is
computed by numpy and ml_dtypes, never by the code it referees, so a bug cannot
be copied from one side to the other (the integer matmuls ask JAX, by tracing,
only which operand ``jnp.einsum`` hands ``dot_general`` first).
"""

from __future__ import annotations

from qcheck.referees._formats import (FORMS, Blocks, Form, add_referee, form_name, form_of, keeps_finite, builtin_referee_names, flush, referee_format_names,
                                      reference_dequantize, reference_qdq, reference_quantize, remove_referee)
from qcheck.referees._integer import MATMUL_MODES, SCALE_ORDERS, integer_einsum, integer_ragged_dot
from qcheck.referees._libraries import LIBRARY_RULES
from qcheck.referees._moe import (MOE_ACTIVATIONS, MOE_STYLES, MoEReference, reference_activation, reference_capacity,
                                  reference_experts, reference_moe)

__all__ = ["FORMS", "Form", "form_name", "form_of", "keeps_finite", "Blocks", "LIBRARY_RULES", "add_referee", "builtin_referee_names", "MATMUL_MODES", "MOE_ACTIVATIONS", "MOE_STYLES", "MoEReference", "SCALE_ORDERS",
           "flush", "integer_einsum", "integer_ragged_dot", "referee_format_names", "reference_activation",
           "reference_capacity", "reference_dequantize", "reference_experts", "reference_moe", "reference_qdq",
           "reference_quantize", "remove_referee"]
