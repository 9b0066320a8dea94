"""The layering docs/architecture.md draws, held: no module imports a higher layer (at its top or
inside a function), and the public namespaces re-export from private modules."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "ndfunc"
# low to high; a module may import its own layer and the ones before it
LAYERS = [
    ["_src.swaps", "_src.torch_compat", "_src.contexts", "_src.regions", "_src.forward"],
    ["_src.view_ops", "_src.write_ops", "_src.cast_ops"],  # the op tables: views, writes, casts
    ["tree", "_src.sharding", "optim", "random", "_src.buffers", "_src.collective_cost", "_src.planner", "_src.display",
     "_src.figures"],
    ["_src.host_memory", "_src.runtime", "_src.point_to_point", "_src.transfer", "_src.config", "_src.visualize", "sharding", "_src.repeated_layers",
     "_src.attention", "_src.opaque", "_src.ctc_loss", "_src.rnn", "_src.dot", "_src.experts", "_src.checkpoint_index", "_src.checkpoint", "checkpoint"],
    ["_src.autodiff", "_src.constraints", "_src.module", "nn", "_src.manual", "_src.stamp", "_src.trace", "_src.traced_as", "_src.custom_gradients", "_src.writes", "_src.copy_slices", "_src.graph_edits", "_src.varying", "lax", "_src.shard_map"],
    ["_src.partition.planning", "_src.partition.program"],  # the record the planner's node marks live in
    ["_src.partition.lower", "_src.partition.passes", "_src.partition.backends", "_src.replay"],
    ["_src.transforms", "transforms"],
    ["_src.donation", "_src.arguments", "_src.pipeline", "_src.simulated_program", "_src.stages", "_src.agreement", "_src.jit"],
    ["_src.transforms.accumulate"],  # a function transform that builds jitted programs
    ["_src.processes"],  # a notebook driving real ranks: the calls of every layer above, sent to workers
    ["", "plan"],  # ndfunc itself; nf.plan re-exports the closed forms and the replay
]


def layer_of(module: str) -> int:
    """The layer of `ndfunc.<module>`: its longest listed prefix."""
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".") or name == "") and len(name) > best:
                best, found = len(name), i
    assert found is not None, f"ndfunc.{module} is in no layer of docs/architecture.md"
    return found


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield ".".join(p for p in parts if p != "__init__"), path


def imports(path: pathlib.Path, module: str) -> set[str]:
    """Every ndfunc module `path` imports, at the top or in a function, without the `ndfunc.` prefix."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
                if not (name == "ndfunc" or name.startswith("ndfunc.")):
                    continue
                name = name.removeprefix("ndfunc").removeprefix(".")
            for alias in node.names:  # `from ndfunc._src import jit` imports the module ndfunc._src.jit
                sub = f"{name}.{alias.name}" if name else alias.name
                found.add(sub if (PACKAGE / sub.replace(".", "/")).with_suffix(".py").exists()
                          or (PACKAGE / sub.replace(".", "/")).is_dir() else name)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("ndfunc.") for a in node.names if a.name.startswith("ndfunc.")}
    return found


@pytest.mark.parametrize("module,path", list(modules()), ids=[m or "ndfunc" for m, _ in modules()])
def test_no_module_imports_a_higher_layer(module, path):
    mine = layer_of(module)
    higher = sorted(m for m in imports(path, module) if layer_of(m) > mine)
    assert not higher, f"ndfunc.{module} (layer {mine}) imports the higher {higher}"


@pytest.mark.parametrize("module,forbidden", [("_src.runtime", "_src.partition"), ("_src.trace", "_src.partition"),
                                               ("_src.sharding", "_src.runtime"), ("_src.partition.planning", "_src.runtime"),
                                               ("_src.partition.planning", "_src.transfer")])
def test_the_named_rules(module, forbidden):
    for name, path in modules():
        if name == module or name.startswith(module + "."):
            assert not [m for m in imports(path, name) if m == forbidden or m.startswith(forbidden + ".")], name


def test_internal_modules_are_private():
    public = {"", "tree", "lax", "nn", "checkpoint", "sharding", "optim", "random", "transforms", "plan"}
    for name, _ in modules():
        top = name.split(".")[0]
        assert top in public or top.startswith("_"), f"ndfunc.{name} is an internal module outside _src"
        if top in ("sharding", "transforms"):
            assert name == top, f"ndfunc.{name}: a public namespace re-exports; its modules live in _src"
