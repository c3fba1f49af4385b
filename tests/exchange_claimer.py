"""A learner process that only claims tokens from an fsspec exchange (tests/test_exchange_fsspec.py).

Kept apart from the test module so that a spawned child imports the exchange alone, not JAX."""

from __future__ import annotations

import os
import signal

from diloco.exchange.fsspec import FsspecExchange


def claim_until_refused(url: str, m: int, die_after: int | None, out) -> None:
    """Claim 8 tokens at a time as learner ``m`` until refused; put ``(m, tokens)`` on ``out``.
    With ``die_after``, SIGKILL this process right after the claim that reaches that many tokens."""
    ex = FsspecExchange.open(url, poll_s=0.001)
    n = 0
    while ex.claim_tokens(8, learner=m):
        n += 8
        if die_after is not None and n >= die_after:
            os.kill(os.getpid(), signal.SIGKILL)
    out.put((m, n))
