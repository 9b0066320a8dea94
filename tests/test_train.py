"""The training entry point (README's main job), briefly, from scratch and from a Hugging Face
checkpoint."""

import torch
import transformers

from models import train


def test_train_from_scratch_lowers_the_loss(capsys):
    losses = train.main(["--steps", "40", "--seq-len", "32", "--batch-size", "8", "--warmup", "5", "--log-every", "20"])
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert "step    20" in capsys.readouterr().out


def test_train_from_a_hugging_face_checkpoint(tmp_path):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    losses = train.main(["--hf-checkpoint", str(tmp_path), "--steps", "20", "--seq-len", "32", "--batch-size", "8",
                         "--warmup", "5", "--log-every", "10"])
    assert sum(losses[-5:]) / 5 < losses[0]
