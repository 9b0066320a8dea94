"""Bytes each rank sends per mesh axis: ndfunc's llama train step against XLA's, from one model.

    python benchmarks/xla.py                        # every row
    python benchmarks/xla.py --rows 4d 4d@1 --json OUT
    python benchmarks/xla.py --unflattened-loss     # JAX's loss over (B, L, V), not (B*L, V)

Needs JAX (`pip install -e '.[bench]'`); only this script imports it.

Each row lowers the main job's step (`models.train.make_step`: the tiny llama's loss, gradients,
global-norm clipping and AdamW, the activations laid out by `nf.ParallelConfig.rules`) on the mesh
axes `dp_replicate, dp_shard, cp, tp`, every parameter, moment and the batch laid out by the same
PartitionSpecs, twice:

- ndfunc: `nf.jit(...).lower` on simulated ranks; `cost_analysis()["by_axes"]` sums the program's
  `Comm` records, the bytes each rank sends, by the mesh axes each collective runs over.
- XLA: the same llama in jax.numpy op for op (below; the residual stream constrained where the
  rules constrain it, the logits flattened to (B*L, V) for the loss as `F.cross_entropy` takes
  them), `jax.jit(...).lower(...).compile()` on host CPU devices, and the collectives of the
  compiled HLO (`as_text()`) read with their shapes and replica groups. `--unflattened-loss`
  takes the cross-entropy over (B, L, V) as JAX code would write it: XLA then keeps the
  sequence split over `cp` through the loss, where the flatten strides each rank's tokens.

XLA's collectives are priced as `Comm.moved` prices ndfunc's (ring algorithms; n ranks in a
group): an all-gather sends (n-1)/n of its result, an all-reduce 2(n-1)/n of its operand, a
reduce-scatter or all-to-all (n-1)/n of its operand, a collective-permute its operand from each
rank that sends to another (averaged over the ranks). XLA's CPU pipeline leaves a gradient's
reduction an all-reduce whose every use keeps a 1/k slice at an offset computed from the partition
id; its GPU pipeline makes a reduce-scatter of it (a reduce-scatter over k ranks, then an
all-reduce of the slice over the other n/k, where k < n), and so it is priced here. A collective
belongs to the mesh axes along which the members of its replica groups differ; a 1/k slice, to the
axes among them that shard parameters and whose sizes multiply to k (dp_shard, not dp_replicate).

Both programs then run two steps from the same init (`nf.random` is bit-exact with `jax.random`,
checked here) on the same batch: equal losses, before and after an update, show they are one model.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's warnings ("involuntary full rematerialization") off
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)  # int64 tokens, as torch's: an integer gather moves as many bytes
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optree  # noqa: E402
import torch  # noqa: E402
from jax.sharding import Mesh, NamedSharding as JaxSharding, PartitionSpec as JaxSpec  # noqa: E402

import ndfunc as nf  # noqa: E402
from models import llama, train  # noqa: E402
from ndfunc.sharding import NamedSharding, P  # noqa: E402
from ndfunc.tree import tree_map_with_path  # noqa: E402

AXES = ("dp_replicate", "dp_shard", "cp", "tp")
SEQ_LEN, MICRO_BATCH = 128, 8  # the job's defaults (models.train): sequences per data-parallel rank
# fp32 losses, each partitioner summing in its own order: a few units in the last place apart
LOSS_ULPS = 8
LR, WEIGHT_DECAY, MAX_NORM = 3e-3, 0.1, 1.0  # the job's peak learning rate (its schedule moves no bytes)
# name: ((dp_replicate, dp_shard, cp, tp), sequences per data-parallel rank), 8 devices each. TP is
# 4 ways beside 2 replicas: the tiny llama's 4 key/value heads split at most 4 ways (neither side
# splits a dim unevenly).
ROWS = {
    "dp": ((8, 1, 1, 1), MICRO_BATCH), "fsdp": ((1, 8, 1, 1), MICRO_BATCH), "tp": ((2, 1, 1, 4), MICRO_BATCH),
    "cp": ((1, 1, 8, 1), MICRO_BATCH), "hsdp": ((2, 4, 1, 1), MICRO_BATCH), "fsdp+tp": ((1, 4, 1, 2), MICRO_BATCH),
    "fsdp+cp": ((1, 4, 2, 1), MICRO_BATCH), "hsdp+tp": ((2, 2, 1, 2), MICRO_BATCH), "4d": ((1, 2, 2, 2), MICRO_BATCH),
    "4d@4": ((1, 2, 2, 2), 4), "4d@2": ((1, 2, 2, 2), 2), "4d@1": ((1, 2, 2, 2), 1),
}


def optimizer() -> nf.optim.GradientTransformation:
    """The job's optimizer (models.train), at a constant learning rate."""
    return nf.optim.chain(nf.optim.clip_by_global_norm(MAX_NORM), nf.optim.adamw(LR, weight_decay=WEIGHT_DECAY))


