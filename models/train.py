"""Train the reference Llama on the standard library's source bytes, on any ND-parallel layout.

    python -m models.train                                         # 4D: dp_shard 2 x cp 2 x tp 2, 8 simulated ranks
    python -m models.train --dp-shard 1 --cp 1 --tp 1               # one device
    python -m models.train --dp-replicate 2 --dp-shard 2 --simulate 4 --grad-accum 2
    torchrun --nproc-per-node 4 -m models.train --dp-shard 2 --tp 2   # real processes (gloo on CPU)
    python -m models.train --processes 8                            # real processes driven from this one
    python -m models.train --hf-checkpoint DIR                      # start from a Hugging Face Llama
    python -m models.train --hf-model DIR                           # train a transformers causal LM as it is
    python -m models.train --data DOCS --tokenizer DIR              # your documents, packed (docs/data.md)
    python -m models.train --hf-model DIR --data chats.jsonl --chat   # fine-tune on the assistant's replies
    python -m models.train --checkpoint-dir DIR --save-every 20     # saved as it trains; again with --resume

The flags mirror `nf.ParallelConfig`. Parameters are laid out by the config's logical rules (FSDP
over `('dp_shard', 'cp')`, TP over `tp`), the batch over the data-parallel axes and the sequence
over `cp`; one `nf.jit` step (loss, gradients, AdamW update) runs on every rank. Not under torchrun,
the ranks are simulated in this process (`--simulate N`, default: as many as the layout needs), or
are real worker processes this one drives (`--processes N`, `nf.processes`: needs ndfunc[notebook]).

Effective batch = micro batch x grad accumulation x dp_replicate x dp_shard; `--lr-scaling` adapts
the learning rate from `--base-batch` to it (linear or sqrt).

`--checkpoint-dir DIR` saves the run (`nf.checkpoint`: parameters, optimizer state, step, the data
stream's position, the key) every `--save-every` steps, written while training goes on, and at the
end; `--resume` continues from the latest complete one, on this run's layout whatever the saved
one was (the data position is the step, so it carries over).

`--hf-model DIR` trains a Hugging Face causal LM (Llama, GPT-2, Qwen2, Mistral, ...: whatever
`transformers.AutoModelForCausalLM` loads, with sdpa attention) instead, the model's own modules
called through `nf.nn.functional`, its parameters laid out by its own TP plan over `tp` and FSDP
over `('dp_shard', 'cp')` as the llama's (`nf.nn.partition_specs`), and the hidden states between its
layers laid out by the same rules as the llama's residual stream. It needs `transformers` installed. `--save-hf DIR`
then writes the trained model as its class's `from_pretrained` loads it (`hf.save_model`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import resource
import sys
import time

import optree
import torch
import torch.nn.functional as F

import ndfunc as nf
from models import data, hf, llama, tokens
from ndfunc import random
from ndfunc.sharding import NamedSharding, P


def make_step(cfg: llama.LlamaConfig, opt: nf.optim.GradientTransformation, rules=None):
    """One AdamW step of llama; `rules` (a ParallelConfig's `.rules`) lay out its activations."""
    return make_loss_step(lambda params, batch: llama.loss(params, batch, cfg), opt, rules)


def abstract_batch(config: nf.ParallelConfig, mesh, batch_size: int, seq_len: int) -> dict:
    """A batch of `batch_size` sequences of `seq_len` tokens as `nf.ShapeDtypeStruct` stand-ins,
    laid out as the job lays its batches out (over the data-parallel axes, the sequence over `cp`)."""
    sharding = NamedSharding(mesh, config.batch_spec)
    return {k: nf.ShapeDtypeStruct((batch_size, seq_len), torch.long, sharding=sharding)
            for k in ("tokens", "targets", "positions")}


def lower_abstract(cfg: llama.LlamaConfig, config: nf.ParallelConfig, seq_len: int, transforms=(),
                   batch_per_rank: int = 1, opt: nf.optim.GradientTransformation | None = None,
                   positions: bool = True):
    """The job's step (`make_step`, AdamW unless `opt`) lowered over stand-ins on `config`'s
    abstract mesh: parameters, optimizer state and a batch of `batch_per_rank` sequences of `seq_len`
    tokens per data-parallel rank, laid out as the job lays them out (the updated parameters and
    state leave as they came, ready for the next step), nothing of their size allocated. Its
    `memory_analysis()` and `cost_analysis()` are a rank's on that cluster. Without `positions` the
    batch has none: attention is told `is_causal` (a kernel skips the masked blocks), where the job
    passes positions so that the causal mask follows them (an explicit mask, every block computed)."""
    mesh = config.build_abstract_mesh()
    specs = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    params = llama.abstract_params(cfg, optree.tree_map(lambda s: NamedSharding(mesh, s), specs))
    opt = opt if opt is not None else nf.optim.adamw(3e-4)
    state = opt.init(params)  # stand-ins in, stand-ins out, laid out like the parameters
    batch = abstract_batch(config, mesh, batch_per_rank * config.dp_world_size, seq_len)
    if not positions:
        del batch["positions"]
    laid_out = optree.tree_map(nf.sharding_of, (params, state))  # results leave as they came
    step = nf.jit(make_step(cfg, opt, config.rules), mesh=mesh, transforms=list(transforms),
                  out_shardings=(*laid_out, P()))
    return step.lower(params, state, batch)


def make_loss_step(loss, opt: nf.optim.GradientTransformation, rules=None):
    """One optimizer step of `loss(params, batch)`; `rules` lay out the activations it names."""
    @nf.sharding.axis_rules(rules)
    def step(params, opt_state, batch):
        value, grads = nf.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return nf.optim.apply_updates(params, updates), opt_state, value

    return step


def hf_implementations(config) -> dict:
    """How the job has transformers build a causal LM of `config`: SDPA attention where the model
    has it (the kernel `nf.ring_attention` runs as a ring), else its own (eager: Gemma 2's). A
    mixture of experts' experts as transformers picks them (grouped matmuls): any implementation is
    one `ndfunc::experts` per call, split by the tokens (`ndfunc._src.experts`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None:  # not a causal LM transformers knows: its own error says so
        return {"attn_implementation": "sdpa"}
    return {"attn_implementation": "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"}


def load_hf_model(path: str) -> torch.nn.Module:
    """The transformers causal LM at `path`, built as `hf_implementations` says (loaded outside any
    simulation: its buffers are constants of the step, the same on every rank), out of training
    mode as `from_pretrained` leaves it: no dropout."""
    try:
        import transformers
    except ImportError:
        raise SystemExit("--hf-model needs Hugging Face transformers: pip install transformers") from None
    config = transformers.AutoConfig.from_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, **hf_implementations(config))


def remat_hf_layers(model: torch.nn.Module, policy: str) -> int:
    """Each decoder layer of a transformers model (the modules its `_no_split_modules` names, the
    units FSDP's auto-wrap takes) recomputed in backward (`nf.remat(layer.forward, policy)`); how many."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise SystemExit(f"--remat: {type(model).__name__} names no decoder layer (_no_split_modules) to recompute.")
    for layer in layers:
        layer.forward = nf.remat(layer.forward, policy)
    return len(layers)


def hf_model(model: torch.nn.Module, mesh):
    """(description, parameters, their specs, loss(params, batch), token_losses(params, batch),
    parameter count) of a transformers causal LM: the mean loss over the batch's trained targets,
    and each token's loss (B, L), 0 where its target is -100."""
    params, buffers, apply = nf.nn.functional(model)
    specs = nf.nn.partition_specs(model, mesh, tp="tp", fsdp=("dp_shard", "cp"))  # as the rules lay out the llama's

    additive = model.config._attn_implementation == "eager"  # (eager attention adds its mask to the scores)

    def logits(params, batch):
        masked = {}
        if "documents" in batch:
            mask = llama.attention_mask(batch["positions"], batch["documents"])[:, None]
            masked["attention_mask"] = torch.where(mask, 0.0, torch.finfo(torch.float32).min) if additive else mask
        return apply(params, buffers, batch["tokens"], position_ids=batch["positions"], **masked).logits

    def cross_entropy(params, batch, reduction: str):
        return F.cross_entropy(logits(params, batch).flatten(0, 1).float(), batch["targets"].flatten(),
                               ignore_index=data.IGNORE_INDEX, reduction=reduction)

    def loss(params, batch):
        return cross_entropy(params, batch, "mean")

    def token_losses(params, batch):
        return cross_entropy(params, batch, "none").view(batch["targets"].shape)

    return type(model).__name__, params, specs, loss, token_losses, sum(p.numel() for p in params.values())


def abstract_hf_model(hf_config, mesh, remat: str = "none") -> tuple[dict, object]:
    """(parameters, loss(params, batch)) of transformers' causal LM for `hf_config` (a transformers
    config, e.g. `AutoConfig.from_pretrained(path)`), as `hf_model` gives them, its parameters as
    `nf.ShapeDtypeStruct` stand-ins laid out on `mesh` (an `AbstractMesh` will do) by the model's
    TP plan and FSDP over ('dp_shard', 'cp'): made on the meta device, nothing of its size allocated (its
    buffers, rotary tables, made empty: no value changes the program). Built as `load_hf_model`
    builds the job's (`hf_implementations`, out of training mode), so the program planned is the one
    trained, each decoder layer recomputed in backward under `remat` ('full' or 'save_dots', as
    `--remat` does: `remat_hf_layers`). To plan a Hugging Face model on a cluster you do not have
    (`nf.plan.plan_step`)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, **hf_implementations(hf_config)).eval()
    for name, buffer in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, torch.empty(buffer.shape, dtype=buffer.dtype))
    if remat != "none":
        remat_hf_layers(model, remat)
    _, params, specs, loss, _, _ = hf_model(model, mesh)
    stand_ins = {k: nf.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=NamedSharding(mesh, specs[k]))
                 for k, v in params.items()}
    return stand_ins, loss


def lower_abstract_hf(hf_config, config: nf.ParallelConfig, seq_len: int, transforms=(), batch_per_rank: int = 1,
                      remat: str = "none", opt: nf.optim.GradientTransformation | None = None, ruled: bool = True):
    """`lower_abstract` for transformers' causal LM of `hf_config` (`abstract_hf_model`, each
    decoder layer recomputed under `remat`): the job's `--hf-model` step (AdamW unless `opt`) over
    stand-ins on `config`'s abstract mesh, nothing of its size allocated. The step runs under
    `config.rules`, as the job's (not `ruled`: its activations left to the partitioner)."""
    mesh = config.build_abstract_mesh()
    params, loss = abstract_hf_model(hf_config, mesh, remat)
    opt = opt if opt is not None else nf.optim.adamw(3e-4)
    state = opt.init(params)
    laid_out = optree.tree_map(nf.sharding_of, (params, state))  # results leave as they came
    step = nf.jit(make_loss_step(loss, opt, config.rules if ruled else None), mesh=mesh,
                  transforms=list(transforms), out_shardings=(*laid_out, P()))
    return step.lower(params, state, abstract_batch(config, mesh, batch_per_rank * config.dp_world_size, seq_len))


def trained_count(batch: dict) -> torch.Tensor:
    """How many of the batch's targets are trained (not -100), as a float."""
    return (batch["targets"] != data.IGNORE_INDEX).sum().float()


def token_mean(token_losses):
    """loss(params, batch): the mean of `token_losses` over the batch's trained targets, 0 (and no
    gradient) for a batch with none (chat data whose batch holds no reply), where a plain mean is
    0 / 0."""
    return lambda params, batch: token_losses(params, batch).sum() / trained_count(batch).clamp(min=1)


def make_update(opt: nf.optim.GradientTransformation):
    """The optimizer step alone, for gradients accumulated by `nf.accumulate`."""
    def update(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return nf.optim.apply_updates(params, updates), opt_state

    return update


def _flag(convert, ok, expected: str, must: str):
    """A flag's argparse type: `convert(text)`, refused unless `ok` (argparse prints the message
    and exits, no traceback)."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text}")
        return value
    return parse


def _at_least(low: int):
    return _flag(int, lambda v: v >= low, "a whole number", f"at least {low}")


_positive_float = _flag(float, lambda v: 0 < v < float("inf"), "a number", "a positive finite number")
_non_negative_float = _flag(float, lambda v: 0 <= v < float("inf"), "a number", "a finite number of at least 0")
_shard_size = _flag(int, lambda v: v == -1 or v >= 1, "a whole number",
                    "at least 1, or -1 for what the other axes leave")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layout = parser.add_argument_group("layout (nf.ParallelConfig)")
    layout.add_argument("--dp-replicate", type=_at_least(1), default=1, help="replicas (DDP / across nodes in HSDP)")
    layout.add_argument("--dp-shard", type=_shard_size, default=2, help="FSDP shards; -1 takes what the others leave")
    layout.add_argument("--cp", type=_at_least(1), default=2, help="context-parallel ranks (the sequence split)")
    layout.add_argument("--tp", type=_at_least(1), default=2, help="tensor-parallel ranks")
    layout.add_argument("--sequence-parallel", action="store_true",
                        help="the residual stream's sequence split over tp too (Megatron's sequence parallelism: "
                             "1/tp of the saved activations)")
    layout.add_argument("--simulate", type=_at_least(1), default=None,
                        help="ranks to simulate in this process when not under torchrun (default: the layout's)")
    layout.add_argument("--processes", type=_at_least(1), default=None,
                        help="run on this many real worker processes driven from this one (nf.processes), not "
                             "simulated ranks")
    parser.add_argument("--config", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--hf-checkpoint", help="a Hugging Face Llama directory to start from")
    parser.add_argument("--hf-model", help="a Hugging Face causal LM directory to train as it is (needs transformers)")
    parser.add_argument("--data", metavar="PATH", help="train on this text, .jsonl or .parquet file, dataset saved "
                        "with datasets.save_to_disk, or directory of them (default: the standard library's bytes)")
    parser.add_argument("--tokenizer", metavar="DIR", help="the tokenizer for --data (default: --hf-model's own)")
    parser.add_argument("--text-field", default=None,
                        help="the field of a .jsonl record, or the column, holding the text (default: text; with "
                             "--chat, messages)")
    parser.add_argument("--chat", action="store_true",
                        help="--data holds conversations (a list of role/content messages a record), rendered by "
                             "the tokenizer's chat template; the loss is taken on the assistant's turns only")
    parser.add_argument("--eval-data", metavar="PATH", help="evaluate on this data (as --data reads it; default: "
                        "the last hundredth of --data, or held-out standard library bytes)")
    parser.add_argument("--eval-steps", type=_at_least(0), default=0,
                        help="batches per evaluation (0: every whole batch of the evaluation data)")
    parser.add_argument("--data-cache", metavar="DIR", default=str(pathlib.Path.home() / ".cache" / "ndfunc" / "tokens"),
                        help="where tokenized data is kept (by content: a later run reads it back)")
    parser.add_argument("--steps", type=_at_least(1), default=60)
    parser.add_argument("--epochs", type=_at_least(1), default=None,
                        help="train this many passes over the data instead of --steps (whole batches only)")
    parser.add_argument("--micro-batch", "--batch-size", dest="micro_batch", type=_at_least(1), default=8,
                        help="sequences per data-parallel rank per micro-batch")
    parser.add_argument("--grad-accum", type=_at_least(1), default=1, help="micro-batches per optimizer step")
    parser.add_argument("--reduce-grads", choices=["each", "end"], default="each",
                        help="with --grad-accum: reduce gradients each micro-batch, or once at the end (more memory)")
    parser.add_argument("--seq-len", type=_at_least(2), default=128)
    parser.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate at --base-batch")
    parser.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="none",
                        help="scale --lr from --base-batch to the effective batch")
    parser.add_argument("--base-batch", type=_at_least(1), default=None, help="the batch --lr was tuned at (default: effective)")
    parser.add_argument("--warmup", type=_at_least(0), default=10)
    parser.add_argument("--weight-decay", type=_non_negative_float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--remat", choices=["none", "full", "save_dots"], default="none",
                        help="recompute each decoder layer in backward (nf.remat)")
    parser.add_argument("--mixed-precision", choices=["none", "bf16"], default="none",
                        help="bf16 compute, fp32 parameters, state and gradient sums (nf.mixed_precision)")
    parser.add_argument("--ring-attention", action="store_true",
                        help="attention over the cp-split sequence as a ring (nf.ring_attention), not gathered")
    parser.add_argument("--fsdp-schedule", action="store_true",
                        help="FSDP2's gather schedule (nf.fsdp): gather again for backward, prefetch, buckets")
    parser.add_argument("--compile", action="store_true",
                        help="each rank's step through torch.compile (nf.jit(compile=True)): on GPUs, fused kernels; "
                             "simulated ranks run op by op")
    parser.add_argument("--log-every", type=_at_least(1), default=10)
    parser.add_argument("--metrics", metavar="FILE", help="append a JSON line per step: loss, step time, tokens/s "
                        "after compilation, measured and estimated peak memory, flops, MFU, eval loss")
    parser.add_argument("--eval-every", type=_at_least(0), default=0,
                        help="steps between evaluations (0: none) on --eval-data, the last hundredth of --data, or "
                             "held-out standard library bytes")
    ckpt = parser.add_argument_group("checkpoints (nf.checkpoint)")
    ckpt.add_argument("--checkpoint-dir", help="save the run here: parameters, optimizer state, step, data position, key")
    ckpt.add_argument("--save-every", type=_at_least(0), default=0, help="steps between checkpoints (0: at the end only)")
    ckpt.add_argument("--keep", type=_at_least(1), default=3, help="checkpoints kept (the latest)")
    ckpt.add_argument("--save-hf", metavar="DIR", help="at the end, write the model as a Hugging Face checkpoint "
                      "(safetensors + config.json) that transformers loads")
    ckpt.add_argument("--resume", action="store_true",
                      help="continue from the latest complete checkpoint in --checkpoint-dir (any layout)")
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir (where the run was saved)")
    if args.processes and args.simulate:
        parser.error("--processes N runs real ranks and --simulate N simulated ones: give one of them")
    if args.data and not (args.tokenizer or args.hf_model):
        parser.error("--data needs a tokenizer: --tokenizer DIR, or --hf-model DIR to use the model's own")
    if args.tokenizer and not args.data:
        parser.error("--tokenizer tokenizes --data; give the data too")
    if (args.chat or args.eval_data) and not args.data:
        parser.error(f"{'--chat' if args.chat else '--eval-data'} is about --data; give the data too")
    if args.eval_data and not args.eval_every:
        parser.error("--eval-data is evaluated every --eval-every steps; give --eval-every N too")
    if args.text_field is None:
        args.text_field = "messages" if args.chat else "text"
    return args


def main(argv: list[str] | None = None) -> list[float]:
    args = parse(argv)
    config = nf.ParallelConfig(args.dp_replicate, args.dp_shard, args.cp, args.tp, args.sequence_parallel)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        nf.init()
        ranks = contextlib.nullcontext()
        config = config.resolve(nf.world_size())
    else:
        n = args.processes or args.simulate or (config.total_size if config.is_resolved else 1)
        config = config.resolve(n)
        if args.processes and nf.world_size() == n and not torch.distributed.is_initialized():
            ranks = contextlib.nullcontext()  # inside an open nf.processes(n) block (a notebook's): its workers
        elif args.processes:
            ranks = nf.processes(n)
        else:
            ranks = nf.simulate(n) if n > 1 else _world_of_this_process()
    model = load_hf_model(args.hf_model) if args.hf_model else None
    # the data is host state every rank makes alike: made before the simulated world it is one
    # plain tensor, where inside it each would be a value per simulated rank that every read of a
    # batch runs over, rank by rank
    if args.data:
        sequences, held = _tokenized(args)
    else:
        sequences = data.Sequences(data.stdlib_corpus(), args.seq_len, seed=args.seed)
        held = data.Sequences(data.held_out(), args.seq_len, seed=args.seed) if args.eval_every else None
    if model is not None and model.config.vocab_size < sequences.vocab_size:
        what = f"the tokenizer's {sequences.vocab_size} tokens" if args.data else f"{data.VOCAB_SIZE} bytes"
        raise SystemExit(f"the data needs a vocabulary of at least {what}; {args.hf_model} has "
                         f"{model.config.vocab_size}.")
    with ranks:
        return train(args, config, sequences, held, model)


def _tokenized(args: argparse.Namespace) -> tuple[data.Sequences, data.Sequences | None]:
    """`--data` as sequences (`tokens.store`: tokenized once, memory-mapped), and the evaluation's:
    `--eval-data`'s, or with --eval-every alone the last hundredth of `--data` (at least a sequence)."""
    store = lambda path: tokens.store(path, args.tokenizer or args.hf_model, args.data_cache,  # noqa: E731
                                      args.text_field, args.chat)
    corpus = store(args.data)
    if args.eval_data:
        return _sequences(corpus, args), _sequences(store(args.eval_data), args)
    if not args.eval_every:
        return _sequences(corpus, args), None
    cut = corpus.tokens.numel() - max(corpus.tokens.numel() // 100, args.seq_len + 1)
    return _sequences(corpus, args, stop=cut), _sequences(corpus, args, start=cut)


def _sequences(corpus: tokens.Corpus, args: argparse.Namespace, start: int = 0, stop: int | None = None):
    """The store's tokens `start:stop` as packed sequences, with their documents (one cut at `start`
    counted from there) and trained flags: views of the memory-mapped store, nothing read whole."""
    stop = corpus.tokens.numel() if stop is None else stop
    first, last = (int(torch.searchsorted(corpus.starts, torch.tensor(at), right=True)) for at in (start, stop - 1))
    if start == 0:
        starts = corpus.starts[:last]
    else:  # (a held-out tail: its documents' starts are copied, shifted)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), corpus.starts[first:last] - start])
    trained = None if corpus.trained is None else corpus.trained[start:stop]
    return data.Sequences(corpus.tokens[start:stop], args.seq_len, seed=args.seed, vocab_size=corpus.vocab_size,
                          starts=starts, trained=trained)


def train(args: argparse.Namespace, config: nf.ParallelConfig, sequences: data.Sequences,
          held: data.Sequences | None = None, model: torch.nn.Module | None = None) -> list[float]:
    """The run `args` describe on `config`'s layout, over the ranks there are; batches from
    `sequences`, evaluations on `held`. The losses, one per step."""
    if args.hf_checkpoint:
        cfg, params = hf.load_llama(args.hf_checkpoint)
    else:
        cfg = getattr(llama.LlamaConfig, args.config)()
        params = None
    cfg = dataclasses.replace(cfg, remat=None if args.remat == "none" else args.remat)
    if params is None and sequences.vocab_size > cfg.vocab_size:  # the reference Llama, sized to the tokenizer
        cfg = dataclasses.replace(cfg, vocab_size=-(-sequences.vocab_size // 64) * 64)
    if cfg.vocab_size < sequences.vocab_size and model is None:
        raise SystemExit(f"the data needs a vocabulary of at least {sequences.vocab_size}; this model has "
                         f"{cfg.vocab_size}.")
    effective = config.effective_batch_size(args.micro_batch, args.grad_accum)
    if args.epochs:  # the steps of whole batches in that many passes: counted in sequences, whatever cp splits
        per_epoch = sequences.num_sequences // effective
        if per_epoch < 1:
            raise SystemExit(f"an epoch of {sequences.num_sequences} sequences holds no whole batch of {effective}; "
                             f"use a smaller batch, shorter sequences or more data.")
        args = argparse.Namespace(**{**vars(args), "steps": args.epochs * per_epoch})
    lr = args.lr if args.lr_scaling == "none" else nf.ParallelConfig.scale_lr(
        args.lr, args.base_batch or effective, effective, args.lr_scaling)
    schedule = nf.optim.warmup_cosine_decay_schedule(0.0, lr, args.warmup, max(args.steps, args.warmup + 1), lr / 10)
    opt = nf.optim.chain(nf.optim.clip_by_global_norm(1.0), nf.optim.adamw(schedule, weight_decay=args.weight_decay))

    mesh = config.build_mesh()
    put = lambda tree, specs: nf.device_put(tree, optree.tree_map(  # noqa: E731
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)))
    if model is not None:
        if args.remat != "none":
            remat_hf_layers(model, args.remat)
        name, params, pspec, loss_of, token_losses, n_params = hf_model(model, mesh)
        params = put(params, pspec)
    else:
        name, n_params = str(cfg), cfg.num_params()
        loss_of, token_losses = (lambda p, b: llama.loss(p, b, cfg)), (lambda p, b: llama.token_losses(p, b, cfg))
        pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
        if params is None:  # each rank makes only its own blocks
            params = nf.jit(lambda key: llama.init(cfg, key), mesh=mesh, out_shardings=pspec)(random.key(args.seed))
        else:
            params = put(params, pspec)
    if sequences.trained is not None:  # chat data: a batch may hold no reply
        loss_of = token_mean(token_losses)
    opt_state = opt.init(params)  # moments laid out as their parameters, on each rank's blocks
    sspec = nf.optim.state_shardings(opt_state, pspec)

    batch_size = args.micro_batch * args.grad_accum * config.dp_world_size  # one optimizer step's sequences
    bsharding = NamedSharding(mesh, config.batch_spec)
    # explicit positions: the causal mask then follows them, so attention can split the sequence (cp);
    # packed documents bring their own (each document's from 0) and their ids
    positions = None if "positions" in sequences.fields else nf.device_put(
        torch.arange(args.seq_len).expand(batch_size, args.seq_len).contiguous(), bsharding)
    bspec = {field: config.batch_spec for field in (*sequences.fields, "positions")}
    with_positions = lambda batch: batch if positions is None else dict(batch, positions=positions)  # noqa: E731
    transforms = []
    if args.mixed_precision == "bf16":
        transforms.append(nf.mixed_precision(torch.bfloat16, torch.float32))
    if args.ring_attention:
        transforms.append(nf.ring_attention("cp", load_balance=None))  # batches in plain order
    if args.fsdp_schedule:
        transforms.append(nf.fsdp(("dp_shard", "cp")))
    kw = dict(mesh=mesh, donate_argnums=(0, 1), transforms=transforms, compile=args.compile)
    ruled = nf.sharding.axis_rules(config.rules)
    if args.grad_accum == 1:
        step = nf.jit(make_loss_step(loss_of, opt, config.rules), in_shardings=(pspec, sspec, bspec),
                      out_shardings=(pspec, sspec, P()), **kw)
    else:  # one program per micro-batch, run grad_accum times; then the update
        # each micro-batch's loss sum over the whole batch's count: the sums are the mean over every
        # trained token of the batch, however the micro-batches share them. Only packed or chat data
        # has untrained targets; else the count is the batch's tokens, with no program to run a step
        if sequences.starts is None and sequences.trained is None:
            every = nf.device_put(torch.tensor(float(batch_size * args.seq_len)), NamedSharding(mesh, P()))
            count = lambda batch: every  # noqa: E731
        else:
            count = nf.jit(lambda batch: trained_count(batch).clamp(min=1), mesh=mesh, in_shardings=(bspec,),
                           out_shardings=P())
        per_token = ruled(lambda params, batch, n: token_losses(params, batch).sum() / n)
        grads_fn = nf.accumulate(nf.value_and_grad(per_token), args.grad_accum, reduce=args.reduce_grads,
                                 transforms=transforms, compile=args.compile, mean=False)
        no_ring = [t for t in transforms if not isinstance(t, nf.ring_attention)]  # (the update has no attention)
        update = nf.jit(make_update(opt), in_shardings=(pspec, sspec, pspec), out_shardings=(pspec, sspec),
                        **{**kw, "transforms": no_ring})

    say = print if nf.rank() == 0 else (lambda *a, **k: None)
    say(f"{name}\n{n_params / 1e6:.2f}M parameters; layout {config.sizes} on {config.total_size} "
        f"{'simulated ' if nf.is_simulated() else ''}rank(s); effective batch {effective} = micro "
        f"{args.micro_batch} x accumulation {args.grad_accum} x dp {config.dp_world_size}; lr {lr:.2e}")

    key = random.key(args.seed)
    manager = nf.checkpoint.Manager(args.checkpoint_dir, keep=args.keep) if args.checkpoint_dir else None
    first = 0
    if manager is not None:
        _same_data(pathlib.Path(args.checkpoint_dir), sequences, resuming=args.resume)
    if args.resume and manager.latest_step() is not None:
        # into this run's layout, whatever the saved one was; the data resumes where it stopped
        saved = manager.restore({"params": params, "opt": opt_state, "step": 0, "sequences": 0, "key": key})
        if saved["sequences"] % batch_size:
            raise SystemExit(f"the checkpoint stopped after {saved['sequences']} sequences, which is not a whole number "
                             f"of this run's batches of {batch_size}; resume with an effective batch that divides it.")
        params, opt_state, key, first = saved["params"], saved["opt"], saved["key"], saved["sequences"] // batch_size
        say(f"resumed from {manager.path(saved['step'])}: step {saved['step']}, {saved['sequences']} sequences seen")

    def checkpoint(steps: int, blocking: bool) -> None:
        manager.save(steps, {"params": params, "opt": opt_state, "step": steps, "sequences": steps * batch_size,
                             "key": key}, blocking=blocking)

    evaluate = None
    if args.eval_every:
        whole = held.num_sequences // batch_size
        if not whole:  # said now, not after --eval-every steps of training
            raise SystemExit(f"the evaluation data holds {held.num_sequences} sequences of {args.seq_len} tokens, "
                             f"fewer than a batch of {batch_size}; pass more with --eval-data, use a smaller batch "
                             f"or shorter sequences, or --eval-every 0 for no evaluation.")
        steps = min(args.eval_steps, whole) if args.eval_steps else None
        # the loss of a batch's tokens and how many there are (targets not -100), over the whole batch
        loss_sum = ruled(lambda params, batch: (token_losses(params, batch).sum(), trained_count(batch)))
        eval_sum = nf.jit(loss_sum, mesh=mesh, in_shardings=(pspec, bspec), out_shardings=(P(), P()),
                          transforms=[t for t in transforms if isinstance(t, nf.ring_attention)])

        def evaluate():
            """The mean loss over every trained token of the evaluation batches (read again each
            time, a batch at a time), or None where they hold none."""
            total, count = 0.0, 0.0
            for b in data.batches(held, batch_size, bsharding, steps=steps):
                s, n = map(nf.device_get, eval_sum(params, with_positions(b)))
                total, count = total + float(s), count + float(n)
            return total / count if count else None
    metrics = open(args.metrics, "a") if args.metrics and nf.rank() == 0 else None

    losses, costs, start = [], None, time.perf_counter()
    stream = data.batches(sequences, batch_size, bsharding, steps=args.steps, start=first)
    compiled_at = None  # when the first step (and its compilation) ended: rates count from there
    progress = _Progress(say, first, args.steps, quiet=nf.rank() != 0)
    peak_flops = _peak_flops()
    for i in range(first, args.steps):
        step_start = time.perf_counter()
        batch = with_positions(next(stream))
        if args.grad_accum == 1:
            if costs is None:
                costs = step.lower(params, opt_state, batch).cost_analysis()
            params, opt_state, loss = step(params, opt_state, batch)
        else:
            n = count(batch)
            if costs is None:
                costs = _add_costs(grads_fn.lower(params, batch, n).cost_analysis(), args.grad_accum,
                                   update.lower(params, opt_state, params).cost_analysis())
            loss, grads = grads_fn(params, batch, n)
            params, opt_state = update(params, opt_state, grads)
        losses.append(float(nf.device_get(loss)))
        now = time.perf_counter()
        step_time = now - step_start
        if compiled_at is None:
            compiled_at, rate = now, None
        else:
            rate = (i - first) * effective * args.seq_len / (now - compiled_at)
        mfu = None if peak_flops is None else costs["flops"] / step_time / peak_flops  # model flops utilization
        record = {"step": i + 1, "loss": losses[-1], "step_time_s": step_time, "tokens_per_s": rate,
                  "tokens_seen": (i + 1) * batch_size * args.seq_len, "batch_tokens": batch_size * args.seq_len,
                  "epoch": (i + 1) * batch_size / sequences.num_sequences,
                  **_memory(costs), "flops_per_rank": costs["flops"], "mfu": mfu}
        if evaluate is not None and ((i + 1) % args.eval_every == 0 or i + 1 == args.steps):
            record["eval_loss"] = evaluate()
        if metrics is not None:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        progress.update(i + 1, losses[-1], rate, costs["peak_memory_bytes"], now - start, record.get("eval_loss"),
                        final=(i + 1) % args.log_every == 0 or i + 1 == args.steps)
        if manager is not None and args.save_every and (i + 1) % args.save_every == 0 and i + 1 < args.steps:
            checkpoint(i + 1, blocking=False)  # written while the next steps run
    progress.close()
    if metrics is not None:
        metrics.close()
    if args.save_hf and model is not None:  # gathered a tensor at a time, written by rank 0
        hf.save_model(args.save_hf, model, params)
    elif args.save_hf:
        hf.save_llama(args.save_hf, cfg, params)
    if manager is not None:
        if manager.latest_step() != args.steps:
            checkpoint(args.steps, blocking=True)
        manager.close()
    if not losses:
        say(f"nothing to do: the checkpoint is at step {first} of {args.steps}")
        return losses
    tail = sum(losses[-10:]) / min(10, len(losses))
    say(f"loss {losses[0]:.3f} -> {tail:.3f} (mean of the last 10 steps); effective batch {effective} sequences "
        f"({effective * args.seq_len} tokens); per rank per step: {costs['comm_bytes']['total'] / 1e6:.2f} MB "
        f"sent in {sum(costs['collectives'].values())} collectives, peak memory {costs['peak_memory_bytes'] / 2**20:.1f} MiB "
        f"(program estimate)")
    return losses


def _same_data(directory: pathlib.Path, sequences: data.Sequences, resuming: bool) -> None:
    """The data a run in `directory` trains on, kept there (`data.json`); a run resumed on other data
    is refused: the position it resumes at is a count of sequences, which other data (another
    file, --seq-len, --seed, or evaluation split) would fill with other batches."""
    now = {"tokens": sequences.corpus.numel(), "sequences": sequences.num_sequences, "seq_len": sequences.seq_len,
           "seed": sequences.seed, "documents": None if sequences.starts is None else len(sequences.starts)}
    kept = directory / "data.json"
    if resuming and kept.is_file():
        then = json.loads(kept.read_text())
        if then != now:
            changed = ", ".join(f"{k} {then.get(k)} -> {now[k]}" for k in now if then.get(k) != now[k])
            raise SystemExit(f"--resume: the run in {directory} trained on other data than this run's ({changed}), so "
                             f"its position in the data would point at other batches. Resume with the run's --data, "
                             f"--seq-len, --seed and --eval-data/--eval-every, or give a new --checkpoint-dir.")
    text = json.dumps(now) + "\n"
    if nf.rank() == 0 and not (kept.is_file() and kept.read_text() == text):  # (written aside: others may read it)
        directory.mkdir(parents=True, exist_ok=True)
        aside = kept.with_suffix(".partial")
        aside.write_text(text)
        os.replace(aside, kept)


@contextlib.contextmanager
def _world_of_this_process():
    """A world of one process for the run, left as it was found."""
    started = not torch.distributed.is_initialized()
    nf.init()
    try:
        yield
    finally:
        if started:
            nf.shutdown()


def _add_costs(micro: dict, times: int, update: dict) -> dict:
    """One optimizer step's costs: `times` micro-batch programs and an update."""
    kinds = set(micro["comm_bytes"]) | set(update["comm_bytes"])
    return {"comm_bytes": {k: times * micro["comm_bytes"].get(k, 0) + update["comm_bytes"].get(k, 0) for k in kinds},
            "collectives": {k: times * micro["collectives"].get(k, 0) + update["collectives"].get(k, 0)
                            for k in set(micro["collectives"]) | set(update["collectives"])},
            "peak_memory_bytes": max(micro["peak_memory_bytes"], update["peak_memory_bytes"]),
            "flops": times * micro["flops"] + update["flops"]}


def _memory(costs: dict) -> dict:
    """This process's measured peak (the CUDA allocator's on a GPU, else the resident set) beside
    the program's estimate per rank. In simulation one process holds every rank."""
    out = {"estimated_peak_mib": costs["peak_memory_bytes"] / 2**20}
    if torch.cuda.is_available():
        out["measured_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        out["measured_peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    return out


# peak dense bf16 tensor-core flops per second, from the vendors' specifications (SXM parts)
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "B200": 2250e12}


def _peak_flops() -> float | None:
    """This device's peak bf16 flops per second, where it is known (a GPU named in the table)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes}:{s:02d}"


class _Progress:
    """The run's progress: on a terminal, rich's bar (steps, elapsed, time left, loss, tokens/s,
    memory), redrawn in place; on a pipe, a line every `--log-every` steps with the same figures."""

    def __init__(self, say, first: int, total: int, quiet: bool):
        self.say, self.first, self.total, self.bar = say, first, total, None
        if sys.stdout.isatty() and not quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
                TimeRemainingColumn

            self.bar = Progress(BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"),
                                TimeRemainingColumn(), TextColumn("{task.fields[figures]}"))
            self.task = self.bar.add_task("train", total=total, completed=first, figures="compiling")
            self.bar.start()

    def update(self, done: int, loss: float, rate: float | None, peak: int, elapsed: float,
               eval_loss: float | None, final: bool) -> None:
        figures = (f"loss {loss:.3f}  " + (f"eval {eval_loss:.3f}  " if eval_loss is not None else "")
                   + (f"{rate:,.0f} tokens/s  " if rate is not None else "compiling  ") + f"{peak / 2**20:.1f} MiB/rank")
        if self.bar is not None:
            self.bar.update(self.task, completed=done, figures=figures)
            if final:  # keep a line of each --log-every
                self.bar.console.print(f"step {done:>5}/{self.total}  {figures}")
            return
        if final:
            width, left = 24, elapsed / (done - self.first) * (self.total - done)
            filled = width * done // self.total
            self.say(f"[{'#' * filled}{'.' * (width - filled)}] step {done:>5}/{self.total}  {figures}  "
                     f"{_clock(elapsed)} elapsed, {_clock(left)} left")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


if __name__ == "__main__":
    main()
