"""Every private torch API ndfunc uses, in one place.

ndfunc reads DTensor's sharding rules, runs simulated ranks on `LocalTensor`, builds a fake
process group for them, and writes fx programs; none of that is public API in torch 2.13. Each
use goes through a name here, and `tests/test_torch_compat.py` exercises every one of them, so a
torch upgrade is checked in one file (then widen `torch<` in pyproject.toml). The functions of
torch's it replaces (`_check_tensor_all_with`, the nested compile region's placeholder, DTensor's
`redistribute_cost`) are replaced only within a block (`ndfunc._src.swaps`), never at import.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import threading
from collections.abc import Callable

import torch
from torch._decomp import core_aten_decompositions, decomposition_table
from torch._library.custom_ops import OPDEFS
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.autograd.function import _is_setup_context_defined
from torch.distributed._local_tensor import (
    LocalTensor,
    LocalTensorMode,
    local_tensor_mode,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    TupleStrategy,
)
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.fx._lazy_graph_module import _use_lazy_graph_module as lazy_graph_modules
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
)

from ndfunc._src import swaps

__all__ = [
    "DTensorSpec", "FakeTensor", "FakeTensorMode", "LazyGraphModule", "LocalTensor", "LocalTensorMode", "OpSchema",
    "OpSpec", "OpStrategy", "StridedShard", "TensorMeta", "TorchDispatchMode", "TupleStrategy", "bind_ops",
    "compiled_program", "current_dispatch_mode", "dtensor_of_local", "fake_store", "group_size", "group_backend", "lazy_graph_modules", "local_blocks",
    "local_of", "local_tensor_mode", "onednn_available", "onednn_linear", "pop_dispatch_mode", "pytree", "sharding_propagator",
    "unset_fake_temporarily", "sdpa_choice", "view_rule", "view_dim_map", "renames_dims_only", "no_dispatch_modes", "rules_without_costs", "REDISTRIBUTE_LOGGER", "random_rng_tracker", "set_random_rng_tracker", "flattened",
    "functional_collectives", "process_group_ranks", "local_reduce", "shape_only_device_mesh", "traced_as_compiling", "DataDependentOutputException",
    "DynamicOutputShapeException", "core_aten_decompositions", "decomposition_table",
    "route_nested_compile_regions", "func_transforms", "current_tracer", "function_modes", "current_graph", "outside_the_trace",
    "trace_nested", "node_of", "tracked", "fake_like", "known_fakes", "new_node", "runs_hooks", "lstm_cells",
    "registered_gradient", "has_setup_context", "func_transforms_active", "traced_constant",
    "no_python_dispatch",
]

current_dispatch_mode = _get_current_dispatch_mode
pop_dispatch_mode = _pop_mode_temporarily
no_dispatch_modes = _disable_current_modes  # a block where no Python dispatch mode sees an op (the
# simulation's, fake tensors', a user's): the compiler's own arithmetic on plain tensors
no_python_dispatch = torch._C._DisableTorchDispatch  # a block where no op reaches Python's dispatch
# (modes nor tensor subclasses), switched off in C++ (torch.utils._mode_utils.no_dispatch)
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"  # DTensor's redistribute warnings


_WITHOUT_COSTS: set[int] = set()  # threads asking DTensor's rules for strategies only
_COSTS_SWAP = swaps.Swaps()  # DTensor's `redistribute_cost`, while any thread asks for strategies only


@_COSTS_SWAP.register("torch.distributed.tensor._ops.utils", "redistribute_cost")
def _zero_on_threads_without_costs(torchs: Callable) -> Callable:
    @functools.wraps(torchs)
    def redistribute_cost(*args, **kwargs):
        if threading.get_ident() in _WITHOUT_COSTS:
            return 0.0
        return torchs(*args, **kwargs)

    return redistribute_cost


@contextlib.contextmanager
def rules_without_costs():
    """A block in which DTensor's op rules, asked on this thread, skip the redistribute cost they
    work out for every strategy (ndfunc's partitioner prices layout changes itself; for `cat`
    on four mesh axes that work is most of the rule's time): it reads as 0. Other threads get
    DTensor's costs as ever; outside every such block, DTensor's function is its own."""
    me = threading.get_ident()
    nested = me in _WITHOUT_COSTS
    with _COSTS_SWAP.swapped():
        _WITHOUT_COSTS.add(me)
        try:
            yield
        finally:
            if not nested:
                _WITHOUT_COSTS.discard(me)


def view_rule(op) -> tuple | None:
    """`(dim_map, strict_view, propagate)` of DTensor's rule for a view-like op (view, reshape,
    permute, squeeze, unsqueeze, expand, transpose...: the ops its `reshape_strategy` serves), else
    None. `propagate(placements, shape, dim_map(*args), mesh_shape, strict_view)` gives the input
    layout the rule asks for and the output's, which is all the rule does per input layout, less
    the specs and redistribute costs it builds around that."""
    from torch.distributed.tensor._ops import _view_ops

    fn = sharding_propagator().op_strategy_funcs.get(op)
    if fn is None or getattr(fn, "__name__", None) != "reshape_strategy" or fn.__closure__ is None:
        return None
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
    if set(cells) != {"dim_map", "strict_view"}:
        return None
    return cells["dim_map"], cells["strict_view"], _view_ops.propagate_shape_and_sharding


def view_dim_map():
    """DTensor's dim maps of views: the module whose `view_groups(from_shape, to_shape)` builds one
    and whose `InputDim`, `Flatten`, `Split`, `Singleton`, `NewDim`... are its commands."""
    from torch.distributed.tensor._ops import _view_ops

    return _view_ops


def renames_dims_only(dim_map: tuple) -> bool:
    """Whether a view rule's dim map (`view_rule`'s `dim_map(*args)`) makes each output dim an
    input dim or a new dim of size 1, and nothing else (permute, transpose, squeeze, unsqueeze):
    no dim flattened, split, broadcast or repeated."""
    from torch.distributed.tensor._ops._view_ops import InputDim, Singleton

    return all(type(cmd) in (InputDim, Singleton) for cmd in dim_map)


def sharding_propagator():
    """DTensor's ShardingPropagator: `op_strategy_funcs`, `op_single_dim_strategy_funcs`,
    `op_to_schema_info`, `propagate_op_sharding_non_cached` and the shape-argument tables."""
    return DTensor._op_dispatcher.sharding_propagator


def rewrites_shape_args(op) -> bool:
    """Whether DTensor rewrites `op`'s shape arguments for local blocks: its propagator's tables
    of shape-and-stride, scalar-shape and squeeze ops (2.11, the GPU image's torch, has only the
    first)."""
    p = sharding_propagator()
    return any(op in getattr(p, table, ()) for table in (
        "op_to_shape_and_stride_idx", "op_to_scalar_shape_adjuster", "squeeze_op_to_dims_variant"))


def local_of(x: DTensor) -> torch.Tensor:
    """A DTensor's local block, without `to_local`'s autograd function."""
    return x._local_tensor


def dtensor_of_local(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor over `local` laid out by `spec`, without `from_local`'s autograd function or checks."""
    return DTensor(local, spec, requires_grad=False)


