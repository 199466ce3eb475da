"""What a request dispatched by the batch runner carries in its ASGI scope: the line it is.

Only the runner puts it there (an HTTP client cannot set scope keys): the route then takes the
batch's principal instead of a key, and the admission prices it at the batch price, writes its row
with api = batch and the batch id, and says that it was admitted (so a refusal can be retried)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from billing.keys.store import Principal

SCOPE_KEY = "tollgate.batch_line"


@dataclass
class BatchLine:
    batch_id: str
    request_id: str
    principal: Principal  # the batch's key, in the scheduler's lowest class
    admitted: bool = False  # set once Meter.admit took it: from then on it has its ledger row


def batch_line(scope: dict[str, Any]) -> BatchLine | None:
    line = scope.get(SCOPE_KEY)
    return line if isinstance(line, BatchLine) else None
