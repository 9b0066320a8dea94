"""Where a public function runs while a notebook drives real ranks (`nf.processes`).

Inside `with nf.processes(n):` this process is the single controller: the functions marked here
(`make_mesh`, `device_put`, a jitted step's call, ...) are not run in it but sent to every worker,
which runs the same function on its own rank; what they make stays there, and the controller gets
handles back. Outside such a block each marked function runs as it always does. This module only
keeps the stack of open blocks and the marks; `ndfunc._src.processes` does the sending.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

# The `nf.processes` blocks open in this process, innermost last. Scoped like torch's mode stack:
# a block pushes itself on entry and pops itself on exit, so nothing outlives it.
_OPEN: list[Any] = []
_EVER_OPENED = False  # only then can a handle of a block that ended come: nothing else pays to look


class Handle:
    """What the controller holds for a value that lives on the workers (an array, a mesh, an object)."""

    __slots__ = ()


def active():
    """The innermost open `nf.processes` block, or None."""
    return _OPEN[-1] if _OPEN else None


def push(controller) -> None:
    global _EVER_OPENED
    _OPEN.append(controller)
    _EVER_OPENED = True


def pop(controller) -> None:
    if controller in _OPEN:
        _OPEN.remove(controller)


def on_workers(fn: Callable | None = None, *, asynchronous: bool = False, fetch: bool = False,
               donates: Callable[..., Any] | None = None, signature: Callable[..., Any] | None = None):
    """Mark `fn` to run on every worker while an `nf.processes` block is open.

    `asynchronous`: the call returns handles at once where an earlier call of the same signature
    told what it makes (JAX's dispatch); `fetch`: its results come back by value (rank 0's), not
    as handles (`device_get`); `donates(*args, **kwargs)`: the arguments the call consumes;
    `signature(*args, **kwargs)`: what decides the results' shapes and shardings, where the
    arguments say more than that (a new callback each call, of the same code).
    """
    if fn is None:
        return functools.partial(on_workers, asynchronous=asynchronous, fetch=fetch, donates=donates,
                                 signature=signature)

    @functools.wraps(fn)
    def marked(*args, **kwargs):
        controller = active()
        if controller is None and _EVER_OPENED:  # a handle of a block that has ended says so
            controller = next((x._owner for x in handles_in((args, kwargs))), None)
        if controller is None:
            return fn(*args, **kwargs)
        donated = donates(*args, **kwargs) if donates is not None else None
        key = signature(*args, **kwargs) if signature is not None else None
        return controller.call(marked, args, kwargs, asynchronous=asynchronous, fetch=fetch, donated=donated,
                               signature=key)

    return marked


def constructed_on_workers(cls: type, args: tuple, kwargs: dict):
    """For a class's `__new__`: under a controller, the instance made on every worker (a handle),
    else None (make it here)."""
    controller = active()
    return None if controller is None else controller.call(cls, args, kwargs)


def handles_in(tree, kind: type = Handle) -> list:
    """The handles (of `kind`) among a tree's leaves."""
    import optree

    return [x for x in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(x, kind)]
