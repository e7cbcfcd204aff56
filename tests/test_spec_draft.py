"""Draft-model speculation on the real SmolLM2 (float32, weights dequantized), drafting for
itself: greedy tokens identical with speculation on and off, at batch 1, in a mixed batch, with a
stop string and max_tokens inside an accepted run, and with a swap and a recompute preemption
in the middle; the draft's acceptance is near 1 (it is the target: a wrong draft cache or
catch-up shows as rejections); its cache's blocks all come back. In CI time: the tiny random
model drafting for itself through preemptions; a draft with another tokenizer refused at start."""

from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.models import catalog
from runtime.spec.draft_model import Chunk, DraftTokenizerMismatch, prepare_draft_attention
from runtime.spec.draft_proposer import DraftModelProposer
from runtime.spec.policy import DraftCost, DraftWork, FixedK
from runtime.spec.proposer import NgramConfig, NgramProposer
from scheduler.block_pool import chain_hashes
from scheduler.request import Request, SamplingParams

SMOLLM2 = "smollm2-135m-instruct"
PASSAGE = (
    "The printing press was invented by Johannes Gutenberg around 1440. It used movable metal "
    "type, oil-based ink and a wooden press adapted from wine presses."
)


def make_engine(k: int, **overrides) -> Engine:
    settings = dict(
        dtype="float32",
        quantization="none",
        num_kv_blocks=400,
        max_num_seqs=8,
        speculative="draft",
        draft_model=SMOLLM2,
        draft_prompt_lookup=False,  # the draft model's own drafts (lookup first: tested apart)
    )
    engine = Engine(EngineConfig(**(settings | overrides)))
    engine.speculator.policy = FixedK(k)
    return engine


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine(4)


def greedy(n: int, **more) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **more)


def draft_pool(engine: Engine):
    return engine.speculator.proposer.draft.pool


def run(engine: Engine, prompts, params, speculate: bool) -> list[tuple]:
    engine.scheduler.drafter = engine.speculator if speculate else None
    requests = engine.generate(prompts, params)
    assert draft_pool(engine).num_free_blocks == draft_pool(engine).num_blocks
    return [(r.output_token_ids, r.output_text, r.finish_reason) for r in requests]


def one_by_one(engine: Engine, prompts, params) -> list[tuple]:
    """The reference: each prompt alone, without speculation."""
    return [run(engine, [p], [sp], speculate=False)[0] for p, sp in zip(prompts, params)]


def acceptance_since(engine: Engine, before: tuple[int, int]) -> float:
    stats = engine.speculator.stats
    drafted = stats.num_draft_tokens - before[0]
    assert drafted > 0
    return (stats.num_accepted_tokens - before[1]) / drafted


def counts(engine: Engine) -> tuple[int, int]:
    return engine.speculator.stats.num_draft_tokens, engine.speculator.stats.num_accepted_tokens


@pytest.mark.real_model
@pytest.mark.slow
def test_greedy_identical_at_batch_1_and_drafts_accepted(engine):
    prompt = engine.tokenizer.encode("Write a short poem about the sea.")
    plain = run(engine, [prompt], [greedy(40)], speculate=False)
    before = counts(engine)
    assert run(engine, [prompt], [greedy(40)], speculate=True) == plain
    assert acceptance_since(engine, before) > 0.9


@pytest.mark.real_model
@pytest.mark.slow
def test_greedy_identical_in_a_mixed_batch(engine):
    prompts = [
        engine.tokenizer.encode(f"Text: {PASSAGE}\nThe same text again: {PASSAGE[:30]}"),
        engine.tokenizer.encode("Write a short poem about the sea."),
        engine.tokenizer.encode("List three colours: red, green,"),
        engine.tokenizer.encode(PASSAGE.upper()),
    ]
    params = [greedy(33), greedy(24), greedy(17), greedy(29)]
    plain = run(engine, prompts, params, speculate=False)
    before = counts(engine)
    assert run(engine, prompts, params, speculate=True) == plain
    assert acceptance_since(engine, before) > 0.9


