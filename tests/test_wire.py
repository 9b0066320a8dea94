"""What crosses between a notebook and `nf.processes`' workers, checked in one process: ndfunc
imports without the notebook extra, and ndfunc's own globals cross by name, never as copies."""

import subprocess
import sys

import torch

import ndfunc as nf
from ndfunc._src import forward
from ndfunc._src.processes import wire
from ndfunc._src.sharding import rules


def test_ndfunc_imports_without_the_notebook_extra_and_says_what_to_install():
    code = ("import sys\n"
            "for m in ('cloudpickle', 'monarch', 'matplotlib'): sys.modules[m] = None\n"
            "import ndfunc as nf\n"
            "try:\n"
            "    nf.processes(2).start()\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "install it with: pip install 'ndfunc[notebook]'" in out


def test_a_closure_of_ndfuncs_crosses_with_its_globals_by_name():
    step = rules.axis_rules([("batch", "dp")])(lambda x: rules.current_rules())
    loaded = wire.loads(wire.dumps(step))
    assert loaded(torch.ones(1)) == [("batch", "dp")]
    # the stack of open blocks and the rules' context variable are the ones of the process it lands in
    assert wire.loads(wire.dumps(lambda: forward._OPEN))() is forward._OPEN
    assert wire.loads(wire.dumps(lambda: rules._rules))() is rules._rules


def test_data_crosses_by_value_and_state_does_not():
    mesh = nf.sharding.AbstractMesh({"dp": 2})
    values = [1, "a", torch.float32, nf.sharding.P("dp"), mesh, nf.sharding.NamedSharding(mesh, nf.sharding.P()),
              nf.ShapeDtypeStruct((2,), torch.float32)]
    assert all(wire.is_value(v) for v in values)
    assert wire.loads(wire.dumps(values)) == values
    assert not wire.is_value(nf.checkpoint.Manager("/tmp/never-written"))
