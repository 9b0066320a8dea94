"""The local program as a Python function that calls each op's C++ entry point directly.

An fx GraphModule's code calls `torch.ops.aten.mm.default(a, b)`: four attribute lookups and the
OpOverload's Python `__call__` before the op runs. A step of a small model runs hundreds of ops,
and eager autograd runs its backward from C++ without either; so the program that runs is fx's
own code with each such call bound once to the overload's entry point (`OpOverload._op`).
The GraphModule stays what passes and `as_text` read.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch

_CALL = re.compile(r"\btorch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)\(")


def direct(gm: torch.fx.GraphModule) -> Callable:
    """`gm`'s forward, with every `torch.ops.<ns>.<op>.<overload>(` call bound to the op itself."""
    code = gm.graph.python_code(root_module="self")
    bound: dict = {}

    def bind(match: re.Match) -> str:
        name = "_op_" + "_".join(match.groups())
        if name not in bound:
            ns, op, overload = match.groups()
            bound[name] = getattr(getattr(getattr(torch.ops, ns), op), overload)._op
        return name + "("

    src = _CALL.sub(bind, code.src)
    scope = dict(code.globals, **bound)
    exec(compile(src, f"<ndfunc program {id(gm):x}>", "exec"), scope)
    return functools.partial(scope["forward"], gm)