def local_blocks(x: LocalTensor) -> dict[int, torch.Tensor]:
    """Each simulated rank's tensor, by rank."""
    return x._local_tensors


def fake_store():
    """A store for `init_process_group("fake", ...)` (importing it registers the backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def random_rng_tracker():
    """DTensor's random-number tracker (LocalTensorMode replaces it while simulating)."""
    from torch.distributed.tensor import _random

    return _random._rng_tracker


def set_random_rng_tracker(tracker) -> None:
    from torch.distributed.tensor import _random

    _random._rng_tracker = tracker


def _process_group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def process_group_ranks(group_name: str) -> tuple[list[int], list[int]]:
    """The ranks of the group `group_name` names, relative to its first, and the first rank of each
    group of that shape tiling the world: how the simulated-tensor mode forms a collective's groups
    (`_local_tensor._c10d._prepare_collective_groups`), so a collective computed outside the mode
    reduces over the same ranks in the same order."""
    from torch.distributed._local_tensor import _c10d

    members, offsets, _ = _c10d._prepare_collective_groups(_process_group(group_name))
    return members, offsets


def local_reduce(reduce_op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The simulated-tensor mode's reduction of the ranks' tensors (in rank order)."""
    from torch.distributed._local_tensor import _c10d

    return _c10d._local_reduce(reduce_op, tensors)


def group_size(group_name: str) -> int:
    """Ranks in the process group a functional collective names."""
    return _process_group(group_name).size()


def group_backend(group_name: str) -> str:
    """The backend name of the process group a functional collective names ('gloo', 'cpu:gloo,cuda:nccl')."""
    import torch.distributed as dist

    return dist.get_backend(_process_group(group_name))


def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear kernel (`onednn_linear`)."""
    return hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` by oneDNN's matmul (fp32, CPU): a linear layer's kernel, x @ w.T with w = b.T as it
    lies (no bias, no fused op)."""
    return torch.ops.mkldnn._linear_pointwise.default(a, b.t(), None, "none", [], "")


def lstm_cells(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """`torch.lstm` (its `input` overload) as PyTorch's decomposition writes it with the cells it
    takes off the CPU (`one_layer_lstm`: matmuls and pointwise ops per step), where on the CPU it
    picks oneDNN's layer kernel whenever oneDNN is enabled and nothing outside `torch.func` needs
    a gradient: the choice read off no global flag."""
    from torch._decomp import decompositions  # noqa: PLC0415 - its private helpers, here only

    params = decompositions.gather_params(params, has_biases, hx[0].size(2) != hx[1].size(2))
    out, final = decompositions._rnn_helper(input, list(zip(hx[0], hx[1])), params, has_biases, num_layers, dropout,
                                            train, bidirectional, batch_first, decompositions.one_layer_lstm)
    final = list(zip(*final))
    return out, torch.stack(final[0], 0), torch.stack(final[1], 0)


_CALL = re.compile(r"\btorch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)\(")


def bind_ops(gm: torch.fx.GraphModule) -> Callable:
    """`gm`'s forward, its code as fx writes it with every `torch.ops.<ns>.<op>.<overload>(` call
    bound once to the overload's C++ entry point (`OpOverload._op`): no attribute lookups and no
    Python `__call__` per op."""
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


def sdpa_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> int:
    """The `SDPBackend` value torch's scaled_dot_product_attention would run for these inputs."""
    return int(torch._fused_sdp_choice(q, k, v, mask))


def compiled_program(gm: torch.fx.GraphModule, backend: str) -> Callable:
    """`gm` through `torch.compile` (static shapes), compiled on its first call: one graph, or one
    between each two calls of a function marked `torch.compiler.disable` (a ring's point-to-point
    exchanges). A lazy graph module's forward is written first (Dynamo does not trace the lazy stub)."""
    if isinstance(gm, LazyGraphModule):
        gm.real_recompile()
    return torch.compile(gm, backend=backend, dynamic=False)


def flattened(device_mesh_slice):
    """One DeviceMesh over the axes of `device_mesh[names]` together (their process group)."""
    return device_mesh_slice._flatten()


def functional_collectives():
    """`torch.distributed._functional_collectives`: the traceable collectives."""
    import torch.distributed._functional_collectives as funcol

    return funcol


def shape_only_device_mesh(sizes: tuple[int, ...]):
    """A DeviceMesh of `sizes` with no process group behind it (DTensor's rules read only its shape)."""
    import math

    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(math.prod(sizes)).view(sizes), _init_backend=False, _rank=0)


_CHECKS_AS_HINTS = contextvars.ContextVar("ndfunc_checks_as_hints", default=False)


@contextlib.contextmanager
def traced_as_compiling():
    """`torch.compiler.is_compiling()` is True inside, as during torch.export's make_fx tracing
    (torch's own flag for tracers, set as torch.export sets it): libraries skip the checks that
    read a tensor's value (transformers' attention-mask checks). What they call instead as a
    compiler's hint, `torch._check_tensor_all(cond)`, checks the condition's type and not its
    values (a trace has none) in this thread and context, inside `swaps.swapped()` too (the
    tracer's): transformers' image-token count of a vision-language model."""
    import torch.compiler as compiler

    old = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    token = _CHECKS_AS_HINTS.set(True)
    try:
        yield
    finally:
        compiler._is_compiling_flag = old
        _CHECKS_AS_HINTS.reset(token)


@swaps.register(torch, "_check_tensor_all_with")
def _check_as_hint(torchs: Callable) -> Callable:
    """`torch._check_tensor_all_with`: torch's, less its read of the values inside `traced_as_compiling`."""
    def check(error_type, cond, message=None) -> None:
        if not _CHECKS_AS_HINTS.get():
            return torchs(error_type, cond, message)
        if not isinstance(cond, torch.Tensor):
            raise TypeError(f"cond must be a tensor, but got {type(cond)}")
        if cond.dtype != torch.bool:
            raise TypeError(f"cond tensor must have dtype torch.bool, but got {cond.dtype}")
        return None

    return check


def route_nested_compile_regions(current: Callable, within: swaps.Swaps = swaps.TRACING) -> None:
    """Inside `within.swapped()`, a call of a function marked with
    `torch.compiler.nested_compile_region` is `current()(fn, args, kwargs)` where `current()`
    gives a function; where it gives None, and outside, the mark does what torch's does (eager:
    calls `fn`; torch.compile reads the mark in Dynamo)."""
    import importlib

    module = importlib.import_module("torch._higher_order_ops.invoke_subgraph")  # (the package's name is the op)

    @within.register(module, "invoke_subgraph_placeholder")
    def routed(torch_call: Callable) -> Callable:
        def placeholder(fn, *args, **kwargs):
            call = current()
            return torch_call(fn, *args, **kwargs) if call is None else call(fn, args, kwargs)

        return placeholder


def registered_gradient(name: str) -> tuple | None:
    """(schema, backward, setup_context) of the `torch.library.custom_op` named `name` (ns::op)
    where a gradient was registered for it (`register_autograd`; setup_context may be None); else
    None (no such op, or one defined otherwise)."""
    found = OPDEFS.get(name)
    if found is None or found._backward_fn is None:
        return None
    return found._opoverload._schema, found._backward_fn, found._setup_context_fn


def has_setup_context(cls) -> bool:
    """Whether the `autograd.Function` class `cls` defines `setup_context` (the form torch.func takes)."""
    return _is_setup_context_defined(cls.setup_context)


def func_transforms_active() -> bool:
    """Whether any `torch.func` transform is in force (cheaper than `func_transforms`)."""
    return torch._C._are_functorch_transforms_active()


def func_transforms() -> list[str]:
    """The `torch.func` transforms in force, outermost first: "Grad" (grad, vjp), "Vmap", "Jvp", ..."""
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return [i.key().name for i in retrieve_all_functorch_interpreters()]


def current_tracer():
    """The fx tracer of the `make_fx` trace in progress; None outside one (or where it is paused)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer


def function_modes() -> list:
    """The torch function modes in force, outermost first."""
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()


def current_graph() -> torch.fx.Graph:
    return current_tracer().graph


@contextlib.contextmanager
def outside_the_trace():
    """Ops inside run on fake tensors only: not recorded, not differentiated by `torch.func`."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing(), temporarily_clear_interpreter_stack():
        yield


def traced_constant(x: torch.Tensor) -> torch.Tensor | None:
    """The value of `x` where the trace knows it (a literal's: fake tensor's `constant`, under
    torch.func's wrappers), else None."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x.constant if isinstance(x, FakeTensor) else None


def trace_nested(fn: Callable, args: list) -> torch.fx.GraphModule:
    """`fn(*args)` traced into a graph of its own by the `make_fx` trace in progress (its fake mode
    and decompositions), as higher-order ops trace their bodies."""
    from torch.fx.experimental import proxy_tensor

    with outside_the_trace():
        return proxy_tensor._CURRENT_MAKE_FX_TRACER.trace_subgraph(fn, *args)


def node_of(x: torch.Tensor, tracer) -> torch.fx.Node | None:
    """The node of the trace that made `x` (under `torch.func` transforms: of the tensor they wrap);
    None for a tensor the trace did not make (a constant)."""
    from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    while is_functorch_wrapped_tensor(x):
        x = get_unwrapped(x)
    slot = get_proxy_slot(x, tracer, None)
    return None if slot is None else slot.proxy.node


def tracked(x: torch.Tensor, node: torch.fx.Node, tracer, own: bool = True) -> torch.Tensor:
    """`x` (of static shape), recorded as what `node` makes. Where `own`, its `meta['val']` becomes
    `x` (`meta['tensor_meta']` is left as it is: `track_tensor_tree` without the metadata made again);
    else `node` keeps the value it was made with."""
    from torch.fx.experimental.proxy_tensor import _ProxyTensor, set_proxy_slot

    set_proxy_slot(x, tracer, _ProxyTensor(torch.fx.Proxy(node, tracer), None))
    if own:
        node.meta["val"] = x
    return x


def known_fakes(mode: FakeTensorMode, fakes: list[FakeTensor]) -> None:
    """Let `mode` take `fakes` (its own) as they are wherever it is asked for a fake of them.
    `make_fx` asks it for each input, and a fake tensor it did not make from a tensor is made
    again, field by field (a third of a millisecond each; a 70B model's step has 2,000 inputs)."""
    for x in fakes:
        mode.fake_tensor_converter.set_tensor_memo(x, x)


def fake_like(x: FakeTensor) -> FakeTensor:
    """A new fake tensor of `x`'s fake mode, shape, strides, storage offset, dtype and device, built
    on a meta tensor: no mode or transform sees it made, so nothing is recorded (dispatch to
    Python turned off in C++, not the modes popped and pushed back: a trace makes thousands)."""
    with torch._C.DisableTorchFunction(), torch._C._DisableFuncTorch(), no_python_dispatch():
        offset = x.storage_offset()
        if offset == 0:
            meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        else:  # a view into a larger buffer, at the same place
            size = offset + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1
            meta = torch.empty(size, dtype=x.dtype, device="meta").as_strided(x.shape, x.stride(), offset)
        return FakeTensor(x.fake_mode, meta, x.device)


def new_node(graph: torch.fx.Graph, op: str, target, args: tuple = (), kwargs: dict | None = None,
             name: str | None = None) -> torch.fx.Node:
    """`graph.create_node(op, target, args, kwargs, name)`, made as it makes it less two costs a
    lowering pays per node (it makes hundreds of thousands): the walk 2.13's `create_node` makes
    over every argument with pytree to warn of raw SymInts (ndfunc's programs have static shapes),
    and the name it derives and cleans from the target afresh each time (here once per target).
    `args` is a tuple. A graph whose module hooks node creation gets `create_node` itself."""
    module = graph.owning_module
    if module is not None and getattr(module, "_create_node_hooks", None):
        node = graph.create_node(op, target, name=name)
        if args:
            node.args = args
        if kwargs:
            node.kwargs = kwargs
        return node
    if name is None:
        try:
            name = _TARGET_NAMES.get(target)
        except TypeError:  # an unhashable target
            name = graph._target_to_str(target)
        if name is None:  # as `create_name` cleans it (an op's `add.Tensor`), once
            name = _TARGET_NAMES[target] = _ILLEGAL_CHARACTERS.sub("_", graph._target_to_str(target))
    namespace = graph._graph_namespace
    name = namespace.create_name(name, None)
    node = torch.fx.Node(graph, name, op, target, args, kwargs or {})
    namespace.associate_name_with_obj(name, node)
    graph._insert(node)
    graph._find_nodes_lookup_table.insert(node)
    graph._len += 1
    return node


_TARGET_NAMES: dict = {}  # target -> the name `create_node` starts a node of it from
_ILLEGAL_CHARACTERS = torch.fx.graph._illegal_char_regex


def eliminate_dead_code(graph: torch.fx.Graph) -> bool:
    """`graph.eliminate_dead_code()` on a graph built in order, without its `lint` first (a walk
    over every node and argument) and asking only the nodes nothing reads whether they are pure
    (its own asks every node: a lowering's tens of thousands). A graph whose module holds
    subgraphs gets torch's own, which cleans those too."""
    module = graph.owning_module
    if module is not None and any(isinstance(m, torch.fx.GraphModule) for m in module.children()):
        return graph.eliminate_dead_code(lambda node: len(node.users) > 0 or node.is_impure())
    changed = False
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure():
            graph.erase_node(node)
            changed = True
    return changed


def runs_hooks(module: torch.nn.Module) -> bool:
    """Whether calling `module` runs a hook: one of its own or of a module inside it, or a global one."""
    m = torch.nn.modules.module
    if m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks or m._global_backward_pre_hooks:
        return True
    return any(sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks
               for sub in module.modules())
