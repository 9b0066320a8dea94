"""Bad input is refused at the door, each with a message that says what was expected, what came
and what to do - pinned here, one row per input: the train job's flags (argparse's message, no
traceback), damaged and foreign files, and API misuse. (Errors pinned in their own modules' tests
are not repeated here.)"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

import ndfunc as nf
from models import safetensors_io, train
from ndfunc.checkpoint import CheckpointError
from ndfunc.sharding import NamedSharding, P

# --- the train job's flags: (argv, what argparse prints after "error: ") ----------------------
CLI = [
    ("--steps 0", "argument --steps: must be at least 1, got 0"),
    ("--steps -3", "argument --steps: must be at least 1, got -3"),
    ("--steps ten", "argument --steps: expected a whole number, got 'ten'"),
    ("--steps 1.5", "argument --steps: expected a whole number, got '1.5'"),
    ("--log-every 0", "argument --log-every: must be at least 1, got 0"),
    ("--seq-len 0", "argument --seq-len: must be at least 2, got 0"),
    ("--seq-len 1", "argument --seq-len: must be at least 2, got 1"),
    ("--micro-batch 0", "argument --micro-batch/--batch-size: must be at least 1, got 0"),
    ("--batch-size 0", "argument --micro-batch/--batch-size: must be at least 1, got 0"),
    ("--grad-accum 0", "argument --grad-accum: must be at least 1, got 0"),
    ("--lr -1", "argument --lr: must be a positive finite number, got -1"),
    ("--lr 0", "argument --lr: must be a positive finite number, got 0"),
    ("--lr nan", "argument --lr: must be a positive finite number, got nan"),
    ("--lr inf", "argument --lr: must be a positive finite number, got inf"),
    ("--lr fast", "argument --lr: expected a number, got 'fast'"),
    ("--warmup -5", "argument --warmup: must be at least 0, got -5"),
    ("--weight-decay -0.1", "argument --weight-decay: must be a finite number of at least 0, got -0.1"),
    ("--weight-decay nan", "argument --weight-decay: must be a finite number of at least 0, got nan"),
    ("--simulate 0", "argument --simulate: must be at least 1, got 0"),
    ("--base-batch 0", "argument --base-batch: must be at least 1, got 0"),
    ("--dp-replicate 0", "argument --dp-replicate: must be at least 1, got 0"),
    ("--dp-shard 0", "argument --dp-shard: must be at least 1, or -1 for what the other axes leave, got 0"),
    ("--dp-shard -2", "argument --dp-shard: must be at least 1, or -1 for what the other axes leave, got -2"),
    ("--cp 0", "argument --cp: must be at least 1, got 0"),
    ("--tp -1", "argument --tp: must be at least 1, got -1"),
    ("--tp two", "argument --tp: expected a whole number, got 'two'"),
    ("--save-every -1", "argument --save-every: must be at least 0, got -1"),
    ("--keep 0", "argument --keep: must be at least 1, got 0"),
    ("--resume", "--resume needs --checkpoint-dir (where the run was saved)"),
    ("--config huge", "argument --config: invalid choice: 'huge' (choose from 'tiny', 'small')"),
    ("--remat some", "argument --remat: invalid choice: 'some' (choose from 'none', 'full', 'save_dots')"),
    ("--mixed-precision fp8", "argument --mixed-precision: invalid choice: 'fp8' (choose from 'none', 'bf16')"),
    ("--lr-scaling cubic", "argument --lr-scaling: invalid choice: 'cubic' (choose from 'none', 'linear', 'sqrt')"),
    ("--reduce-grads sometimes", "argument --reduce-grads: invalid choice: 'sometimes' (choose from 'each', 'end')"),
    ("--steps", "argument --steps: expected one argument"),
    ("--no-such-flag", "unrecognized arguments: --no-such-flag"),
]


@pytest.mark.parametrize("argv,message", CLI, ids=[a for a, _ in CLI])
def test_a_bad_flag_is_refused_when_parsed(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse(argv.split())
    err = capsys.readouterr().err
    # (Python versions differ in quoting argparse's choices: compared without quotes)
    assert e.value.code == 2 and f"error: {message}".replace("'", "") in err.replace("'", ""), err
    assert "Traceback" not in err


# --- damaged and foreign files ---------------------------------------------------------------
def _safetensors(tmp_path, damage):
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    save_file({"a": torch.arange(4.0)}, str(good))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(damage(good.read_bytes()))
    return bad


SAFETENSORS = [
    ("empty", lambda b: b"", "is 0 bytes, shorter than a safetensors header's length (8 bytes)"),
    ("truncated length", lambda b: b[:7], "is 7 bytes, shorter than a safetensors header's length (8 bytes)"),
    ("huge length", lambda b: (2**63).to_bytes(8, "little") + b[8:], "says its header is 9223372036854775808 bytes"),
    ("truncated header", lambda b: b[:20], "says its header is 56 bytes, but the file has 12 after the length"),
    ("not json", lambda b: b[:8] + b"x" * 56 + b[64:], "has a damaged header (not JSON:"),
    ("not utf-8", lambda b: b[:8] + b"\x80" * 56 + b[64:], "has a damaged header (not JSON:"),
    ("a list", lambda b: (8).to_bytes(8, "little") + b"[1,2]   ", "has a header that is a JSON list"),
    ("a number", lambda b: (8).to_bytes(8, "little") + b"42      ", "has a header that is a JSON int"),
    ("offsets past the end", lambda b: b.replace(b"[0,16]", b"[0,99]", 1), "data offsets within the file's 16"),
    ("offsets reversed", lambda b: b.replace(b"[0,16]", b"[9,1] ", 1), "data offsets within the file's 16"),
    ("no offsets", lambda b: b.replace(b'"data_offsets"', b'"data_offzets"', 1), "is not a dtype, a shape and data"),
    ("no shape", lambda b: b.replace(b'"shape"', b'"shapE"', 1), "is not a dtype, a shape and data"),
    ("data cut", lambda b: b[:-4], "is not a dtype, a shape and data offsets within the file's 12 data bytes"),
]


@pytest.mark.parametrize("damage,message", [(d, m) for _, d, m in SAFETENSORS], ids=[n for n, _, _ in SAFETENSORS])
def test_a_damaged_safetensors_file_is_refused(tmp_path, damage, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        safetensors_io.SafetensorsFile(_safetensors(tmp_path, damage))


def test_a_bad_block_read_says_which_tensor(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.arange(12.0).reshape(3, 4)}, str(tmp_path / "m.safetensors"))
    f = safetensors_io.SafetensorsFile(tmp_path / "m.safetensors")
    with pytest.raises(KeyError, match=re.escape("has no tensor 'b'")):
        f.read("b")
    with pytest.raises(ValueError, match=re.escape("has 3 entries but a has rank 2")):
        f.read("a", (slice(0, 1),) * 3)
    with pytest.raises(ValueError, match=re.escape("for a has a step; blocks are contiguous slices")):
        f.read("a", (slice(0, 3, 2),))


CHECKPOINTS = [
    ("missing", lambda d: shutil.rmtree(d), "does not exist; a checkpoint is a directory written by nf.checkpoint.save"),
    ("no index", lambda d: (d / ".metadata").unlink(), "has no .metadata (an incomplete or foreign directory)"),
    ("index emptied", lambda d: (d / ".metadata").write_bytes(b""), "cannot be read"),
    ("index garbage", lambda d: (d / ".metadata").write_bytes(b"\x00" * 64), "the checkpoint is damaged"),
    ("data file truncated", lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:100]),
     "__0_0.distcp is 100 bytes, but the index reads up to byte"),
    ("data file missing", lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp is missing (the checkpoint's index"),
    ("data file corrupted", lambda d: (d / "__0_0.distcp").write_bytes(b"\x01" * (d / "__0_0.distcp").stat().st_size),
     "could not be read (UnpicklingError: invalid load key, '\\x01'.); a data file is damaged"),
]


@pytest.mark.parametrize("damage,message", [(d, m) for _, d, m in CHECKPOINTS], ids=[n for n, _, _ in CHECKPOINTS])
def test_a_damaged_checkpoint_is_refused_before_anything_is_read(tmp_path, damage, message):
    tree = {"w": torch.arange(4.0), "step": 3}
    nf.checkpoint.save(tmp_path / "ck", tree)
    damage(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        nf.checkpoint.load(tmp_path / "ck", tree)


MISMATCHED = [
    ("another shape", {"w": torch.zeros(5), "step": 0}, "'w' was saved as float32[4], but `like` has float32[5]"),
    ("an integer dtype for a float", {"w": torch.zeros(4, dtype=torch.int64), "step": 0},
     "'w' was saved as float32[4], but `like` has int64[4]; load into a tree of the saved shapes (a layout may "
     "differ, a shape may not) and dtypes (a float may be another float)"),
    ("a tensor where a scalar was", {"w": torch.zeros(4), "step": torch.zeros(())},
     "'step' was saved as not a tensor, but `like` has float32[]"),
    ("a leaf it lacks", {"w": torch.zeros(4), "step": 0, "lr": 1.0}, "has no 'lr' (it holds 2 entries"),
    ("another structure", {"weights": torch.zeros(4)}, "has no 'weights'"),
]


@pytest.mark.parametrize("like,message", [(t, m) for _, t, m in MISMATCHED], ids=[n for n, _, _ in MISMATCHED])
def test_a_tree_that_does_not_match_the_checkpoint_is_refused(tmp_path, like, message):
    nf.checkpoint.save(tmp_path / "ck", {"w": torch.arange(4.0), "step": 3})
    with pytest.raises(CheckpointError, match=re.escape(message)):
        nf.checkpoint.load(tmp_path / "ck", like)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_a_float_checkpoint_loads_into_another_float_dtype_as_to_rounds(tmp_path, dtype):
    # as DCP's own load and orbax's restore cast: a fp32 run's checkpoint read for bf16 inference
    saved = torch.randn(4, 6)
    nf.checkpoint.save(tmp_path / "ck", {"w": saved, "step": 3})
    got = nf.checkpoint.load(tmp_path / "ck", {"w": torch.zeros(4, 6, dtype=dtype), "step": 0})
    assert got["w"].dtype == dtype and torch.equal(got["w"], saved.to(dtype)) and got["step"] == 3
    with nf.simulate(4):  # each rank's block, cast as it is read
        sharding = NamedSharding(nf.make_mesh(dp_shard=2, tp=2), P("dp_shard", "tp"))
        got = nf.checkpoint.load(tmp_path / "ck", {"w": nf.device_put(torch.zeros(4, 6, dtype=dtype), sharding),
                                                   "step": 0})
        assert torch.equal(nf.device_get(got["w"]), saved.to(dtype))


@pytest.mark.parametrize("save", ["save", "async_save", "Manager.save"])
@pytest.mark.parametrize("there", ["a file", "a directory"])
def test_a_save_where_something_else_is_refuses_and_keeps_it(tmp_path, save, there):
    target = tmp_path / "run" / "step_1" if save == "Manager.save" else tmp_path / "out"
    target.parent.mkdir(exist_ok=True)
    if there == "a file":
        target.write_text("precious")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("precious")
    what = "a file" if there == "a file" else "a directory with no .metadata (not a checkpoint)"
    calls = {"save": lambda: nf.checkpoint.save(target, {"w": torch.ones(2)}),
             "async_save": lambda: nf.checkpoint.async_save(target, {"w": torch.ones(2)}),
             "Manager.save": lambda: nf.checkpoint.Manager(tmp_path / "run").save(1, {"w": torch.ones(2)})}
    with pytest.raises(CheckpointError, match=re.escape(
            f"nf.checkpoint.{save}: {target} is {what}; a save replaces only a checkpoint, so nothing was written "
            "and it is as it was. Save to another path, or move it away first.")):
        calls[save]()
    assert (target if there == "a file" else target / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # nothing written beside it


def test_a_save_replaces_a_checkpoint_or_an_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    nf.checkpoint.save(tmp_path / "empty", {"w": torch.ones(2)})
    nf.checkpoint.save(tmp_path / "empty", {"w": torch.zeros(2)})
    assert torch.equal(nf.checkpoint.load(tmp_path / "empty", {"w": torch.ones(2)})["w"], torch.zeros(2))


# --- the API ---------------------------------------------------------------------------------
API = [
    ("a checkpoint leaf of another type", lambda: nf.checkpoint.save("unused", {"f": lambda: 0}),
     TypeError, "nf.checkpoint: leaf 'f' is a function; a checkpoint holds tensors and Python scalars"),
    ("keep 0", lambda: nf.checkpoint.Manager("unused", keep=0), ValueError,
     "nf.checkpoint.Manager: keep is at least 1 (or None for all), got 0"),
    ("restore from nothing", lambda: nf.checkpoint.Manager("/nonexistent/run").restore({}), CheckpointError,
     "/nonexistent/run holds no complete checkpoint to restore"),
    ("ring attention's load balance", lambda: nf.ring_attention("cp", load_balance="round-robin"), ValueError,
     "ring_attention: load_balance is 'zigzag' or None, got 'round-robin'"),
    ("remat's policy", lambda: nf.remat(lambda x: x, policy="some"), ValueError, "nf.remat: policy is one of"),
    ("ring attention's axis", lambda: nf.ring_attention(3), TypeError,
     "ring_attention: axis is a mesh axis name (e.g. 'cp'), got 3"),
    ("fsdp's axis", lambda: nf.fsdp(3), TypeError, "nf.fsdp: axis is a mesh axis name or a tuple of them"),
    ("fsdp's prefetch", lambda: nf.fsdp("dp_shard", prefetch=-1), ValueError,
     "nf.fsdp: prefetch is a number of layers >= 0, got -1"),
    ("mixed precision's dtype", lambda: nf.mixed_precision("bf16"), TypeError,
     "nf.mixed_precision: param_dtype is a floating-point torch.dtype (e.g. torch.bfloat16), got 'bf16'"),
    ("mixed precision's reduce dtype", lambda: nf.mixed_precision(torch.bfloat16, torch.int32), TypeError,
     "nf.mixed_precision: reduce_dtype is a floating-point torch.dtype"),
    ("a transform that is not one", lambda: nf.jit(lambda x: x, transforms=[3]), TypeError,
     "nf.jit(<lambda>): transforms[0] is 3, a int; a transform is nf.fsdp(axis)"),
    ("accumulate's count", lambda: nf.accumulate(lambda p: p, 0), ValueError,
     "nf.accumulate: num_micro_batches must be an int >= 1, got 0"),
    ("accumulate's mean", lambda: nf.accumulate(lambda p: p, 2, mean="sum"), TypeError,
     "nf.accumulate: mean is True (the mean of the micro-batches' losses and gradients) or False (their sums), "
     "got 'sum'."),
    ("jit of what accumulate returns", lambda: nf.jit(nf.accumulate(lambda p, b: (p, p), 2)), TypeError,
     "nf.jit: this function is what nf.accumulate returns, which runs jitted programs of its own (one per "
     "micro-batch, its sums kept laid out as the parameters) and is compiled already; call it as it is, and give "
     "nf.accumulate the transforms= and compile= you would give nf.jit."),
    ("init's timeout", lambda: nf.init(timeout=-1), ValueError, "nf.init: timeout is a positive number of seconds"),
    ("a config size of 0", lambda: nf.ParallelConfig(tp_size=0), ValueError, "ParallelConfig.tp_size must be >= 1, got 0"),
    ("a config for another world", lambda: nf.ParallelConfig(dp_shard_size=2, tp_size=2).resolve(6), ValueError,
     "= 4, but the world has 6 ranks; choose sizes whose product is 6 (or dp_shard_size=-1 to fill the rest)"),
    ("a mesh axis of size 0", lambda: nf.make_mesh(dp=0), nf.sharding.ShardingError,
     "mesh axis 'dp' has size 0 of type int; sizes must be integers >= 1"),
    ("an axis twice in a spec", lambda: P("dp", "dp"), nf.sharding.ShardingError,
     "PartitionSpec('dp', 'dp') uses mesh axis 'dp' more than once"),
    ("a spec entry of another type", lambda: P(3), nf.sharding.ShardingError,
     "PartitionSpec entry 0 is 3 of type int; expected None, a mesh axis name (str) or a tuple of axis names"),
    ("no ranks to simulate", lambda: nf.simulate(0), ValueError, "simulate needs a number of ranks >= 1, got 0"),
    ("a key from a string", lambda: nf.random.key("x"), TypeError, "key expects an integer seed, got 'x' of type str"),
    ("a logical rule of another shape", lambda: nf.sharding.logical_to_mesh(("batch",), [("batch", 3)]),
     nf.sharding.ShardingError, "logical rule 0 is ('batch', 3); a rule is (logical name, mesh axis or tuple"),
    ("a stand-in's shape of another kind", lambda: nf.ShapeDtypeStruct(4, torch.float32), TypeError,
     "ShapeDtypeStruct: shape is a sequence of sizes >= 0, like (4096, 1024), got 4."),
    ("a stand-in's dtype as a string", lambda: nf.ShapeDtypeStruct((4,), "float32"), TypeError,
     "ShapeDtypeStruct: dtype is a torch.dtype (torch.bfloat16, ...), got 'float32'."),
    ("a stand-in's sharding as a bare spec", lambda: nf.ShapeDtypeStruct((4,), torch.float32, sharding=P("dp")),
     TypeError, "ShapeDtypeStruct: sharding is a NamedSharding(mesh, P(...)) or None, got P('dp') of type "
     "PartitionSpec; a bare P needs its mesh: NamedSharding(mesh, spec)."),
    ("a stand-in its sharding cannot split", lambda: nf.ShapeDtypeStruct(
        (5,), torch.float32, sharding=NamedSharding(nf.sharding.AbstractMesh({"dp": 2}), P("dp"))),
     nf.sharding.IndivisibleError, "ShapeDtypeStruct: dim 0 of shape (5,) has size 5"),
    ("stand-in state and bare specs with no mesh", lambda: nf.optim.state_shardings(
        nf.optim.sgd(0.1, momentum=0.9).init({"w": nf.ShapeDtypeStruct((4,), torch.float32)}), {"w": P("dp")}),
     ValueError, "nf.optim.state_shardings: the state is stand-ins (ShapeDtypeStruct) and the shardings bare "
     "P('dp')s, with no mesh to bind them to; give NamedSharding(mesh, spec)s, or call it under `with mesh:`."),
    ("a sequence that zigzag cannot cut", lambda: nf.zigzag({"tokens": torch.zeros(2, 7, dtype=torch.long)}, 2),
     ValueError, "zigzag: a sequence of 7 tokens does not cut into 2 x 2 equal chunks; use a length divisible by 4"),
]


@pytest.mark.parametrize("call,error,message", [(c, e, m) for _, c, e, m in API], ids=[n for n, *_ in API])
def test_api_misuse_says_what_was_expected(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


IN_A_WORLD = [
    ("a string for a spec", lambda mesh: nf.jit(lambda x: x * 2, mesh=mesh, in_shardings="dp")(torch.ones(4)),
     TypeError, "in_shardings for <lambda> holds the string 'dp' where a PartitionSpec belongs; write P('dp')"),
    ("a string among the specs", lambda mesh: nf.jit(lambda x, y: x * y, mesh=mesh, in_shardings=(P("dp"), "dp"))(
        torch.ones(4), torch.ones(4)), TypeError, "holds the string 'dp' where a PartitionSpec belongs"),
    ("donate_argnums out of range", lambda mesh: nf.jit(lambda x: x * 2, mesh=mesh, in_shardings=P("dp"),
                                                        donate_argnums=3)(torch.ones(4)), ValueError,
     "donate_argnums (3,) for <lambda>: it was called with 1 positional argument(s), so 3 names none"),
    ("donate_argnums out of range, lowered", lambda mesh: nf.jit(lambda x: x * 2, mesh=mesh, donate_argnums=(0, 2))
     .lower(torch.ones(4)), ValueError, "so 2 names none; donate the positions of arguments it takes (0 to 0)"),
    ("an indivisible dim", lambda mesh: nf.device_put(torch.ones(3), nf.sharding.NamedSharding(mesh, P("dp"))),
     nf.sharding.ShardingError, "dim 0 of shape (3,) has size 3, which P('dp') splits over mesh axes ('dp',)"),
    ("an axis the mesh lacks", lambda mesh: nf.sharding.NamedSharding(mesh, P("cp")), nf.sharding.ShardingError,
     "P('cp') names mesh axis 'cp', which the mesh does not have; its axes are ('dp',)"),
    ("a spec longer than the value", lambda mesh: nf.device_put(torch.ones(4), nf.sharding.NamedSharding(
        mesh, P("dp", None))), nf.sharding.ShardingError, "P('dp', None) is only valid for values of rank at least 2"),
    ("a mesh bigger than the world", lambda mesh: nf.make_mesh(dp=3), nf.sharding.ShardingError,
     "mesh dp=3 has 3 ranks but the world has 2; choose axis sizes whose product is 2"),
    ("a list as a jitted argument", lambda mesh: nf.jit(lambda x: x, mesh=mesh)([1, 2]), TypeError,
     "argument leaf '0.0' is a int (1); jitted arguments are tensors (or nf.ShapeDtypeStruct stand-ins, to lower). "
     "Make it a tensor, or mark its argument static"),
    ("a step returning a number", lambda mesh: nf.jit(lambda x: 3, mesh=mesh)(torch.ones(2)), TypeError,
     "<lambda> returned a int (3) at output leaf 0; a traced step returns tensors only"),
    ("a constraint on an axis the mesh lacks", lambda mesh: nf.jit(
        lambda x: nf.with_sharding_constraint(x, P("zz")), mesh=mesh)(torch.ones(4)), nf.sharding.ShardingError,
     "P('zz') names mesh axis 'zz', which the mesh does not have"),
    ("out_shardings on an axis the mesh lacks", lambda mesh: nf.jit(lambda x: x, mesh=mesh, out_shardings=P("zz"))(
        torch.ones(4)), nf.sharding.ShardingError, "P('zz') names mesh axis 'zz'"),
    ("a callback's block of another shape", lambda mesh: nf.make_array_from_callback(
        (4,), nf.sharding.NamedSharding(mesh, P("dp")), lambda i: torch.ones(3)), nf.sharding.ShardingError,
     "rank 0's block has shape (3,), but the sharding gives each rank a block of shape (2,)"),
    ("more in_shardings than arguments", lambda mesh: nf.jit(lambda x, y: x, mesh=mesh, in_shardings=(P(), P(), P()))(
        torch.ones(2), torch.ones(2)), ValueError, "in_shardings for <lambda> has 3 entries for 2 positional arguments"),
    ("state shardings that cover no parameter", lambda mesh: nf.optim.state_shardings(
        nf.optim.adam(1e-3).init({"a": torch.ones(4), "b": torch.ones(2)}), {"a": P("dp")}), ValueError,
     "nf.optim.state_shardings: no part of the optimizer state is shaped like param_shardings (1 specs)"),
]


@pytest.mark.parametrize("call,error,message", [(c, e, m) for _, c, e, m in IN_A_WORLD],
                         ids=[n for n, *_ in IN_A_WORLD])
def test_api_misuse_in_a_simulated_world_says_what_was_expected(call, error, message):
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        with pytest.raises(error, match=re.escape(message)):
            call(mesh)


def test_device_get_after_the_simulated_ranks_have_ended_says_so():
    with nf.simulate(2):
        x = nf.device_put(torch.ones(4), nf.sharding.NamedSharding(nf.make_mesh(dp=2), P("dp")))
    with pytest.raises(RuntimeError, match=re.escape("this value lives on ranks simulated by an nf.simulate block "
                                                     "that has ended")):
        nf.device_get(x)

