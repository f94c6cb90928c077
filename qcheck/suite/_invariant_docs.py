"""What each invariant holds, in one line: the one text the CLI's help and the README's table are rendered from.

Kept apart from :mod:`qcheck.suite.invariants` so that ``qcheck --help`` does
not import JAX; :attr:`qcheck.suite.invariants.Invariant.doc` reads it, and
``tests/test_readme.py`` holds the README's table to :func:`readme_table`.
"""

from __future__ import annotations

import textwrap

__all__ = ["DOCS", "help_columns", "readme_table"]

#: Invariant name -> what it holds, in the matrix's column order.
DOCS: dict[str, str] = {
    "sites": "no two call sites share a wrapper or a state array; a recipe that never draws carries no RNG stream",
    "coverage": "every matmul but the router, the combine and the dropping masks takes quantized operands (the "
                "figure: how many; `qcheck coverage` prints the map); with an fp8_target, every fp8 cast, forward "
                "and backward, is a type that hardware multiplies",
    "exact": "each call site of a fresh layer equals, bitwise, the matmul of its operands quantized by the numpy "
             "referee in the recipe's declared formats: on probes, and on what it receives in the layer's forward",
    "backward": "each site's input and weight gradients equal, bitwise, the referee's gradient matmuls (g quantized "
                "as the recipe declares): on probes, and in one backward pass of the layer, whose weight gradients "
                "must be the ones their sites gave",
    "tracks": "the layer stays within the recipe's relative-norm bound of its unquantized twin and is not equal to "
              "it (the figure: the norm)",
    "grads": "one train step: every parameter's gradient is finite and within the recipe's gradient bound of the "
             "twin's (0.3; NVFP4 0.5), not equal to it where the recipe quantizes gradients (the figure: the worst "
             "norm)",
    "state": "fp8 scales and amax histories move only in the backward pass",
    "train": "`qcheck.train`, the reference trainer, leaves the same fp8 state after a step on the batch as over 2 "
             "microbatches, and clipped and weight-decayed as not; each amax history rolls once per step and holds "
             "the referee's amax of what its site received",
    "rng": "the train step's u32 entry parameters stay flat at 1, 2 and 8 layers, at the unquantized stack's count "
           "(recipes that share a stream; control: forced PRIVATE grows; the figure: the count)",
    "sharded": "the layer on a 2 x 4 mesh of host devices computes the single-device output (the figure: the "
               "largest difference)",
    "referee": "the unquantized layer computes, token by token, what a float64 numpy referee written from its "
               "router's definition computes (the figure: the worst difference relative to the token's norm)",
    "golden": "the case matches its golden file: codes and entry parameters exactly, outputs and gradients within "
              "the tolerance stored in the file",
}


def help_columns(width: int = 78) -> str:
    """The ``Columns:`` block of ``qcheck --help``: each invariant's name, then its doc wrapped beside it."""
    indent = 2 + max(map(len, DOCS)) + 1
    return "\n".join(textwrap.fill(doc, width, initial_indent=f"  {name:<{indent - 3}} ",
                                   subsequent_indent=" " * indent, break_on_hyphens=False)
                     for name, doc in DOCS.items())


def readme_table() -> str:
    """The README's invariants table."""
    return "\n".join(["| invariant | holds |", "|---|---|", *(f"| `{n}` | {d} |" for n, d in DOCS.items())])