# --- the llama in jax.numpy, op for op as models/llama.py writes it in torch ----------------------

def rms_norm(x_BLD, scale_D, eps):
    x = x_BLD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps)
    return scale_D * x.astype(x_BLD.dtype)


def rope_tables(positions_BL, head_dim, theta):
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions_BL.astype(jnp.float32)[..., None] * inv_freq  # (B, L, K/2)
    angles = jnp.concatenate([angles, angles], -1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BLHK, cos_BLK, sin_BLK):
    x1, x2 = jnp.split(x_BLHK, 2, -1)
    rotated = jnp.concatenate([-x2, x1], -1)
    return x_BLHK * cos_BLK[:, :, None] + rotated * sin_BLK[:, :, None]


def attention(layer, x_BLD, cos, sin, mask_BLL):
    q_BLHK = jnp.einsum("bld,dhk->blhk", x_BLD, layer["wq"])
    k_BLGK = jnp.einsum("bld,dgk->blgk", x_BLD, layer["wk"])
    v_BLGK = jnp.einsum("bld,dgk->blgk", x_BLD, layer["wv"])
    q_BLHK, k_BLGK = apply_rope(q_BLHK, cos, sin), apply_rope(k_BLGK, cos, sin)
    # SDPA's counterpart: query head h reads key/value head h // R, scores scaled by 1/sqrt(K)
    o_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, mask=mask_BLL[:, None], implementation="xla")
    return jnp.einsum("blhk,hkd->bld", o_BLHK, layer["wo"])


def mlp(layer, x_BLD):
    return (jax.nn.silu(x_BLD @ layer["w1"]) * (x_BLD @ layer["w3"])) @ layer["w2"]


def jax_loss(cfg: llama.LlamaConfig, residual, flatten: bool):
    """llama.loss in jax.numpy; `residual` lays out the stream between layers as llama._residual."""
    def loss(params, batch):
        positions_BL = batch["positions"]
        mask_BLL = positions_BL[:, :, None] >= positions_BL[:, None, :]
        cos, sin = rope_tables(positions_BL, cfg.head_dim, cfg.rope_theta)
        x_BLD = residual(jnp.take(params["embed"], batch["tokens"], axis=0))
        for layer in params["layers"]:
            h_BLD = rms_norm(x_BLD, layer["attn_norm"], cfg.norm_eps)
            x_BLD = x_BLD + attention(layer["attn"], h_BLD, cos, sin, mask_BLL)
            x_BLD = residual(x_BLD + mlp(layer["mlp"], rms_norm(x_BLD, layer["mlp_norm"], cfg.norm_eps)))
        logits_BLV = rms_norm(x_BLD, params["norm"], cfg.norm_eps) @ params["lm_head"]
        logits, targets = logits_BLV.astype(jnp.float32), batch["targets"]
        if flatten:  # as F.cross_entropy takes them: (B*L, V)
            logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        valid = targets != llama.IGNORE_INDEX
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.where(valid, targets, 0)[..., None], -1)
        return -jnp.sum(jnp.where(valid, picked[..., 0], 0.0)) / jnp.sum(valid)
    return loss


