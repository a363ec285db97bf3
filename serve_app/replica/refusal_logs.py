"""RefusalsAreNotFailures: the replica's `ray.serve` log filter that keeps a refusal (a 4xx the
client gets) out of Ray Serve's failed-request log."""

from __future__ import annotations

import logging

from memory.fairness import EncodeBacklogFull
from memory.records import QuotaExceeded
from serve_app.protocol import NotFound, RequestRejected


class RefusalsAreNotFailures(logging.Filter):
    """For the `ray.serve` logger of a replica: Ray Serve logs every exception a deployment method
    raises, with its traceback, as a failed request; a refusal (RequestRejected, NotFound,
    QuotaExceeded, EncodeBacklogFull: the client gets a 4xx) is not a failure of the replica."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        error = getattr(error, "cause", None) or error  # the shard's own exception, out of Ray's wrapper
        return not isinstance(error, (RequestRejected, NotFound, QuotaExceeded, EncodeBacklogFull))
