import collections

import pytest
import torch

from ndfunc.sharding import P
from ndfunc.tree import (
    keystr,
    tree_broadcast_prefix,
    tree_flatten_with_path,
    tree_map_with_path,
)


def test_paths_are_dotted_strings():
    tree = {"layers": [{"attn": {"wq": 1, "wk": 2}}], "embed": 3}
    leaves, _ = tree_flatten_with_path(tree)
    assert leaves == [("embed", 3), ("layers.0.attn.wk", 2), ("layers.0.attn.wq", 1)]
    assert tree_map_with_path(lambda path, x: f"{path}={x}", {"a": [1]}) == {"a": ["a.0=1"]}
    assert keystr(("layers", 0, "w")) == "layers.0.w"


def test_broadcast_prefix():
    values = {"embed": torch.zeros(2), "layers": [torch.zeros(2), torch.zeros(2)]}
    out = tree_broadcast_prefix({"embed": P("tp"), "layers": P()}, values)
    assert out == {"embed": P("tp"), "layers": [P(), P()]}
    assert tree_broadcast_prefix(None, values) == {"embed": None, "layers": [None, None]}
    Pair = collections.namedtuple("Pair", "a b")
    assert tree_broadcast_prefix(Pair(P("x"), None), Pair([1, 2], 3)) == Pair([P("x"), P("x")], None)


def test_broadcast_prefix_names_where_trees_differ():
    values = {"embed": torch.zeros(2), "layers": [torch.zeros(2), torch.zeros(2)]}
    with pytest.raises(ValueError, match=r"specs has no entry for 'layers'; specs has an entry for 'extra', which is not in values \(specs has keys \['embed', 'extra'\]; values: \['embed', 'layers'\]\) at the root"):
        tree_broadcast_prefix({"embed": P(), "extra": P()}, values, prefix_name="specs", full_name="values")
    with pytest.raises(ValueError, match=r"prefix tree has an entry for 'layers.2', which is not in tree \(prefix tree has keys \[0, 1, 2\]; tree: \[0, 1\]\) at 'layers'"):
        tree_broadcast_prefix({"embed": P(), "layers": [P(), P(), P()]}, values)
    with pytest.raises(ValueError, match=r"prefix tree has a list where tree has a leaf \(Tensor of shape \(2,\)\) at 'embed'"):
        tree_broadcast_prefix({"embed": [P()], "layers": P()}, values)
    with pytest.raises(ValueError, match=r"prefix tree has a tuple where tree has a list at 'layers'; a spec tree must be a prefix"):
        tree_broadcast_prefix({"embed": P(), "layers": (P(), P())}, values)