def jax_step(loss, b1=0.9, b2=0.999, eps=1e-8):
    """One step of `optimizer()` in jax.numpy, as ndfunc.optim computes it."""
    def step(params, state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        g_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        grads = jax.tree.map(lambda g: jnp.where(g_norm < MAX_NORM, g, g / g_norm * MAX_NORM), grads)
        count, mu, nu = state
        mu = jax.tree.map(lambda g, m: m + (1 - b1) * (g - m), grads, mu)  # torch.lerp
        nu = jax.tree.map(lambda g, v: b2 * v + (1 - b2) * g * g, grads, nu)  # torch.addcmul
        count = count + 1
        c1, c2 = (-jnp.expm1(count.astype(jnp.float32) * math.log(b)) for b in (b1, b2))
        update = lambda m, v, p: (m / (jnp.sqrt(v / c2) + eps) / c1 + WEIGHT_DECAY * p) * -LR  # noqa: E731
        params = jax.tree.map(lambda p, m, v: p + update(m, v, p), params, mu, nu)
        return params, (count, mu, nu), value
    return step


def jax_init(cfg: llama.LlamaConfig, seed: int) -> dict:
    """llama.init with jax.random: the same key per parameter path, the same normals."""
    def one(path, shape):
        if path.endswith("norm"):
            return jnp.ones(tuple(shape), jnp.float32)
        key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(path.encode()) & 0x7FFFFFFF)
        return jax.random.normal(key, tuple(shape), jnp.float32) * llama.INIT_STD
    return tree_map_with_path(one, llama.param_shapes(cfg), is_leaf=lambda s: isinstance(s, torch.Size))


# --- the two programs of a row ---------------------------------------------------------------------

@dataclasses.dataclass
class Side:
    by_axes: dict[tuple[str, ...], dict[str, float]]  # mesh axes -> kind -> bytes each rank sends
    losses: tuple[float, float]  # before and after one update
    flops: float  # per rank, as each side's cost analysis counts them

    @property
    def total(self) -> float:
        return sum(sum(kinds.values()) for kinds in self.by_axes.values())


def specs_of(cfg: llama.LlamaConfig, config: nf.ParallelConfig) -> dict:
    return nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)


def ndfunc_side(cfg, config: nf.ParallelConfig, params: dict, batch: dict) -> Side:
    opt = optimizer()
    with nf.simulate(config.total_size):
        mesh = config.build_mesh()
        pspec = specs_of(cfg, config)
        state = opt.init(params)
        sspec = nf.optim.state_shardings(state, pspec)
        bspec = {k: config.batch_spec for k in batch}
        step = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh, in_shardings=(pspec, sspec, bspec),
                      out_shardings=(pspec, sspec, P()))
        put = lambda tree, specs: nf.device_put(tree, optree.tree_map(  # noqa: E731
            lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)))
        params, state, batch = put(params, pspec), put(state, sspec), put(batch, bspec)
        costs = step.lower(params, state, batch).cost_analysis()
        by_axes = {axes: {kind: c["bytes"] for kind, c in kinds.items()} for axes, kinds in costs["by_axes"].items()}
        params, state, first = step(params, state, batch)
        second = step(params, state, batch)[2]
        return Side(by_axes, (float(nf.device_get(first)), float(nf.device_get(second))), float(costs["flops"]))


def xla_side(cfg, config: nf.ParallelConfig, params: dict, batch: dict, flatten: bool) -> Side:
    sizes = tuple(config.sizes.values())
    mesh = Mesh(np.array(jax.devices()[:config.total_size]).reshape(sizes), AXES)
    to_jax = lambda spec: JaxSharding(mesh, JaxSpec(*spec))  # noqa: E731
    pspec = optree.tree_map(to_jax, specs_of(cfg, config), is_leaf=lambda s: isinstance(s, P))
    residual_spec = to_jax(nf.sharding.logical_to_mesh(("batch", "seq", None), config.rules))
    residual = lambda x: jax.lax.with_sharding_constraint(x, residual_spec)  # noqa: E731
    sspec = (to_jax(P()), pspec, pspec)
    bspec = {k: to_jax(config.batch_spec) for k in batch}
    step = jax.jit(jax_step(jax_loss(cfg, residual, flatten)), in_shardings=(pspec, sspec, bspec),
                   out_shardings=(pspec, sspec, to_jax(P())))
    zeros = jax.tree.map(jnp.zeros_like, params)
    args = (params, (jnp.zeros((), jnp.int32), zeros, zeros), batch)
    compiled = step.lower(*args).compile()
    new_params, state, first = compiled(*args)
    second = compiled(new_params, state, batch)[2]
    by_axes = Hlo(compiled.as_text(), sizes, parameter_axes(pspec)).bytes_by_axes()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return Side(by_axes, (float(first), float(second)), float(analysis.get("flops", float("nan"))))


def parameter_axes(shardings) -> set[str]:
    """The mesh axes that split some parameter."""
    axes = set()
    for sharding in jax.tree.leaves(shardings):
        for entry in sharding.spec:
            axes.update((entry,) if isinstance(entry, str) else entry or ())
    return axes


# --- XLA's compiled HLO: its collectives, priced as ndfunc's Comm.moved -------------------------------