@pytest.mark.real_model
@pytest.mark.slow
def test_stop_strings_and_max_tokens_inside_an_accepted_run(engine):
    prompt = engine.tokenizer.encode("Write a short poem about the sea.")
    full = run(engine, [prompt], [greedy(24)], speculate=False)[0]
    text = full[1]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = [greedy(7), greedy(24, stop=[stop]), greedy(24, stop_token_ids=[full[0][9]])]
    expected = one_by_one(engine, [prompt] * 3, params)
    assert run(engine, [prompt] * 3, params, speculate=True) == expected
    assert expected[1][2] == "stop" and len(expected[2][0]) < 24


@pytest.mark.real_model
@pytest.mark.slow
def test_after_rejections_the_drafts_are_those_of_a_fresh_draft_cache(engine):
    """The target rejects a draft (a token other than the draft's follows the accepted ones),
    and now and then the row decodes a few steps without drafts: the row's cache rolls back and
    catches up, and drafts what a cache built from scratch on the same tokens drafts."""
    proposer = engine.speculator.proposer
    fresh = DraftModelProposer(proposer.draft, num_speculative_tokens=4)
    request = Request("rolled-back", engine.tokenizer.encode(PASSAGE))
    for step in range(8):
        drafts = proposer.propose_rows([request], [4])[0]
        assert drafts == fresh.propose_rows([request], [4])[0]
        fresh.release(request.request_id)
        num_accepted = step % 4
        rejected = drafts[num_accepted]
        request.output_token_ids += [*drafts[:num_accepted], (rejected + 7) % 49152]
        if step % 2:  # steps without drafts
            request.output_token_ids += [11, 12]
    proposer.release(request.request_id)
    assert draft_pool(engine).num_free_blocks == draft_pool(engine).num_blocks


@pytest.fixture(scope="module")
def tight() -> Engine:
    """A KV cache of 10 blocks for 6 requests of 12-32 prompt tokens and 20 more: preemptions."""
    return make_engine(3, num_kv_blocks=10, max_num_seqs=6, swap_space=0.01,
                       enable_prefix_caching=False)  # fmt: skip


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_in_the_middle_keeps_greedy_tokens_and_frees_draft_blocks(tight, mode):
    tight.reset_scheduler(preemption_mode=mode)
    tight.scheduler.drafter = tight.speculator
    prompts = [[3 + i, 4, 5, 6] * (3 + i) for i in range(6)]
    params = [greedy(20) for _ in prompts]
    before = counts(tight)
    requests = [tight.add_request(p, sp) for p, sp in zip(prompts, params)]
    proposer = tight.speculator.proposer
    while tight.has_unfinished():
        tight.step()
        preempted = [r for r in requests if r.preempted_mode is not None]
        assert not any(r.request_id in proposer.rows for r in preempted)
    assert tight.scheduler.num_preemptions[mode] > 0
    assert draft_pool(tight).num_free_blocks == draft_pool(tight).num_blocks
    assert acceptance_since(tight, before) > 0.9
    speculated = [(r.output_token_ids, r.output_text, r.finish_reason) for r in requests]
    assert speculated == one_by_one(tight, prompts, params)


@pytest.mark.real_model
@pytest.mark.slow
def test_an_aborted_request_gives_its_draft_blocks_back(engine):
    engine.scheduler.drafter = engine.speculator
    request = engine.add_request(engine.tokenizer.encode(PASSAGE), greedy(40))
    while request.num_draft_tokens == 0:
        engine.step()
    assert request.request_id in engine.speculator.proposer.rows
    engine.abort(request.request_id)
    while engine.has_unfinished():
        engine.step()
    assert draft_pool(engine).num_free_blocks == draft_pool(engine).num_blocks


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Engine:
    """CI-sized: the random 2-layer model as target and draft, 10 blocks for 6 requests."""
    return make_engine(3, model=str(tiny_model_dir), draft_model=str(tiny_model_dir),
                       num_kv_blocks=10, max_num_seqs=6, swap_space=0.01,
                       enable_prefix_caching=False)  # fmt: skip


