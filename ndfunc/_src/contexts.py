"""A context variable set for the extent of a `with` block: the switches tracing turns on (read in
this thread and context only, never process-global)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def set_within(var: contextvars.ContextVar, value: Any = True) -> Iterator[None]:
    """`var` holds `value` inside, what it held before after."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
