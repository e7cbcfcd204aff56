"""Speculative decoding, the parts that do not depend on the step's shape: the proposers, n-gram
prompt lookup (`proposer`) and a draft model with its own paged KV cache (`draft_model`,
`draft_proposer`), batched verification with exact greedy acceptance and
rejection sampling (`verify`), the "never a loss" policy that picks each row's k from its
measured acceptance and the engine's measured step cost (`policy`, `step_cost`, `acceptance`),
and the counters the Prometheus exporter reads (`stats`).

How they plug into the step (`--speculative ngram|draft`; `speculator.Speculator` is the glue):
- scheduler/drafts.py: after every normal token is scheduled, the steady decodes are offered to
  the Speculator (the scheduler's `drafter`), which picks each row's k with the policy and fills
  the drafts with the proposer; drafts take only the budget and free blocks left (never a
  preemption), travel in `SchedulerOutput.draft_token_ids`, and their blocks are never hashed
  into the prefix cache; at landing the accepted drafts' KV counts as computed and the blocks
  past the row's tokens are trimmed.
- runtime/step: the drafts are written after their row's tokens in the input batch and scored as
  k extra query positions, each a decode query of its own (attention rounds them as plain
  decodes, so greedy text matches with speculation off); `verify_index` picks the k + 1
  positions per drafted row; the model runner verifies them (greedy: the projection's argmax;
  else `RejectionSampler`, drawing from the Sampler's generators). k = 0 rows take the plain
  path, so k = 0 everywhere is the plain step. A step with drafts lands before the next one
  is scheduled.
- Rows with penalties, logprobs or a grammar get k = 0 (`speculator.can_speculate`).
- runs.py: a stop string inside an accepted run cuts it where it ends.
- The engine feeds the Speculator each landed step (its measured cost, each row's acceptance,
  its preempted requests); its counters go to Prometheus and the finished event of each
  speculated request.
- A draft model (`--draft-model`, the target's tokenizer or refused at start) keeps each row's
  KV in its own blocks, catches up on the tokens it has not seen, then drafts greedily (a point
  mass: exact for sampled rows too); a request's draft blocks go when it finishes, is aborted
  or is preempted. Its measured seconds per drafted token are part of the policy's step cost.

Must not import: gateway, benchmarks, runtime.step, runtime.engine, runtime.engine_client, runtime.offline
"""