def test_a_tiny_model_drafting_for_itself_through_preemptions(tiny):
    engine = tiny
    prompts = [[3 + i, 4, 5, 6] * (3 + i) for i in range(6)]
    params = [greedy(20) for _ in prompts]
    before = counts(engine)
    speculated = run(engine, prompts, params, speculate=True)
    assert sum(engine.scheduler.num_preemptions.values()) > 0
    assert acceptance_since(engine, before) > 0.9
    assert speculated == one_by_one(engine, prompts, params)


def test_a_long_catch_up_comes_in_chunks_then_drafts_as_a_fresh_cache(tiny):
    """Catch-ups share a token budget per call: a 40-token prompt with 16 a call takes two
    calls without drafts, then the third catches up on the last 8 and drafts what a cache
    without the budget drafts."""
    draft = tiny.speculator.proposer.draft
    chunked = DraftModelProposer(draft, num_speculative_tokens=4, max_catch_up_tokens=16)
    whole = DraftModelProposer(draft, num_speculative_tokens=4)
    request = Request("long", [5 + i % 30 for i in range(40)])
    assert [chunked.propose_rows([request], [4])[0] for _ in range(2)] == [[], []]
    assert chunked.rows["long"].num_computed == 32
    drafts = chunked.propose_rows([request], [4])[0]
    assert len(drafts) == 4 and drafts == whole.propose_rows([request], [4])[0]
    for proposer in (chunked, whole):
        proposer.release("long")
    assert draft.pool.num_free_blocks == draft.pool.num_blocks


@pytest.fixture(scope="module")
def tiny_cached(tiny_model_dir) -> Engine:
    """The tiny model drafting for itself, prefix caching on (the draft cache's too)."""
    return make_engine(4, model=str(tiny_model_dir), draft_model=str(tiny_model_dir),
                       num_kv_blocks=64, max_num_seqs=4)  # fmt: skip


def true_block_hashes(token_ids: list[int], block_size: int) -> set[int]:
    hashes: list[int] = []
    chain_hashes(token_ids, block_size, len(token_ids), hashes)
    return set(hashes)


def test_a_prompt_seen_before_catches_up_only_past_its_cached_prefix(tiny_cached):
    """The draft cache registers the full blocks of a row's true tokens, never a draft: a second
    request with the same prompt starts from them, and drafts what a row built from scratch
    drafts; every block comes back when both finish."""
    draft = tiny_cached.speculator.proposer.draft
    proposer = DraftModelProposer(draft, num_speculative_tokens=4)
    prompt = [5 + i % 30 for i in range(40)]
    first = Request("first", prompt)
    first_drafts = proposer.propose_rows([first], [4])[0]
    assert len(first_drafts) == 4 and proposer.rows["first"].num_computed == 40 + 3
    first.output_token_ids += [first_drafts[0], (first_drafts[1] + 1) % 90]  # one accepted
    proposer.propose_rows([first], [4])
    true_hashes = true_block_hashes(first.all_token_ids, draft.block_size)
    assert set(draft.pool.cached_blocks) <= true_hashes and len(draft.pool.cached_blocks) == 2

    second = Request("second", prompt)
    drafts = proposer.propose_rows([second], [4])[0]
    assert proposer.rows["second"].block_ids[:2] == proposer.rows["first"].block_ids[:2]
    draft.prefix_caching = False
    try:
        scratch = DraftModelProposer(draft, num_speculative_tokens=4)
        assert drafts == scratch.propose_rows([Request("scratch", prompt)], [4])[0]
        scratch.release("scratch")
    finally:
        draft.prefix_caching = True
    for request_id in ("first", "second"):
        proposer.release(request_id)
    assert draft.pool.num_free_blocks == draft.pool.num_blocks
    assert set(draft.pool.cached_blocks) <= true_hashes


def test_a_repeated_prompt_speculates_the_same_tokens_from_the_cache(tiny_cached):
    prompts = [[3 + i % 7, 4, 5, 6] * 9 for i in range(3)]
    params = [greedy(20) for _ in prompts]
    plain = run(tiny_cached, prompts, params, speculate=False)
    for _ in range(2):  # the second round finds the prompts in both caches
        assert run(tiny_cached, prompts, params, speculate=True) == plain
    assert tiny_cached.speculator.proposer.draft.pool.cached_blocks


