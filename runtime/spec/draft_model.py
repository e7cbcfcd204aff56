"""The draft model (`--speculative draft --draft-model NAME_OR_PATH`): a second, small model with
the target's tokenizer, loaded as the target is (runtime.models.loader: same device, dtype and
quantization) and run through the same attention backend over its own paged KV cache.

Its cache is its own pool of blocks, as many token slots as the target's cache plus a few drafts
per row; the engine's block manager never sees them. The pool has a prefix cache of its own
(scheduler/block_pool.py, the target's kind): a full block of a row's true tokens (never a
draft) is registered under the chain hash the target's cache would give it, so a new row whose
prompt starts as an earlier one's does (a system prompt, a conversation's next turn, the same
request again) catches up only on the rest. A row's blocks are taken when it first drafts and
given back when its request finishes, is aborted or is preempted (`DraftModelProposer.release`);
a resumed row finds its own registered blocks again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.models.attention import AttentionBackend, AttentionMetadata, ForwardContext
from runtime.models.loader import ModelSource, load_model, open_model
from runtime.models.tokenizer import Tokenizer
from runtime.spec.draft_vocabulary import DraftVocabulary
from scheduler.block_pool import CachedBlockPool

# encoded by both tokenizers: code, prose, digits, accents, an emoji, a chat turn's specials
TOKENIZER_PROBE = (
    "def main(argv):\n    print('Hello, world!', 42, 3.14)  # naïve café 😀\n"
    "<|im_start|>user\nThe quick brown fox<|im_end|>"
)


class DraftTokenizerMismatch(ValueError):
    """The draft model does not share the target's tokenizer: its drafts would be other words."""


def check_same_tokenizer(
    target: Tokenizer, draft: Tokenizer, target_vocab_size: int, draft_vocab_size: int, name: str
) -> None:
    """Refuse, at start, a draft whose token ids do not mean the target's: the vocabulary sizes
    (tokenizer and embedding), the end-of-sequence ids and the encoding of a probe text."""
    problems = []
    if draft.vocab_size != target.vocab_size or draft_vocab_size != target_vocab_size:
        problems.append(
            f"vocabulary of {draft.vocab_size} tokens ({draft_vocab_size} embedding rows), "
            f"the target's {target.vocab_size} ({target_vocab_size})"
        )
    if draft.eos_token_ids != target.eos_token_ids:
        problems.append(
            f"end-of-sequence ids {list(draft.eos_token_ids)}, the target's "
            f"{list(target.eos_token_ids)}"
        )
    if not problems and draft.encode(TOKENIZER_PROBE) != target.encode(TOKENIZER_PROBE):
        problems.append("a probe text encodes to other token ids")
    if problems:
        raise DraftTokenizerMismatch(
            f"--draft-model {name} does not share the target model's tokenizer: "
            + "; ".join(problems)
            + ". A draft model must use the target's tokenizer."
        )


def load_draft_model(config, target, tokenizer: Tokenizer) -> DraftModel:
    """config: runtime.config.EngineConfig; target: the engine's ModelRunner (its device, dtype
    and cache size), tokenizer: the target's. Refuses a draft with another tokenizer."""
    source = open_model(config.draft_model)
    check_same_tokenizer(
        tokenizer,
        source.load_tokenizer(),
        target.model_config.vocab_size,
        source.config.vocab_size,
        config.draft_model,
    )
    return DraftModel(
        source,
        draft_cache_blocks(config, target.num_gpu_blocks),
        config.block_size,
        target.dtype,
        target.device,
        config.quantization if config.draft_quantization == "auto" else config.draft_quantization,
        prefix_caching=config.enable_prefix_caching,
        vocab_size=config.draft_vocab_size,
    )


DECODE_QUERY_TOKENS = 8  # a chunk of at most this many new tokens runs as decode queries


