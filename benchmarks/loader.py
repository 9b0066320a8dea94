"""Is the loader ever the bottleneck? Tokenization, batch reads and resident memory, with the step.

    python benchmarks/loader.py [--mb 100] [--steps 6] [--out DIR]

Makes a text file of `--mb` MB (the standard library's sources, repeated), trains a byte-level
BPE on its first megabyte (`tokenizers`), and prints:
- tokenization: `models.tokens.store` over the file from cold, MB/s and tokens/s;
- the loader: tokens per second `models.data.batches` hands one rank (its block of the main job's
  batch on dp_shard 2 x cp 2 x tp 2, read from the memory-mapped store; all 8 simulated ranks'
  blocks are read in the time counted, so this undercounts), beside the tokens per second the
  main job's step consumes a rank (`models.train --data`, simulated, after compilation), as a
  ratio (goal: 10x or more);
- resident memory while reading 200 batches from the store of this file and from one 10x smaller:
  the process's own (anonymous) memory, which stays flat, and the store's pages mapped in as read
  (the page cache's, up to the store's size).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import ndfunc as nf  # noqa: E402
from models import data, tokens, train  # noqa: E402
from ndfunc.sharding import NamedSharding  # noqa: E402


def rss_mb() -> tuple[float, float]:
    """(anonymous, file-backed) resident MB: the first is this process's own memory; the second the
    store's pages mapped in as read (the kernel maps the pages around each one read too), which
    are the page cache's, dropped under pressure rather than counted against the job."""
    found = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            found[line.split(":")[0]] = int(line.split()[1]) / 1024
    return found["RssAnon"], found["RssFile"]


def text_file(path: pathlib.Path, mb: int) -> pathlib.Path:
    corpus = bytes(data.stdlib_corpus(4 << 20).tolist()).decode("utf-8", "replace")
    with open(path, "w", encoding="utf-8") as f:
        written = 0
        while written < mb << 20:
            f.write(corpus)
            written += len(corpus)
    return path


def tokenizer(directory: pathlib.Path, sample: str) -> pathlib.Path:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([sample], trainers.BpeTrainer(vocab_size=2048, special_tokens=["<eos>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(directory)
    return directory


def loader_rate(corpus: tokens.Corpus, seq_len: int, micro: int, batches: int) -> tuple[float, tuple[float, float]]:
    """(tokens per second one rank's blocks are read at, RSS growth in MB) over `batches` batches,
    packed as the job packs them (tokens, targets, positions and document ids)."""
    config = nf.ParallelConfig(1, 2, 2, 2)
    sequences = data.Sequences(corpus.tokens, seq_len, vocab_size=corpus.vocab_size, starts=corpus.starts)
    before = rss_mb()
    with nf.simulate(8):
        mesh = config.build_mesh()
        sharding = NamedSharding(mesh, config.batch_spec)
        start = time.perf_counter()
        n = 0
        for batch in data.batches(sequences, micro * config.dp_world_size, sharding, steps=batches):
            n += batch["tokens"].numel()
        seconds = time.perf_counter() - start
    # a rank's block is 1/(dp x cp) of the batch; all 8 ranks' blocks were read in this time, so this
    # undercounts one rank's rate by up to 8x
    after = rss_mb()
    return n / 4 / seconds, (after[0] - before[0], after[1] - before[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None, help="where the files go (default: a temporary directory)")
    args = parser.parse_args()
    if args.out is None:
        with tempfile.TemporaryDirectory(prefix="ndfunc-loader-") as root:  # (its text, stores and metrics, gone after)
            run(args, pathlib.Path(root))
    else:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        run(args, pathlib.Path(args.out))


def run(args: argparse.Namespace, root: pathlib.Path) -> None:
    big = text_file(root / "big.txt", args.mb)
    small = text_file(root / "small.txt", max(1, args.mb // 10))
    tok = tokenizer(root / "tokenizer", big.read_text(encoding="utf-8")[:1 << 20])

    start = time.perf_counter()
    corpus = tokens.store(big, tok, root / "cache")
    store, vocab = corpus.tokens, corpus.vocab_size
    seconds = time.perf_counter() - start
    print(f"tokenization: {args.mb} MB in {seconds:.1f} s: {args.mb / seconds:.1f} MB/s, "
          f"{store.numel() / seconds:,.0f} tokens/s ({store.numel():,} tokens, vocabulary {vocab})")
    small_corpus = tokens.store(small, tok, root / "cache")

    seq_len, micro = 128, 8
    loader_rate(small_corpus, seq_len, micro, 20)  # the simulation's own first allocations, not counted
    _, grown_small = loader_rate(small_corpus, seq_len, micro, 200)
    read, grown_big = loader_rate(corpus, seq_len, micro, 200)

    metrics = root / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # (the job appends: this run's lines alone)
    train.main(["--data", str(big), "--tokenizer", str(tok), "--data-cache", str(root / "cache"),
                "--steps", str(args.steps), "--seq-len", str(seq_len), "--micro-batch", str(micro),
                "--metrics", str(metrics), "--log-every", str(args.steps)])
    rates = [r for line in metrics.read_text().splitlines()[2:] if (r := json.loads(line)["tokens_per_s"])]
    consumed = sum(rates) / len(rates) / 4  # the step's tokens/s over the 4 distinct blocks: one rank's
    print(f"loader: {read:,.0f} tokens/s to a rank; the step consumes {consumed:,.0f} tokens/s a rank "
          f"(simulated dp_shard 2 x cp 2 x tp 2): {read / consumed:.0f}x")
    for name, (anon, file) in ((f"{args.mb} MB", grown_big), (f"{max(1, args.mb // 10)} MB", grown_small)):
        print(f"reading 200 batches from the {name} file's store: anonymous memory +{anon:.1f} MB, its mapped "
              f"pages +{file:.1f} MB")


if __name__ == "__main__":
    main()
