"""Names the docstring examples in ndfunc/ use, so they run as written under --doctest-modules."""

import pytest
import torch

import ndfunc as nf
from ndfunc.sharding import AbstractMesh, NamedSharding, P


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(nf=nf, torch=torch, P=P, NamedSharding=NamedSharding, AbstractMesh=AbstractMesh)


def pytest_collection_modifyitems(items):
    """A test that starts real gloo processes is slow too (see pyproject.toml's markers)."""
    for item in items:
        if item.get_closest_marker("gloo") is not None:
            item.add_marker(pytest.mark.slow)
