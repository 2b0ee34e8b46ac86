"""A real byte-level BPE tokenizer built locally, so generated checkpoints need no download.

It is trained with the `tokenizers` library on a small corpus shipped with kubemoe and saved the
way hub tokenizers are (`tokenizer.json`, `tokenizer_config.json` with a ChatML chat template).
Byte-level BPE encodes any text; training is deterministic, so the same vocabulary size always
gives the same tokenizer.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int, texts: Iterable[str] | None = None):
    """Train a byte-level BPE tokenizer of at most `vocab_size` tokens on `texts` (default: the shipped
    corpus); return a transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    if texts is None:
        texts = resources.files("kubemoe").joinpath("data/corpus.txt").read_text().splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
    )


def save_tokenizer(vocab_size: int, out: Path, texts: Iterable[str] | None = None) -> dict[str, int]:
    """Write the tokenizer files into `out`; return the ids of its special tokens."""
    tokenizer = build_tokenizer(vocab_size, texts)
    tokenizer.save_pretrained(out)
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