@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    op: str
    operands: tuple[str, ...]
    attrs: str
    inside: str  # the text between the op's parentheses: a parameter's number, a constant's literal


_ARRAY = re.compile(r"\b(pred|bf16|[suf]\d+)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8}
_KINDS = {"all-gather": "all_gather", "all-reduce": "all_reduce", "reduce-scatter": "reduce_scatter",
          "all-to-all": "all_to_all", "collective-permute": "ppermute"}
_VIEWS = ("bitcast", "reshape", "copy", "transpose")  # a use through these is a use of the same elements


def array_bytes(shape: str) -> list[int]:
    """Bytes of each array in an HLO shape (one, or a tuple's elements in order)."""
    return [_ITEMSIZE[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(shape)]


def _closing(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced HLO: {text[start:start + 80]!r}")


def parse_instruction(line: str) -> Instruction:
    line = line.strip().removeprefix("ROOT ")
    name, _, rest = line.partition(" = ")
    end = _closing(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op, _, _ = rest.partition("(")
    close = _closing(rest, len(op))
    inside = rest[len(op) + 1:close - 1]
    return Instruction(name.lstrip("%"), shape, op, tuple(re.findall(r"%([\w.\-]+)", inside)), rest[close:], inside)


def iota(n: int, dims: str | None, perm: str | None) -> np.ndarray:
    """XLA's iota device list: 0..n-1 reshaped to `dims`, transposed by `perm`, flattened."""
    ids = np.arange(n)
    if dims:
        ids = ids.reshape([int(d) for d in dims.split(",")])
        if perm:
            ids = ids.transpose([int(p) for p in perm.split(",")])
    return ids.reshape(-1)


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]"  # mesh['axis_0'=4,'axis_1'=2]
                          r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"  # its devices: an iota
                          r" \{([^}]*)\}")  # the axes each group spans


def replica_groups(attrs: str, n: int) -> list[list[int]]:
    """The device groups of a collective, in any of the three forms XLA prints."""
    if m := _MESH_GROUPS.search(attrs):
        names, dims = zip(*((a, int(s)) for a, s in re.findall(r"'(\w+)'=(\d+)", m[1])))
        chosen = re.findall(r"'([^']+)'", m[4])
        if any(":" in c for c in chosen):
            raise NotImplementedError(f"replica groups over part of an axis: {m[0]}")
        spanned = [names.index(c) for c in chosen]
        order = [i for i in range(len(names)) if i not in spanned] + spanned
        ids = iota(n, m[2], m[3]).reshape(dims).transpose(order)
        return ids.reshape(-1, math.prod(dims[i] for i in spanned)).tolist()
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs):
        return iota(n, m[3], m[4]).reshape(int(m[1]), int(m[2])).tolist()
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs):
        groups = [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m[1])]
        return groups or [list(range(n))]
    raise NotImplementedError(f"replica groups not understood: {attrs[:200]}")


