"""What a request dispatched by the batch runner carries in its ASGI scope: the line it is.

Only the runner puts it there (an HTTP client cannot set scope keys): the route then takes the
batch's principal instead of a key, and the admission prices it at the batch price, marks the line
admitted in the database before its row is journaled (`mark_admitted`: a line is admitted once,
whichever runner or instance holds it), writes its row with api = batch and the batch id, and says
that it was admitted (so a refusal can be retried)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from billing.keys.store import Principal

SCOPE_KEY = "tollgate.batch_line"


@dataclass
class BatchLine:
    batch_id: str
    request_id: str
    principal: Principal  # the batch's key, in the scheduler's lowest class
    # The runner's durable mark that this line is admitted (billing/batches/store.py: BatchStore.admitted):
    # False when the line is no longer the runner's (another took the batch over, put the line back or ended it).
    mark: Callable[[], Awaitable[bool]] | None = None
    admitted: bool = False  # set once Meter.admit took it: from then on it has its ledger row
    marked: bool = False  # its mark may be in the database (also when asking failed): it is never put back to pending
    taken: bool = False  # its mark was refused: the line is another runner's, this run leaves it alone

    async def mark_admitted(self) -> bool:
        """Marks the line admitted before its row is journaled; False: not this runner's any more."""
        if self.mark is None:
            return True
        self.marked = True  # until the database answers: a mark whose answer is lost may have been written
        self.marked = await self.mark()  # raising (the database is out): the admission fails, the line ends as an error
        self.taken = not self.marked
        return self.marked


def batch_line(scope: dict[str, Any]) -> BatchLine | None:
    line = scope.get(SCOPE_KEY)
    return line if isinstance(line, BatchLine) else None
