"""A deterministic byte-level BPE tokenizer with a ChatML template, trained on a built-in corpus."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Special tokens come first so their ids are fixed (0, 1, 2) whatever the vocabulary size.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
BOS_TOKEN_ID = 0  # <|endoftext|>, also the pad token, as in Qwen's tokenizers
PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 2  # <|im_end|>: a chat turn ends the generation

BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
# The corpus is a few kilobytes; past this many tokens the trainer runs out of pairs to merge.
MAX_TRAINED_VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 32768

# Qwen's ChatML template without tools: every message is one <|im_start|>role ... <|im_end|> turn.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_CORPUS_PARAGRAPHS: tuple[str, ...] = (
    ("The quick brown fox jumps over the lazy dog. A small model is served by several machines "
     "at once, and each machine holds a contiguous range of layers. Hidden rows travel around a "
     "ring from one machine to the next, and the first machine samples the next token."),
    ("Once upon a time there was a little town by the sea. Every morning the fishermen went out "
     "in their boats, and every evening they came back with baskets full of fish. The children "
     "ran along the beach, laughing and shouting, while their parents mended the nets."),
    ("To make a cup of tea, boil some water, put the tea leaves in a pot, and pour the water over "
     "them. Wait three or four minutes, then pour the tea into a cup. Some people add milk and "
     "sugar; others prefer lemon or honey. It is a simple thing, but it is done with care."),
    ("Question: What is the capital of France? Answer: The capital of France is Paris. "
     "Question: How many days are there in a week? Answer: There are seven days in a week. "
     "Question: Who wrote the play? Answer: I do not know, but I can help you find out."),
    ("The user asked the assistant a question, and the assistant answered politely. \"Hello! How "
     "can I help you today?\" said the assistant. \"Please tell me a story about a dragon,\" said "
     "the user. The assistant thought for a moment and then began to write."),
    ("In the beginning the network was slow, so the engineers measured every link and every "
     "layer. They wrote down the milliseconds per layer, the bandwidth of each hop, and the "
     "memory of each machine, and then they searched for the best placement of the layers."),
    ("def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i * 2))\n"
     "if x == 0 and y != 1:\n    value = [1, 2, 3]\n    result = {'key': value}\n"),
    ("Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 4096 65536 3.14159 2.71828 "
     "-1 +1 1e-6 50% $20 #1 @home (a) [b] {c} <d> a/b a\\b a|b a~b a^b a&b a*b a=b a;b a:b "
     "a,b a.b a!b a?b 'quoted' \"double\" `tick` - _ ..."),
    ("Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, "
     "April, May, June, July, August, September, October, November, December. Spring, summer, "
     "autumn and winter. Red, orange, yellow, green, blue, indigo and violet."),
    ("She said that the weather would be better tomorrow, and he agreed. They would walk to the "
     "hill, eat their lunch under the old oak tree, and come home before the rain. It was a good "
     "plan, and they were happy with it, because they had been working hard all week."),
)


@dataclass(frozen=True)
class TokenizerFiles:
    """Where the tokenizer was written and how many tokens it has."""

    tokenizer_json: Path
    tokenizer_config_json: Path
    vocab_size: int


def _training_corpus() -> list[str]:
    # Repeating the text lets common words cross the trainer's frequency threshold.
    return [paragraph for _ in range(4) for paragraph in _CORPUS_PARAGRAPHS]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE to at most `vocab_size` tokens (fewer when the corpus runs dry)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"tokenizer vocab_size {vocab_size} is below {MIN_VOCAB_SIZE} "
            f"(256 byte tokens + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tokenizer = Tokenizer(models.BPE())
    # No normalizer: NFC or lowercasing would break decode(encode(text)) == text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer=trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"tokenizer: special token {token} did not get id {token_id}")
    return tokenizer


def tokenizer_config() -> dict:
    """The `tokenizer_config.json` content that transformers' AutoTokenizer reads."""
    added_tokens_decoder = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "chat_template": CHATML_TEMPLATE,
        # Byte-level BPE already restores spaces exactly; the clean-up would corrupt " ." etc.
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "errors": "replace",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_tokenizer(out_dir: Path, vocab_size: int) -> TokenizerFiles:
    """Write `tokenizer.json` and `tokenizer_config.json` for a model with `vocab_size` rows."""
    trained_size = min(vocab_size, MAX_TRAINED_VOCAB_SIZE)
    tokenizer = build_tokenizer(trained_size)
    tokenizer_json = out_dir / "tokenizer.json"
    tokenizer_config_json = out_dir / "tokenizer_config.json"
    tokenizer.save(str(tokenizer_json), pretty=True)
    tokenizer_config_json.write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return TokenizerFiles(
        tokenizer_json=tokenizer_json,
        tokenizer_config_json=tokenizer_config_json,
        vocab_size=tokenizer.get_vocab_size(),
    )
