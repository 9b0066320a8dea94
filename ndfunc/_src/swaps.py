"""Functions of torch's and of other libraries that ndfunc replaces, and only for as long as it must.

A few library functions do not let a step through tracing as they are: torch's `Function.apply`
refuses an old-style `autograd.Function` under torch.func, `torch.utils.checkpoint` runs machinery
torch.func cannot differentiate, transformers' SDPA attention repeats grouped key/value heads and
its experts run op by op. Each replacement is registered once, beside the code that needs it
(`register`), and is in place only inside `swapped()`, which the tracer enters for the extent of a
step and `nf.value_and_grad` while it differentiates. Outside, every object is the library's own,
and importing ndfunc changes none.

An attribute is process-wide state: the swaps are made by the first thread to enter and undone
by the last to leave, so each replacement does what the library's own does unless a switch of
ndfunc's (a context variable: this thread and context only) is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Swap", "Swaps", "register", "registered", "swapped"]

_INHERITED = object()  # a class's attribute found on a base: put back by deleting the subclass's


@dataclasses.dataclass(frozen=True)
class Swap:
    """`owner.name` is `replacement(theirs)` while swapped. `owner` is an object, or where ndfunc
    does not import its module, `'module'` or `'module:Class'`: swapped where that module has been
    imported, else left alone (as is an attribute this version of the library lacks)."""

    owner: object
    name: str
    replacement: Callable[[Any], Any]

    def target(self) -> object | None:
        """The object that holds the attribute now, or None where there is none."""
        if not isinstance(self.owner, str):
            return self.owner
        module, _, path = self.owner.partition(":")
        found = sys.modules.get(module)
        for part in path.split(".") if path else ():
            found = getattr(found, part, None)
        return found if found is not None and hasattr(found, self.name) else None


class Swaps:
    """A set of `Swap`s made together: on entering `swapped()` with no thread inside, undone, in
    reverse order, when the last thread inside leaves (however it leaves).

        >>> import math
        >>> swaps = Swaps()
        >>> @swaps.register(math, "sqrt")
        ... def negated(theirs):
        ...     return lambda x: -theirs(x)
        >>> with swaps.swapped():
        ...     inside = math.sqrt(4.0)
        >>> inside, math.sqrt(4.0)
        (-2.0, 2.0)
    """

    def __init__(self) -> None:
        self._swaps: list[Swap] = []
        self._lock = threading.Lock()
        self._inside = 0  # blocks inside `swapped`, all threads
        self._made: list[tuple[object, str, object]] = []  # (holder, name, the library's own) of each swap made

    def register(self, owner: object, name: str) -> Callable[[Callable], Callable]:
        """A decorator: the function it decorates, given the library's object, returns ndfunc's."""
        def add(replacement: Callable) -> Callable:
            self._swaps.append(Swap(owner, name, replacement))
            return replacement

        return add

    def registered(self) -> tuple[Swap, ...]:
        return tuple(self._swaps)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside, every registered swap is made (see the module's text)."""
        with self._lock:
            if not self._inside:
                self._make()
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if not self._inside:
                    self._undo()

    def _make(self) -> None:
        try:
            for swap in self._swaps:
                holder = swap.target()
                if holder is None:
                    continue
                theirs = getattr(holder, swap.name)
                # a class's own entry as it is (a staticmethod is put back as one)
                own = vars(holder).get(swap.name, _INHERITED) if isinstance(holder, type) else theirs
                setattr(holder, swap.name, swap.replacement(theirs))
                self._made.append((holder, swap.name, own))
        except BaseException:
            self._undo()
            raise

    def _undo(self) -> None:
        while self._made:
            holder, name, own = self._made.pop()
            if own is _INHERITED:
                delattr(holder, name)
            else:
                setattr(holder, name, own)


TRACING = Swaps()  # what a step's tracing and nf.value_and_grad's differentiation need
register = TRACING.register
registered = TRACING.registered
swapped = TRACING.swapped
