"""When the cloud client tries the same URL again: the retry policy, without I/O.

This module owns :class:`RetryPolicy`; its defaults are the settings' own
(``fallback.max_retries``, ``fallback.backoff_s`` in :mod:`edgecloud.config`), so the documented
policy and the one applied are the same. :class:`~edgecloud.remote.client.CloudBackend` asks it after every
failed attempt, from its sync and its async path alike.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..config import DEFAULT_BACKOFF_S, DEFAULT_MAX_RETRIES
from ..errors import EdgeCloudError

__all__ = ["DEFAULT_BACKOFF_S", "DEFAULT_MAX_RETRIES", "DEFAULT_MAX_RETRY_WAIT", "RETRYABLE_STATUS", "Failure",
           "RetryPolicy"]

#: Longest ``Retry-After`` hint waited out before retrying (longer hints raise at once).
DEFAULT_MAX_RETRY_WAIT = 30.0
#: HTTP statuses worth another try on the same URL: overload and gateway trouble, not a 500.
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})


@dataclass
class Failure:
    """One failed attempt: the error to raise, and whether (and after how long) to retry."""

    error: EdgeCloudError
    retryable: bool = False
    retry_after: float | None = None
    cause: BaseException | None = None


@dataclass(frozen=True)
class RetryPolicy:
    """When to try the same URL again: the one decision the sync and async paths share.

    Retryable: connect errors, connections dropped before an answer, 429, 502, 503, 504. The
    wait is the server's ``Retry-After`` when it sends one (a hint above ``max_wait`` is not
    waited out: the error is raised so a fallback can go elsewhere), else ``backoff * 2**attempt``
    with ±50 % jitter.
    """

    max_retries: int = DEFAULT_MAX_RETRIES
    backoff: float = DEFAULT_BACKOFF_S
    max_wait: float = DEFAULT_MAX_RETRY_WAIT

    def wait(self, failure: Failure, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1``; raises the failure's error when it is final."""
        if failure.retryable and attempt < self.max_retries:
            if failure.retry_after is None:
                return min(self.backoff * 2**attempt * random.uniform(0.5, 1.5), self.max_wait)
            if failure.retry_after <= self.max_wait:
                return failure.retry_after
        raise failure.error from failure.cause
