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
_CACHE_HIT = re.compile(r"^Persistent compilation cache hit")


class CompileLog(collections.Counter):
    """Compile requests by ``"jit(name) (arg types)"``; ``cache_hits``: how many the persistent cache served."""

    cache_hits: int = 0


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.counts = CompileLog()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if m := _COMPILING.match(message):
            self.counts[f"{m.group(1)} {m.group(2)}"] += 1
        elif _CACHE_HIT.match(message):
            self.counts.cache_hits += 1


@contextlib.contextmanager
def counting_compilations() -> Iterator[CompileLog]:
    """Yield a :class:`CompileLog` of the compile requests made inside the block."""
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