def test_the_draft_cost_is_measured_on_steady_steps_only(tiny_cached):
    """A draft token's price is that of a steady step, whose rows catch up on the one or two
    tokens a verify leaves; a prompt's catch-up, or a row back after steps without drafts, is a
    forward pass over many tokens and is not priced per draft."""
    cost = DraftCost()
    proposer = DraftModelProposer(tiny_cached.speculator.proposer.draft, 4, cost)
    request = Request("steady", [7 + i % 20 for i in range(37)])
    drafts = proposer.propose_rows([request], [4])[0]
    assert cost.seconds_per_token == 0.0  # the prompt's catch-up
    request.output_token_ids += [*drafts[:2], (drafts[2] + 1) % 90]  # two accepted, then another
    proposer.propose_rows([request], [4])
    steady = cost.seconds_per_token
    assert steady > 0.0
    work = proposer.draft_work(request)
    assert work.by_model and work.catch_up_tokens == 0  # a steady row
    request.output_token_ids += [11, 12, 13, 14, 15]  # steps without drafts
    behind = request.num_tokens - proposer.rows["steady"].num_valid(request.all_token_ids)
    assert proposer.draft_work(request).catch_up_tokens == behind - 2 > 0  # beyond a steady 2
    proposer.propose_rows([request], [4])
    assert cost.seconds_per_token == steady
    assert cost.seconds_per_catch_up_token != steady  # that call priced a catch-up token
    assert proposer.draft_work(Request("new", [7, 8, 9])).catch_up_tokens == 0  # a one-off
    proposer.release("steady")


def test_the_model_alone_says_which_rows_text_repeats(tiny_cached):
    """Without the lookup the model drafts every row, and draft_work says whether the row's
    last 3 tokens occurred before: the policy plans those drafts at the mean rate."""
    proposer = DraftModelProposer(tiny_cached.speculator.proposer.draft, 4)
    phrase = [21, 22, 23, 24]
    request = Request("r", [5, 6, *phrase, 9, 10, 30, 31])
    assert proposer.draft_work(request) == DraftWork(by_model=True)
    request.output_token_ids += phrase[:2]  # two tokens: not yet a repeat
    assert not proposer.draft_work(request).repeats
    request.output_token_ids += phrase[2:3]
    assert proposer.draft_work(request) == DraftWork(by_model=True, repeats=True)
    proposer.release("r")


def test_prompt_lookup_drafts_first_and_the_model_where_nothing_matches(tiny_cached):
    """--draft-prompt-lookup: a row whose last 3 tokens occurred before takes the k tokens that
    followed them without a forward pass; a row without such a match drafts with the model, and
    its cache catches up later on what lookup served."""
    draft = tiny_cached.speculator.proposer.draft
    lookup = NgramProposer(NgramConfig(3, 4, 4))
    proposer = DraftModelProposer(draft, 4, lookup=lookup)
    phrase = [21, 22, 23, 24, 25, 26, 27, 28]
    repeating = Request("repeats", [5, 6, *phrase, 9, 10, *phrase[:3]])
    fresh = Request("fresh", [30 + i for i in range(20)])
    drafts = proposer.propose_rows([repeating, fresh], [4, 4])
    assert drafts[0] == phrase[3:7]
    assert "repeats" not in proposer.rows  # no forward pass for it
    fresh.output_token_ids += [51, 52, 53, 54, 55, 56]  # behind, and nothing to look up
    assert proposer.draft_work(fresh).catch_up_tokens > 0
    fresh.output_token_ids += [51, 52, 53]  # its last 3 tokens occurred before: lookup serves
    assert proposer.draft_work(fresh) == DraftWork(by_model=False)  # no forward pass
    del fresh.output_token_ids[-9:]
    model_only = DraftModelProposer(draft, 4)
    alone = model_only.propose_rows([fresh], [4])[0]
    model_only.release("fresh")
    assert drafts[1] == alone and len(alone) == 4
    repeating.output_token_ids += [29, 31, 32]  # the match runs out: the model drafts
    drafts = proposer.propose_rows([repeating], [4])[0]
    assert len(drafts) == 4 and proposer.rows["repeats"].num_computed == repeating.num_tokens + 3
    for request_id in ("repeats", "fresh"):
        proposer.release(request_id)
    assert draft.pool.num_free_blocks == draft.pool.num_blocks


