"""The Kubernetes Inference Gateway's request headers, read as Conveyor's tenancy reads them.

The endpoint picker (llm-d's router, the Gateway API Inference Extension's EPP) keys its flow
control on two headers that reach every Conveyor replica it routes to:

- `x-llm-d-inference-fairness-id`: the flow a request belongs to. Conveyor's fair share is per
  tenant, so the fairness id must be the tenant's name. Absent: Conveyor answers with it (the
  response carries `x-llm-d-inference-fairness-id: <tenant>`, for whoever logs or forwards the
  response). Present and naming another tenant: 403 `fairness_id_mismatch`, so that no client
  can spend another tenant's share at the picker while being billed as itself here.
- `x-llm-d-inference-objective`: the name of an `InferenceObjective`. `--inference-objectives`
  maps each name to a Conveyor priority (lower is more urgent); an unknown name is 400
  `unknown_inference_objective`, a priority more urgent than the tenant's `max_priority` is 403
  `priority_not_allowed`, and a body `priority` that disagrees with the objective is 400.

The picker's older names (`x-gateway-inference-fairness-id`, `x-gateway-inference-objective`)
are read too, as the picker still reads them.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.errors import APIError, bad_request

FAIRNESS_ID_HEADER = "x-llm-d-inference-fairness-id"
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
OLD_FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
OLD_OBJECTIVE_HEADER = "x-gateway-inference-objective"


def header_value(request: web.Request, name: str, old_name: str) -> str | None:
    value = request.headers.get(name) or request.headers.get(old_name)
    return value.strip() if value and value.strip() else None


def check_fairness_id(request: web.Request, tenant: Any) -> None:
    """The fairness id, when given, is the authenticated tenant's name."""
    fairness_id = header_value(request, FAIRNESS_ID_HEADER, OLD_FAIRNESS_ID_HEADER)
    if fairness_id is not None and fairness_id != tenant.name:
        raise APIError(
            403,
            f"The header {FAIRNESS_ID_HEADER} names {fairness_id!r}, but this API key belongs "
            f"to the tenant {tenant.name!r}: the fairness id is the tenant's name.",
            code="fairness_id_mismatch",
        )


def objective_priority(request: web.Request, objectives: dict[str, int], tenant: Any) -> int | None:
    """The priority the request's objective names, checked against the tenant; None without one."""
    name = header_value(request, OBJECTIVE_HEADER, OLD_OBJECTIVE_HEADER)
    if name is None:
        return None
    if name not in objectives:
        known = ", ".join(sorted(objectives)) or "none are configured"
        raise bad_request(
            f"Unknown inference objective {name!r} in {OBJECTIVE_HEADER} (known: {known}).",
            code="unknown_inference_objective",
        )
    priority = objectives[name]
    if priority < tenant.max_priority:
        raise APIError(
            403,
            f"The inference objective {name!r} runs at priority {priority}, more urgent than "
            f"the tenant {tenant.name!r} may ask for (its max_priority is "
            f"{tenant.max_priority}; lower is more urgent).",
            code="priority_not_allowed",
        )
    return priority


def requested_priority(
    request: web.Request, body_priority: int | None, objectives: dict[str, int], tenant: Any
) -> int | None:
    """The body's `priority` or the objective's; both given, they must agree."""
    check_fairness_id(request, tenant)
    from_objective = objective_priority(request, objectives, tenant)
    if from_objective is None:
        return body_priority
    if body_priority is not None and body_priority != from_objective:
        raise bad_request(
            f"'priority' is {body_priority} but the inference objective in {OBJECTIVE_HEADER} "
            f"runs at priority {from_objective}: send one, or the same.",
            param="priority",
            code="conflicting_priority",
        )
    return from_objective


def fairness_headers(tenant: Any) -> dict[str, str]:
    """What a response tells the picker's side: the flow it was counted in."""
    return {FAIRNESS_ID_HEADER: tenant.name}
