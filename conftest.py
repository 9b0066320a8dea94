"""Names the docstring examples in ndfunc/ use, so they run as written under --doctest-modules."""

import os

import pytest
import torch

import ndfunc as nf
from ndfunc.sharding import AbstractMesh, NamedSharding, P


if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one worker per core: each keeps to one thread, and so do the processes it
    # starts, or a worker's multi-threaded small ops wait on a core the other worker holds
    # (two orders of magnitude slower on a 2-core machine)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(nf=nf, torch=torch, P=P, NamedSharding=NamedSharding, AbstractMesh=AbstractMesh)


def pytest_collection_modifyitems(items):
    """A test that starts real gloo processes is slow too (see pyproject.toml's markers)."""
    for item in items:
        if item.get_closest_marker("gloo") is not None:
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    """The suite makes many long-lived objects (plans, the modules collection imported); at
    Python's default thresholds full collections walk them all again and again. What collection
    imported is frozen out of the collector's sight, and the young generation collects every
    10,000 allocations, not 700."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