@pytest.mark.parametrize("draft", ["gemma-3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_a_draft_with_another_tokenizer_is_refused_at_start(tiny_model_dir, draft):
    if catalog.available_path(draft) is None:
        pytest.skip(f"{draft} is not pulled (`conveyor models pull {draft}`)")
    config = EngineConfig(
        model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16, speculative="draft",
        draft_model=draft,
    )  # fmt: skip
    with pytest.raises(DraftTokenizerMismatch, match="does not share the target model's tok"):
        Engine(config)


def test_a_short_chunk_runs_as_decode_queries_and_sees_what_a_prefill_sees(tiny):
    """A chunk of at most DECODE_QUERY_TOKENS new tokens (a catch-up after a round whose drafts
    all landed) runs a decode query per token, each attending to its own position and the ones
    before it; a longer chunk runs as a prefill. Both leave the same cache and the same token."""
    draft = tiny.speculator.proposer.draft
    tokens = torch.tensor([5 + (7 * i) % 40 for i in range(12)])
    short = prepare_draft_attention([Chunk([0, 1], 9, 3)], draft.block_size, torch.device("cpu"))
    attn, positions, last = short
    assert attn.num_decode_tokens == 3 and attn.num_prefill_seqs == 0
    assert attn.decode_seq_lens.tolist() == [10, 11, 12] and positions.tolist() == [9, 10, 11]
    assert last.tolist() == [2]
    long = prepare_draft_attention([Chunk([0, 1], 0, 12)], draft.block_size, torch.device("cpu"))
    assert long[0].num_decode_tokens == 0 and long[0].prefill_seq_lens.tolist() == [12]
    needed = -(-12 // draft.block_size)
    whole, split = ([draft.pool.take() for _ in range(needed)] for _ in range(2))
    try:
        at_once = draft.greedy_next(tokens, [Chunk(whole, 0, 12)])
        draft.greedy_next(tokens[:9], [Chunk(split, 0, 9)])
        in_two = draft.greedy_next(tokens[9:], [Chunk(split, 9, 3)])
        assert torch.equal(at_once, in_two)
        for cache in draft.k_caches + draft.v_caches:  # [blocks, block_size, heads, head_dim]
            got, expected = (cache[blocks].flatten(0, 1)[:12] for blocks in (split, whole))
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    finally:
        draft.pool.free(whole + split)
    assert draft.pool.num_free_blocks == draft.pool.num_blocks


@pytest.mark.real_model
@pytest.mark.slow
def test_a_draft_vocabulary_subset_drafts_from_its_ids_and_the_rows_tokens():
    """SmolLM2's GGUF file drafting for itself from its 1024 lowest ids and the tokens each row
    has seen: greedy output as without speculation, every draft in that set, and a copy's
    drafts still accepted (the copied tokens are the prompt's)."""
    engine = make_engine(4, dtype="auto", quantization="gguf", draft_vocab_size=1024)
    draft = engine.speculator.proposer.draft
    assert draft.vocabulary is not None and draft.vocabulary.frequent.out_features == 1024
    drafted: list[int] = []
    greedy_next = draft.greedy_next

    def recorded(*args):
        tokens = greedy_next(*args)
        drafted.extend(tokens.tolist())
        return tokens

    draft.greedy_next = recorded
    prompt = engine.tokenizer.encode(f"Text: {PASSAGE}\nThe same text again: {PASSAGE[:30]}")
    plain = run(engine, [prompt], [greedy(32)], speculate=False)
    before = counts(engine)
    assert run(engine, [prompt], [greedy(32)], speculate=True) == plain
    assert acceptance_since(engine, before) > 0.5
    rare = {t for t in prompt + plain[0][0] if t >= 1024}
    assert drafted and rare and set(drafted) <= set(range(1024)) | rare
    assert any(t >= 1024 for t in drafted)  # the copied rare tokens came from the seen rows
