"""Speculative decoding, the parts that do not depend on the step's shape: the n-gram
prompt-lookup proposer (`proposer`), batched verification with exact greedy acceptance and
rejection sampling (`verify`), the "never a loss" policy that picks each row's k from its
measured acceptance and the engine's measured step cost (`policy`), and the counters the
Prometheus exporter reads (`stats`).

How they plug into the step (the integration after issue 24's pipeline lands):
- scheduler/: after every normal token is scheduled, the scheduler asks `SpeculationPolicy.choose`
  for each decoding row's k under the token budget left (never more blocks than are free: a draft
  never causes a preemption); the proposer fills the drafts; the scheduler output carries
  `draft_token_ids` per row (new field next to the tokens scheduled per row), and a row's
  scheduled-token count becomes 1 + k. Draft positions need KV slots, so the block manager
  allocates blocks for them like a prefill chunk, but they are never hashed into the prefix
  cache (only blocks full of accepted tokens are).
- runtime/step/ (input batch, inputs): a row's k drafts are written as k extra query positions
  after its last token, exactly like a chunk of prefill; `logits_indices` selects k + 1 rows of
  logits per speculating row, so the sampler sees flat logits [sum(k_i + 1), vocab].
- runtime/sampling/: rows with drafts go through `verify.verify_drafts` instead of the plain
  sampler (grammar masks, when present, are applied per draft position first); rows with k = 0
  take today's path unchanged, so with k = 0 everywhere the step is the same inputs and calls.
- KV rollback: the scheduler advances a request's computed-token count only by the accepted
  tokens + 1; the KV written at rejected positions is simply overwritten by the next step, and
  blocks that now lie wholly past the computed count are freed.
- The engine feeds `SpecDecodeStats` and `SpeculationPolicy.observe` from each step's result and
  its measured step time (`StepCostModel.observe`).

Must not import: gateway, benchmarks, runtime.step, runtime.engine, runtime.engine_client, runtime.offline
"""
