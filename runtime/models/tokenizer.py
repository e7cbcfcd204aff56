"""Tokenizer wrapper and the incremental detokenizer that turns sampled tokens into safe text.

The detokenizer uses the prefix/read-offset technique: decode a short window of tokens that
were already emitted plus the new ones and emit only the difference, waiting while the text
ends in U+FFFD (a token that stops in the middle of a UTF-8 character).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
NUM_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: Sequence[int] = ()
    ):
        self.hf_tokenizer = hf_tokenizer
        # a fast tokenizer's own decoder: HF's decode around it costs 5x the decode itself, and
        # the detokenizer calls it twice per sampled token
        self.backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self.vocab_size = len(hf_tokenizer)
        eos_ids = [hf_tokenizer.eos_token_id, *extra_eos_token_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in eos_ids if i is not None)
        )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, extra_eos_token_ids: Sequence[int] = ()
    ) -> Tokenizer:
        """A local HF directory with tokenizer files, or a GGUF file (or a directory holding one);
        more end-of-sequence ids than the tokenizer's own (a GGUF file's end-of-turn ids)."""
        directory, gguf_file = locate_tokenizer(Path(path))
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        hf_tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)
        return cls(hf_tokenizer, [*read_generation_eos_ids(directory), *extra_eos_token_ids])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.backend is not None:  # no clean-up, as below
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf_tokenizer.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,  # context-free, so windows decode consistently
        )

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf_tokenizer, "chat_template", None))

    @property
    def template_renders_tools(self) -> bool:
        """The chat template lays out tool definitions itself (Qwen's ChatML does)."""
        return self.has_chat_template and "tools" in self.hf_tokenizer.chat_template

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools=None
    ) -> list[int]:
        """Render the chat template to text, then encode it (the template holds the specials)."""
        if not self.has_chat_template:
            raise ValueError(f"tokenizer {self.hf_tokenizer.name_or_path!r} has no chat template")
        validate_messages(messages)
        try:
            text = self.hf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template failed on these messages: {error}") from error
        return self.encode(text, add_special_tokens=False)


def locate_tokenizer(path: Path) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for a tokenizer directory or a GGUF file."""
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if not path.is_dir():
        raise FileNotFoundError(f"no tokenizer directory or GGUF file at {path}")
    if any((path / name).exists() for name in TOKENIZER_FILES):
        return path, None
    gguf_files = sorted(path.glob("*.gguf"))
    if len(gguf_files) == 1:
        return path, gguf_files[0].name
    raise FileNotFoundError(f"no tokenizer files (or exactly one .gguf file) in {path}")


def read_generation_eos_ids(directory: Path) -> list[int]:
    """eos_token_id of generation_config.json (an int or a list), if the directory has one."""
    config_path = directory / "generation_config.json"
    if not config_path.is_file():
        return []
    eos = json.loads(config_path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def validate_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(f"messages[{index}] needs a non-empty string 'role'")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{index}] needs a string 'content'")


class IncrementalDetokenizer:
    """Text of one request's output tokens, emitted as soon as it is safe.

    A token's text is the decode of (read + unread + token) past the decode of read, once it no
    longer ends inside a character; `read` are the tokens of the last text read (the prompt's
    last few at first), `unread` those since. A fast tokenizer does this in its own
    DecodeStream, one call per token; others decode the two windows here. `pending` is decoded
    text held back because a stop string could still start in it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
    ):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str = include_stop_str
        self.stop_hit: str | None = None
        self.text = ""
        self.pending = ""
        self.read = self._prompt_context(prompt_token_ids)
        self.unread: list[int] = []
        self.stream = None
        if tokenizer.backend is not None:
            self.stream = DecodeStream(ids=self.read, skip_special_tokens=skip_special_tokens)

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """The new text that is safe to emit now ('' once a stop string was hit)."""
        if self.stop_hit is not None:
            return ""
        return self._emit("".join(map(self._read_token, new_token_ids)), final=False)

    def flush(self) -> str:
        """At finish: all that was held back, unless a stop string was hit."""
        if self.stop_hit is not None:
            return ""
        prefix_text, full_text = self._decode_windows()
        self.read, self.unread = [], []
        return self._emit(full_text[len(prefix_text) :], final=True)

    def _read_token(self, token_id: int) -> str:
        self.unread.append(token_id)
        if self.stream is None:
            text = self._decode_step()
        else:
            try:
                text = self.stream.step(self.tokenizer.backend, token_id)
            except Exception:  # a decoder whose text changes behind the prefix: decode here
                self.stream = None
                text = self._decode_step()
        if text:
            self.read, self.unread = self.unread, []
        return text or ""

    def _decode_step(self) -> str:
        prefix_text, full_text = self._decode_windows()
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still incomplete
        return full_text[len(prefix_text) :]

    def _decode_windows(self) -> tuple[str, str]:
        return self._decode(self.read), self._decode(self.read + self.unread)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        # A prompt that ends inside a character gives no context: its bytes are not ours.
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, new_text: str, final: bool) -> str:
        """Search stop strings in the held text plus new_text; emit what is safe."""
        if not self.stop:  # nothing is ever held back (a step per sampled token: keep it short)
            self.text += new_text
            return new_text
        self.pending += new_text
        stop_at = find_stop(self.pending, self.stop)
        if stop_at is not None:
            start, self.stop_hit = stop_at
            end = start + len(self.stop_hit) if self.include_stop_str else start
            emitted, self.pending = self.pending[:end], ""
        else:
            num_held = 0 if final else stop_prefix_len(self.pending, self.stop)
            cut = len(self.pending) - num_held
            emitted, self.pending = self.pending[:cut], self.pending[cut:]
        self.text += emitted
        return emitted


def find_stop(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the earliest stop string in text, or None."""
    found = [(text.find(s), s) for s in stop]
    found = [(start, s) for start, s in found if start >= 0]
    return min(found, key=lambda hit: (hit[0], -len(hit[1]))) if found else None


def stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of text that is the start of some stop string."""
    longest = min(len(text), max((len(s) - 1 for s in stop), default=0))
    for length in range(longest, 0, -1):
        tail = text[-length:]
        if any(s.startswith(tail) for s in stop):
            return length
    return 0
