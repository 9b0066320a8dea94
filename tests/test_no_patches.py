"""Importing ndfunc leaves torch's and transformers' objects their own, and tracing a step swaps
ndfunc's functions in only while it traces (`ndfunc._src.swaps`)."""

import json
import pathlib
import subprocess
import sys
import threading
import types

import pytest

from ndfunc._src.swaps import Swaps

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_importing_ndfunc_and_tracing_a_step_leave_torchs_and_transformers_objects_their_own():
    # in a fresh process: the objects noted before ndfunc is imported, then inside and after a
    # traced step that goes through every swap (an old-style Function bound before the import,
    # both checkpoint variants, a compiler's hint, transformers' GQA and experts hooks)
    out = subprocess.run([sys.executable, str(REPO / "tests" / "no_patches_worker.py")], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["changed by importing ndfunc"] == []
    assert seen["swaps the test does not know"] == []  # (a new swap: name it in the worker's `named`)
    # the attribute stays torch's own; its function's code is swapped, which a bound `.apply` reaches
    # too; DTensor's costs are swapped while the partitioner asks its rules, not while tracing
    assert seen["swapped while traced"] == {
        name: name not in ("torch.autograd.Function.apply", "DTensor's redistribute_cost")
        for name in seen["swapped while traced"]}
    assert seen["use_gqa_in_sdpa while traced"] and seen["experts called as one op while traced"]
    assert seen["the step's loss and gradient are torch's"]
    assert seen["not their own after a step that raised"] == []
    assert seen["not their own after the step"] == []
    assert seen["changed after the step"] == []
    assert seen["use_gqa_in_sdpa after"] is False  # (with a mask: transformers' own answer)
    assert seen["torch.func's own refusal after"] and seen["is_compiling after"] is False


def _library():
    """A module and a class of it, as a library holds its functions."""
    module = types.ModuleType("library")
    module.double = lambda x: 2 * x

    class Base:
        def name(self):
            return "base"

    class Sub(Base):
        @staticmethod
        def three():
            return 3

    module.Base, module.Sub = Base, Sub
    return module


def _swaps(module) -> Swaps:
    swaps = Swaps()
    swaps.register(module, "double")(lambda theirs: lambda x: -theirs(x))
    swaps.register(module.Sub, "name")(lambda theirs: lambda self: "ours")
    swaps.register(module.Sub, "three")(lambda theirs: staticmethod(lambda: -theirs()))
    swaps.register("not.imported:Class", "f")(lambda theirs: pytest.fail("a module never imported is left alone"))
    return swaps


def _own(module, double, three) -> bool:
    return (module.double is double and "name" not in vars(module.Sub) and vars(module.Sub)["three"] is three
            and module.Sub().name() == "base")


def test_swaps_are_made_on_entry_and_each_librarys_own_object_is_back_on_exit_nested_or_raised_through():
    module = _library()
    double, three = module.double, vars(module.Sub)["three"]
    swaps = _swaps(module)
    with swaps.swapped():
        assert module.double(1) == -2 and module.Sub().name() == "ours" and module.Sub.three() == -3
        with swaps.swapped():  # nested: made once
            assert module.double(1) == -2
        assert module.double(1) == -2  # (the inner exit undoes nothing)
    assert _own(module, double, three)  # a method found on a base is the base's again, not a copy on the class
    with pytest.raises(KeyError), swaps.swapped(), swaps.swapped():
        raise KeyError
    assert _own(module, double, three)


def test_swaps_stay_until_the_last_thread_leaves():
    module = _library()
    double, three = module.double, vars(module.Sub)["three"]
    swaps = _swaps(module)
    entered, leave, seen = threading.Event(), threading.Event(), []

    def other():
        with swaps.swapped():
            entered.set()
            leave.wait(10)
            seen.append(module.double(1))

    t = threading.Thread(target=other)
    t.start()
    entered.wait(10)
    with swaps.swapped():
        pass  # this thread leaves first: the other is still inside
    assert module.double(1) == -2
    leave.set()
    t.join()
    assert seen == [-2] and _own(module, double, three)


def test_a_replacement_that_raises_undoes_the_swaps_made_before_it():
    module = _library()
    double, three = module.double, vars(module.Sub)["three"]
    swaps = _swaps(module)
    swaps.register(module, "double")(lambda theirs: 1 / 0)
    with pytest.raises(ZeroDivisionError), swaps.swapped():
        pass
    assert _own(module, double, three)
    with pytest.raises(ZeroDivisionError), swaps.swapped():  # and the count is not left behind
        pass
    assert _own(module, double, three)
