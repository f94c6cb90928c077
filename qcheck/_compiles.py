"""Counting XLA compilations through JAX's own compile log (``jax_log_compiles``)."""

from __future__ import annotations

import collections
import contextlib
import logging
import re
from collections.abc import Iterator

import jax

# JAX logs this line for every compile request, before it looks in any cache, so
# a program served from the persistent cache still counts: it was traced,
# lowered and looked up again.
_COMPILING = re.compile(r"^Compiling (\S+) with global shapes and types (.*?)\. Argument mapping")


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if m := _COMPILING.match(record.getMessage()):
            self.counts[f"{m.group(1)} {m.group(2)}"] += 1


@contextlib.contextmanager
def counting_compilations() -> Iterator[collections.Counter[str]]:
    """Yield a Counter of compile requests inside the block, keyed by ``"jit(name) (arg types)"``."""
    collector = _Collector()
    logger = logging.getLogger("jax")
    previous_level, previous_flag = logger.level, jax.config.jax_log_compiles
    logger.addHandler(collector)
    logger.setLevel(logging.DEBUG)
    jax.config.update("jax_log_compiles", True)
    try:
        yield collector.counts
    finally:
        jax.config.update("jax_log_compiles", previous_flag)
        logger.setLevel(previous_level)
        logger.removeHandler(collector)
