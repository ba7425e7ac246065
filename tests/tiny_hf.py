"""A tiny Hugging Face model folder for tests (no network): a byte-level BPE tokenizer and a random
LlamaForCausalLM, saved like a hub model folder."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_llama(folder: Path, *, documents: int, layers: int) -> None:
    """A byte-level BPE tokenizer (384 tokens, eos <|eos|>) trained on the first ``documents`` built-in
    corpus texts and a random LlamaForCausalLM over its vocabulary (``layers`` layers, width 64, a
    64-token context), both saved into ``folder``. initializer_range 0.1 (not 0.02) so that the random
    model's logits are not flat and a few steps of LoRA + memory training visibly lower the loss."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from memtrain.data.builtin import builtin_documents

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(builtin_documents(0)[:documents], trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<unk>", "<|eos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", unk_token="<unk>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.1, eos_token_id=fast.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(folder)
