"""The incremental detokenizer: its pieces, joined, are byte for byte the full decode, for
random token sequences (multi-byte characters split across tokens, invalid bytes, special
tokens) on the real SmolLM2 tokenizer, the tiny test ones and a byte-fallback SentencePiece
one; and a token's cost is a window's decode, not the output's (counted in decoded tokens)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models

from engine.lanes.text import (
    MAX_UNSETTLED,
    IncrementalDecoder,
    TextCodec,
    TextStream,
    byte_fallback_ids,
)

REAL = Path(__file__).resolve().parents[2] / "build" / "smollm2-135m-instruct"


def byte_fallback_tokenizer() -> Tokenizer:
    """A Llama-2-style SentencePiece tokenizer: `<0xNN>` byte tokens, `▁` for spaces, the
    leading space stripped, and a few whole pieces (some multi-byte)."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "▁", "▁the", "▁cat", "at", "é", "北京", "▁✓", "ü", "▁ni", "ce", "▁▁"]
    tokenizer = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [],
                                     unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


def random_ids(rng: random.Random, vocab: int, favoured: list[int]) -> list[int]:
    """Mostly uniform ids, with runs of `favoured` ones (byte tokens, multi-byte pieces)."""
    ids: list[int] = []
    while len(ids) < rng.randrange(1, 60):
        if favoured and rng.random() < 0.5:
            ids.extend(rng.choice(favoured) for _ in range(rng.randrange(1, 6)))
        else:
            ids.append(rng.randrange(vocab))
    return ids


def incremental(tokenizer: Tokenizer, ids: list[int], byte_tokens=frozenset()) -> str:
    decoder = IncrementalDecoder(tokenizer, byte_tokens=byte_tokens)
    return "".join(decoder.push(t) for t in ids) + decoder.flush()


def check_identity(tokenizer: Tokenizer, sequences: int, seed: int) -> None:
    rng = random.Random(seed)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    # Token ids whose text is part of a UTF-8 character, or several bytes: where windows break.
    texts = tokenizer.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    favoured = [i for i, text in enumerate(texts)
                if "\ufffd" in text or len(text.encode()) > len(text)]
    specials = list(tokenizer.get_added_tokens_decoder())
    byte_tokens = byte_fallback_ids(tokenizer)
    for _ in range(sequences):
        ids = random_ids(rng, vocab, favoured)
        for _ in range(rng.randrange(3)):  # special tokens, dropped by the decode, anywhere
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        want = tokenizer.decode(ids, skip_special_tokens=True)
        assert incremental(tokenizer, ids, byte_tokens) == want, ids


@pytest.mark.skipif(not (REAL / "tokenizer.json").exists(),
                    reason="the real model is not built (make real-model)")
def test_the_real_tokenizers_pieces_are_its_full_decode():
    check_identity(Tokenizer.from_file(str(REAL / "tokenizer.json")), 300, seed=1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_test_tokenizers_pieces_are_their_full_decode(make_model, family):
    check_identity(TextCodec(make_model(family)).tokenizer, 300, seed=2)


def test_a_byte_fallback_tokenizers_pieces_are_its_full_decode():
    tokenizer = byte_fallback_tokenizer()
    assert len(byte_fallback_ids(tokenizer)) == 256
    check_identity(tokenizer, 500, seed=3)
    # A later byte turns a whole run into U+FFFDs: the run is held until it is final.
    ids = [tokenizer.token_to_id(t) for t in ("▁cat", "<0xE5>", "<0x8C>", "<0x97>", "<0x80>")]
    want = incremental(tokenizer, ids, byte_fallback_ids(tokenizer))
    assert tokenizer.decode(ids) == "cat\ufffd\ufffd\ufffd\ufffd" == want


def test_an_invalid_tail_comes_out_at_flush(make_model):
    tokenizer = Tokenizer.from_file(str(make_model("qwen3") / "tokenizer.json"))
    lead = next(i for i in range(tokenizer.get_vocab_size())
                if tokenizer.decode([i]) == "\ufffd")  # a lone UTF-8 lead or continuation byte
    decoder = IncrementalDecoder(tokenizer)
    ids = tokenizer.encode("ok ").ids + [lead]
    pushed = "".join(decoder.push(t) for t in ids)
    assert pushed == "ok " and decoder.flush() == "\ufffd"


def test_output_that_never_settles_still_streams_in_a_bounded_window(make_model):
    """A model emitting a lone UTF-8 byte over and over: text that never stops ending in
    U+FFFD comes out every few tokens, not at the end, and the window stays bounded."""
    tokenizer = Tokenizer.from_file(str(make_model("qwen3") / "tokenizer.json"))
    lone = next(i for i in range(tokenizer.get_vocab_size())
                if tokenizer.decode([i]) == "\ufffd")
    decoder = IncrementalDecoder(tokenizer)
    ids = tokenizer.encode("ok ").ids + [lone] * 500
    pieces, longest = [], 0
    for t in ids:
        pieces.append(decoder.push(t))
        longest = max(longest, len(decoder.window))
    assert sum(1 for p in pieces[:100] if p) >= 3  # "ok ", then more before the end
    assert longest <= 2 * MAX_UNSETTLED
    assert "".join(pieces) + decoder.flush() == tokenizer.decode(ids)


class CountingTokenizer:
    """The real tokenizer, counting the tokens each decode is given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_tokens_decode_cost_does_not_grow_with_the_output(make_model):
    tokenizer = Tokenizer.from_file(str(make_model("qwen3") / "tokenizer.json"))
    ids = tokenizer.encode("the cat sat on the mat, héllo wörld ✓ 北京. " * 120).ids
    counting = CountingTokenizer(tokenizer)
    decoder = IncrementalDecoder(counting)  # type: ignore[arg-type]
    costs = []
    for t in ids:
        before = counting.decoded
        decoder.push(t)
        costs.append(counting.decoded - before)
    assert len(ids) > 1000
    assert max(costs[-200:]) <= max(costs[:200]) <= 16  # a window's tokens, late as early


def test_stop_strings_across_tokens_are_found_and_the_rest_is_the_full_decode(make_model):
    codec = TextCodec(make_model("qwen3"))
    ids = codec.encode("héllo wörld ✓ 北京 and then STOP, never this")
    stream = TextStream(codec, ("✓ 北", "zzz"))
    out = "".join(stream.push(t) for t in ids if not stream.stopped)
    assert stream.stopped and out == "héllo wörld " and stream.flush() == ""
    unstopped = TextStream(codec, ("京 x", "never this!"))
    out = "".join(unstopped.push(t) for t in ids) + unstopped.flush()
    assert not unstopped.stopped and out == codec.decode(ids)
