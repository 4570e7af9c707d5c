"""A tiny random-weight Llama and a BPE tokenizer, built offline.

The end-to-end tests, the TTFT benchmark and the example need a real model
directory that vLLM can load, and models cannot be downloaded here. This
module writes one: a ``LlamaForCausalLM`` with random weights (seeded, so every
build gives the same bytes) and a byte-level BPE tokenizer trained with
``tokenizers`` on generated text. It needs ``torch``, ``transformers`` and
``tokenizers`` (all installed with vLLM); nothing else in the connector
imports it.

``build_tiny_llama(path)`` is idempotent: a finished build leaves a
``.kvfabric-tiny-ok`` marker and a second call returns at once. A failed
build raises (whatever transformers/tokenizers raise) and leaves no marker.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

__all__ = ["TINY_LLAMA", "build_tiny_llama", "random_prompt", "tiny_engine_keys"]

# hidden 256, 4 layers, 4 heads, 2 KV heads, head_dim 64, vocab 2048
TINY_LLAMA = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=2048,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    # Larger than Llama's 0.02 so that random logits are peaked and greedy
    # decoding has no near-ties that float rounding could flip.
    initializer_range=0.08,
)

_MARKER = ".kvfabric-tiny-ok"
_WORDS = (
    "pool block cache key value token prefix shard server engine request "
    "layer head load save chunk hash model batch tensor memory page prompt "
    "system document query answer agent tool turn read write copy miss hit"
).split()


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(16)) for _ in range(n_lines)]


def build_tiny_llama(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write the tiny model + tokenizer into ``path`` (created); return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    if (out / _MARKER).exists():
        return out
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_LLAMA["vocab_size"] - 8,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(2000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.model_max_length = TINY_LLAMA["max_position_embeddings"]
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **TINY_LLAMA,
        bos_token_id=fast.convert_tokens_to_ids("<s>"),
        eos_token_id=fast.convert_tokens_to_ids("</s>"),
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / _MARKER).write_text(json.dumps({"seed": seed, **TINY_LLAMA}))
    return out


def random_prompt(n_tokens: int, *, seed: int, vocab: int = TINY_LLAMA["vocab_size"]) -> list[int]:
    """``n_tokens`` token ids drawn uniformly from the regular vocabulary (ids >= 8)."""
    rng = random.Random(seed)
    return [rng.randrange(8, vocab - 8) for _ in range(n_tokens)]


def tiny_engine_keys(model: str, extra_config: dict, *, block_size: int = 128):
    """The keys (``keys.EngineKeys``) of vLLM CPU engines (float32, ``LBHNC``, ``block_size``) serving
    the tiny Llama built at ``model`` with ``kv_connector_extra_config = extra_config``: the same for
    every TP size (layout version 3)."""
    from .keys import EngineKeys

    return EngineKeys.for_model(extra_config, model=model, dtype="torch.float32",
                                num_layers=TINY_LLAMA["num_hidden_layers"],
                                total_num_kv_heads=TINY_LLAMA["num_key_value_heads"],
                                head_size=TINY_LLAMA["head_dim"], block_size=block_size)
