"""Fan-out of a plan to the engine: one engine request per choice, their outputs merged as they
come; closing the merged stream aborts every engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from gateway.openai.planning import Plan


# ==== running ==================================================================================
def submit_choice(engine, plan: Plan, choice: int) -> AsyncIterator:
    tenant = plan.principal.tenant
    return engine.submit(
        plan.prompt_of(choice),
        plan.params[choice],
        request_id=plan.sequence_id(choice),
        priority=plan.priority,
        tenant=tenant.name,
        weight=tenant.weight,
        grammar=None if plan.grammar is None else plan.grammar.prepared,
    )


async def generate(engine, plan: Plan) -> AsyncIterator[tuple[int, Any]]:
    """(choice, output) from every engine request of the plan as they come.

    Each engine request is submitted right where its stream is consumed, so closing this
    generator (or cancelling the task that drives it) always closes every submitted stream,
    which aborts its engine request and frees its KV blocks.
    """
    if plan.num_choices == 1:
        stream = submit_choice(engine, plan, 0)
        async with contextlib.aclosing(stream):
            async for output in stream:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    pumps = [
        asyncio.create_task(pump(engine, plan, choice, queue)) for choice in range(plan.num_choices)
    ]
    try:
        num_open = plan.num_choices
        while num_open:
            choice, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                num_open -= 1
                continue
            yield choice, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def pump(engine, plan: Plan, choice: int, queue: asyncio.Queue) -> None:
    """Feed one engine request's outputs into the shared queue; None marks its end."""
    try:
        stream = submit_choice(engine, plan, choice)
        async with contextlib.aclosing(stream):
            async for output in stream:
                queue.put_nowait((choice, output))
    except Exception as error:
        queue.put_nowait((choice, error))
        return
    queue.put_nowait((choice, None))
