"""Golden cases: what pins a recipe's numerics on a fixed seed, one JSON file per recipe × variant.

Three parts, each depending only on the ones before it:

- :mod:`~qcheck.suite.golden.store`: where a case's file lives (qcheck's own
  recipes' inside the package, a user's in the user's project), the JSON
  format, provenance, atomic writes of several files at once;
- :mod:`~qcheck.suite.golden.record`: running a case now to produce the values
  its file pins;
- :mod:`~qcheck.suite.golden.compare`: a case against its file, each drift
  named with how far and both sides' provenance (:func:`assert_case_matches`);

and :mod:`~qcheck.suite.golden.write`, what ``python -m qcheck golden add/update``
and ``pytest --update-golden`` run: record, compare, store. Files are written
only there; a file that fails to parse, has another schema or does not match
its digest is reported by name and never silently replaced by a check.
"""

from qcheck.suite._operands import site_operands  # noqa: F401 - what record reads a site with
from qcheck.suite.golden.compare import bitwise_same, assert_case_matches, differences, moved_within_tolerance
from qcheck.suite.golden.record import canonical_operands, measure, operand_codes, train_step_entry_params
from qcheck.suite.golden.store import (CANONICAL_EQN, DEFAULT_TOLERANCE, ENV, GRAD_SAMPLE, SCHEMA, Collected,
                                       GoldenCase, GoldenError, GoldenFileError, Stored, add_command, builtin_root,
                                       check_writable, collect, decode_array, digest, encode_array, golden_cases,
                                       golden_dir, grad_sample, provenance, read_case, render, root_for, to_record,
                                       update_command, user_root, writable_here, write_files)
from qcheck.suite.golden.write import summarize, write_case, write_cases

__all__ = [
    "CANONICAL_EQN",
    "DEFAULT_TOLERANCE",
    "ENV",
    "GRAD_SAMPLE",
    "SCHEMA",
    "Collected",
    "GoldenCase",
    "GoldenError",
    "GoldenFileError",
    "Stored",
    "add_command",
    "bitwise_same",
    "builtin_root",
    "canonical_operands",
    "assert_case_matches",
    "check_writable",
    "collect",
    "decode_array",
    "differences",
    "digest",
    "encode_array",
    "golden_cases",
    "golden_dir",
    "grad_sample",
    "measure",
    "moved_within_tolerance",
    "operand_codes",
    "provenance",
    "read_case",
    "render",
    "root_for",
    "summarize",
    "to_record",
    "train_step_entry_params",
    "update_command",
    "user_root",
    "writable_here",
    "write_case",
    "write_cases",
    "write_files",
]