class Hlo:
    """A compiled SPMD module's collectives, as bytes each rank sends by mesh axes."""

    def __init__(self, text: str, sizes: tuple[int, ...], parameter_axes: set[str]):
        self.sizes, self.n, self.parameter_axes = sizes, math.prod(sizes), parameter_axes
        self.computations: dict[str, dict[str, Instruction]] = {}
        for header, body in re.findall(r"^(?:ENTRY )?%(\S+) .*?\{\n(.*?)\n\}", text, re.S | re.M):
            self.computations[header] = {i.name: i for i in map(parse_instruction, body.splitlines())}
        self.uses: dict[str, dict[str, list[tuple[Instruction, int]]]] = {}
        for comp, instructions in self.computations.items():
            uses = self.uses[comp] = {}
            for ins in instructions.values():
                for k, operand in enumerate(ins.operands):
                    uses.setdefault(operand, []).append((ins, k))

    def axes_of(self, groups) -> tuple[str, ...]:
        """The mesh axes along which the devices of some group differ, in mesh order."""
        varying = set()
        for group in groups:
            coords = np.unravel_index(list(group), self.sizes)
            varying.update(a for a, row in zip(AXES, coords) if len(set(row.tolist())) > 1)
        return tuple(a for a in AXES if a in varying)

    def bytes_by_axes(self) -> dict[tuple[str, ...], dict[str, float]]:
        out: dict[tuple[str, ...], dict[str, float]] = {}

        def add(axes, kind, nbytes):
            kinds = out.setdefault(axes, {})
            kinds[kind] = kinds.get(kind, 0.0) + nbytes

        for comp, instructions in self.computations.items():
            for ins in instructions.values():
                if ins.op.endswith(("-start", "-done")) and ins.op.rsplit("-", 1)[0] in _KINDS:
                    raise NotImplementedError(f"asynchronous collective {ins.op}: count its start only")
                if ins.op not in _KINDS:
                    continue
                if ins.op == "collective-permute":
                    pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", ins.attrs)]
                    senders = sum(s != t for s, t in pairs)
                    axes = self.axes_of(pairs)
                    add(axes, "ppermute", sum(array_bytes(ins.shape)) * senders / self.n)
                    continue
                groups = replica_groups(ins.attrs, self.n)
                axes, n = self.axes_of(groups), len(groups[0])
                result = array_bytes(ins.shape)
                if ins.op == "all-gather":
                    add(axes, "all_gather", (n - 1) / n * sum(result))
                elif ins.op == "reduce-scatter":
                    add(axes, "reduce_scatter", (n - 1) * sum(result))
                elif ins.op == "all-to-all":
                    add(axes, "all_to_all", (n - 1) / n * sum(result))
                else:
                    for element, nbytes in zip(self.elements(comp, ins), result):
                        self.price_all_reduce(add, axes, n, nbytes, self.kept(comp, element))
        return out

    def elements(self, comp: str, ins: Instruction) -> list[str | None]:
        """The value of each element of an all-reduce's result: itself, or its get-tuple-elements."""
        if not ins.shape.startswith("("):
            return [ins.name]
        by_index = {}
        for user, _ in self.uses[comp].get(ins.name, []):
            if user.op == "get-tuple-element":
                by_index[int(re.search(r"index=(\d+)", user.attrs)[1])] = user.name
        return [by_index.get(i) for i in range(len(array_bytes(ins.shape)))]

    def kept(self, comp: str, name: str | None, outer=lambda k: False) -> int:
        """k where every use of `name` keeps a 1/k slice of it at a rank's offset; 1 where one reads
        it whole. `outer(k)`: whether the caller's k-th operand depends on the partition id."""
        uses = self.uses[comp].get(name, []) if name else []
        if not uses:
            return 1
        size = sum(array_bytes(self.computations[comp][name].shape))
        ks = []
        for user, k in uses:
            if user.op == "dynamic-slice" and k == 0 and any(
                    self.rank_dependent(comp, o, outer) for o in user.operands[1:]):
                ks.append(size // sum(array_bytes(user.shape)))
            elif user.op in _VIEWS:
                ks.append(self.kept(comp, user.name, outer))
            elif user.op in ("fusion", "call") and (callee := re.search(r"(?:calls|to_apply)=%([\w.\-]+)", user.attrs)):
                body = self.computations[callee[1]]
                param = next(i.name for i in body.values() if i.op == "parameter" and int(i.inside) == k)
                bound = lambda j, u=user: self.rank_dependent(comp, u.operands[j], outer)  # noqa: E731
                ks.append(self.kept(callee[1], param, bound))
            else:
                return 1
        return min(ks)

    def rank_dependent(self, comp: str, name: str, outer) -> bool:
        """Whether the value `name` is computed from the partition (or replica) id."""
        stack, seen = [name], {name}
        while stack:  # a walk, not a recursion: a value may hang from thousands of instructions
            ins = self.computations[comp][stack.pop()]
            if ins.op in ("partition-id", "replica-id") or (ins.op == "parameter" and outer(int(ins.inside))):
                return True
            fresh = [o for o in ins.operands if o not in seen]
            seen.update(fresh)
            stack.extend(fresh)
        return False

    def price_all_reduce(self, add, axes: tuple[str, ...], n: int, nbytes: int, k: int) -> None:
        """An all-reduce of `nbytes` over `n` ranks whose uses keep 1/k of it."""
        k = min(k, n)
        if k == 1 or n % k:
            add(axes, "all_reduce", 2 * (n - 1) / n * nbytes)
            return
        sizes = dict(zip(AXES, self.sizes))
        split = [s for r in range(1, len(axes) + 1) for s in itertools.combinations(axes, r)
                 if math.prod(sizes[a] for a in s) == k]
        split.sort(key=lambda s: (not set(s) <= self.parameter_axes, [-AXES.index(a) for a in s]))
        scattered = split[0] if split else axes
        add(scattered, "reduce_scatter", (k - 1) / k * nbytes)
        if rest := tuple(a for a in axes if a not in scattered):
            m = n // k
            add(rest, "all_reduce", 2 * (m - 1) / m * nbytes / k)


# --- the table ---------------------------------------------------------------------------------------

def make_batch(cfg: llama.LlamaConfig, size: int, seq_len: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, cfg.vocab_size, (size, seq_len), generator=g),
            "targets": torch.randint(0, cfg.vocab_size, (size, seq_len), generator=g),
            "positions": torch.arange(seq_len).expand(size, seq_len).contiguous()}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else ("-" if not a else "inf")


