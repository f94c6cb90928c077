"""The suite harness on top of the library: the case table, the invariants over it, golden cases, the matrix,
the command line, and the pytest plugin with the invariant test modules it collects in any repository.

Nothing in the library (``qcheck.*`` outside this package) imports it.
"""
