"""The jobs `tests/test_processes_equal.py` runs three ways; run by it under torchrun as well.

    python -m torch.distributed.run --nproc-per-node 8 tests/processes_job.py OUT MODEL

Each job saves what it trained under OUT/<name> (`--save-hf`: the tensors as gathered, bit for bit).
"""

import sys

from models import train


def jobs(model: str) -> dict[str, list[str]]:
    """The main job's 4D llama step, and a Hugging Face Llama's step through `nf.nn`, on the 4D layout."""
    return {"llama": ["--steps", "3"],
            "hf": ["--hf-model", model, "--steps", "2", "--seq-len", "32", "--micro-batch", "2"]}


def main() -> None:
    out, model = sys.argv[1], sys.argv[2]
    for name, flags in jobs(model).items():
        losses = train.main([*flags, "--save-hf", f"{out}/{name}"])
        print(f"{name} losses {losses}", flush=True)


if __name__ == "__main__":
    main()