def print_row(name: str, config: nf.ParallelConfig, ours: Side, xla: Side) -> None:
    axes = sorted(set(ours.by_axes) | set(xla.by_axes), key=lambda a: [AXES.index(x) for x in a])
    sizes = ",".join(map(str, config.sizes.values()))
    for i, a in enumerate(axes):
        mine, theirs = sum(ours.by_axes.get(a, {}).values()), sum(xla.by_axes.get(a, {}).values())
        print(f"{name if i == 0 else '':<9} {sizes if i == 0 else '':<8} {'+'.join(a):<22} "
              f"{mine:>14,.0f} {theirs:>14,.0f} {ratio(mine, theirs):>7}")
    print(f"{'':<18} {'total':<22} {ours.total:>14,.0f} {xla.total:>14,.0f} {ratio(ours.total, xla.total):>7}")
    print(f"{'':<18} {'flops per rank':<22} {ours.flops:>14,.0f} {xla.flops:>14,.0f} {ratio(ours.flops, xla.flops):>7}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--unflattened-loss", action="store_true",
                        help="JAX's cross-entropy over the logits (B, L, V) as they are, not flattened to (B*L, V) "
                             "as llama.loss hands them to F.cross_entropy")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    cfg = llama.LlamaConfig.tiny()
    params = llama.init(cfg, nf.random.key(0))
    jax_params = jax_init(cfg, 0)
    same = optree.tree_map(lambda t, j: bool(np.array_equal(t.numpy(), np.asarray(j))), params, jax_params)
    if not all(optree.tree_leaves(same)):
        raise SystemExit("nf.random and jax.random gave different parameters from one key: not one model")
    print(f"init: nf.random and jax.random bit-exact on all {len(optree.tree_leaves(same))} parameters; "
          f"llama {cfg.num_params() / 1e6:.2f}M, sequences of {args.seq_len}\n")
    print(f"{'strategy':<9} {'sizes':<8} {'mesh axes':<22} {'ndfunc B/rank':>14} {'XLA B/rank':>14} {'ratio':>7}")
    results, losses = {}, []
    for name in args.rows:
        sizes, per_rank = ROWS[name]
        config = nf.ParallelConfig(*sizes)
        batch = make_batch(cfg, per_rank * config.dp_world_size, args.seq_len)
        ours = ndfunc_side(cfg, config, params, batch)
        xla = xla_side(cfg, config, jax_params, {k: jnp.asarray(v.numpy()) for k, v in batch.items()},
                       flatten=not args.unflattened_loss)
        print_row(name, config, ours, xla)
        losses.append((name, ours.losses, xla.losses))
        results[name] = {"sizes": sizes, "sequences_per_dp_rank": per_rank,
                         **{side: {"by_axes": {"+".join(a): k for a, k in s.by_axes.items()}, "total": s.total,
                                   "losses": s.losses} for side, s in (("ndfunc", ours), ("xla", xla))}}
    print(f"\n{'strategy':<9} {'ndfunc loss':>12} {'JAX loss':>12} {'ulps':>5}   "
          f"{'after a step':>12} {'JAX':>12} {'ulps':>5}")
    worst = 0.0
    for name, ours, theirs in losses:
        ulps = [abs(a - b) / np.spacing(np.float32(b)) for a, b in zip(ours, theirs)]
        worst = max(worst, *ulps)
        print(f"{name:<9} {ours[0]:>12.7f} {theirs[0]:>12.7f} {ulps[0]:>5.0f}   "
              f"{ours[1]:>12.7f} {theirs[1]:>12.7f} {ulps[1]:>5.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if worst > LOSS_ULPS:
        raise SystemExit(f"the losses differ by {worst:.0f} ulps, more than {LOSS_ULPS}: the two programs are not "
                         f"one model")


if __name__ == "__main__":
    main()
