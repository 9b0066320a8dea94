"""Errors raised for malformed or impossible shardings.

Every error says what was expected, what came, and what to do. They all derive from
`ShardingError`, itself a `ValueError`, so callers can catch the family or one member.
"""

from __future__ import annotations

import os
import sys


class ShardingError(ValueError):
    """A PartitionSpec, mesh or sharding that cannot be honoured."""


class DuplicateAxisError(ShardingError):
    """A mesh axis appears more than once in one PartitionSpec."""


class UnknownAxisError(ShardingError):
    """A PartitionSpec (or rule) names a mesh axis the mesh does not have."""


class RankError(ShardingError):
    """A PartitionSpec has more entries than the value has dims."""


class IndivisibleError(ShardingError):
    """A dim's size is not a multiple of the number of blocks its axes split it into."""


def where(path: str | None) -> str:
    """The prefix that names a value in an error message: `'layers.0.wq': ` or nothing."""
    return f"{path!r}: " if path else ""


class ShardingWarning(UserWarning):
    """A program runs part of its work less sharded than its layouts allow (an op with no sharding
    rule runs whole on every rank, a sequence gathered where a ring would keep it split): correct,
    but slower or bigger than it need be."""


def user_stacklevel() -> int:
    """The `stacklevel` of the innermost caller outside ndfunc (where a warning points)."""
    here, frame, level = os.path.dirname(os.path.dirname(os.path.dirname(__file__))), sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(here):
        frame, level = frame.f_back, level + 1
    return level