def draft_cache_blocks(config, num_target_blocks: int) -> int:
    """As many token slots as the target's cache, plus each row's drafts fed back past it."""
    drafts_per_row = -(-config.num_speculative_tokens // config.block_size) + 1
    return num_target_blocks + config.max_num_seqs * drafts_per_row


@dataclass(slots=True)
class Chunk:
    """One row's tokens in a draft forward pass: num_new tokens after num_computed cached ones."""

    block_ids: list[int]
    num_computed: int
    num_new: int


class DraftModel:
    """The draft model's weights and KV cache, and its greedy forward pass over a ragged batch."""

    def __init__(
        self,
        source: ModelSource,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str = "gguf",
        prefix_caching: bool = True,
        vocab_size: int = 0,
    ) -> None:
        self.device, self.block_size = device, block_size
        self.prefix_caching = prefix_caching
        self.model_config = mc = source.config
        self.backend = AttentionBackend(device, block_size, dtype)
        self.model = load_model(source, mc, dtype, device, self.backend, quantization)
        # --draft-vocab-size: the output projection's rows a draft token reads (None: all)
        self.vocabulary = DraftVocabulary.of(self.model, vocab_size)
        self.pool = CachedBlockPool(num_blocks)
        shape = (num_blocks, block_size, mc.num_kv_heads, mc.head_dim)
        # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(mc.num_layers)
        ]
        self.v_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(mc.num_layers)
        ]

        self.warm_up()

    def warm_up(self) -> None:
        """A prefill chunk and a decode on block 0 (kernels compile on first use on CUDA)."""
        block = [0] * -(-9 // self.block_size)
        ids = torch.arange(1, 10, device=self.device)
        self.greedy_next(ids[:8], [Chunk(block, 0, 8)])
        self.greedy_next(ids[8:], [Chunk(block, 8, 1)])

    @property
    def max_len(self) -> int:
        return self.model_config.max_position_embeddings

    @torch.inference_mode()
    def greedy_next(
        self, input_ids: torch.Tensor, chunks: list[Chunk], seen: set[int] | None = None
    ) -> torch.Tensor:
        """input_ids: [num_tokens] the chunks' tokens, in order, on the device -> [num_chunks]
        the greedy token after each chunk's last, on the device. Writes the chunks' KV. With a
        vocabulary subset, the token is the best of its ids and `seen` (the rows' rare ids)."""
        attn, positions, last_index = prepare_draft_attention(chunks, self.block_size, self.device)
        self.backend.prepare(attn)
        ctx = ForwardContext(attn, self.k_caches, self.v_caches)
        hidden = self.model(input_ids, positions, ctx)  # [num_tokens, hidden]
        rows = hidden[last_index]  # [num_chunks, hidden]
        if self.vocabulary is not None:
            return self.vocabulary.greedy(rows, seen or set())
        if self.model.greedy_projection is not None:
            return self.model.compute_greedy_tokens(rows)
        return self.model.compute_logits(rows).max(dim=-1).indices


def prepare_draft_attention(
    chunks: list[Chunk], block_size: int, device: torch.device
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """-> (attention metadata, positions [num_tokens], each chunk's last token [num_chunks]).
    Chunks of at most DECODE_QUERY_TOKENS new tokens run a decode query per token, as the
    target's drafted rows do (the fused decode layers: a catch-up of 2 tokens after a round
    whose drafts all landed took 28.5 ms as a prefill chunk against 17.5 ms for one token);
    longer ones run as prefill chunks (in order)."""
    num_new = torch.tensor([c.num_new for c in chunks], dtype=torch.int64)  # [num_seqs]
    computed = torch.tensor([c.num_computed for c in chunks], dtype=torch.int64)
    ends = num_new.cumsum(0)
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), num_new)  # [num_tokens]
    positions = torch.arange(int(ends[-1])) - (ends - num_new)[seq_of_token]
    positions += computed[seq_of_token]
    tables = torch.zeros((len(chunks), max(len(c.block_ids) for c in chunks)), dtype=torch.int32)
    for row, chunk in enumerate(chunks):
        tables[row, : len(chunk.block_ids)] = torch.tensor(chunk.block_ids, dtype=torch.int32)
    slots = tables[seq_of_token, positions // block_size].long() * block_size
    slots += positions % block_size
    start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).int()
    seq_lens = (computed + num_new).int()
    if int(num_new.max()) <= DECODE_QUERY_TOKENS:  # a decode query per token, none of prefill
        decode_tables, decode_lens = tables[seq_of_token], (positions + 1).int()
        prefill_tables, prefill_lens, start_loc = tables[:0], seq_lens[:0], start_loc[:1]
    else:
        decode_tables, decode_lens = tables[:0], seq_lens[:0]
        prefill_tables, prefill_lens = tables, seq_lens
    attn = AttentionMetadata(
        slot_mapping=slots.to(device),
        num_decode_tokens=len(decode_lens),
        decode_block_tables=decode_tables.to(device),
        decode_seq_lens=decode_lens.to(device),
        prefill_block_tables=prefill_tables.to(device),
        prefill_query_start_loc=start_loc.to(device),
        prefill_seq_lens=prefill_lens.to(device),
    )
    return attn, positions.to(device), (ends - 1).to(device)
