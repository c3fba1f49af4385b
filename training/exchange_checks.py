"""The fsspec exchange's URL checks, importable before JAX starts: ``flows/preflight.py`` refuses a
``runtime.exchange_url`` the exchange cannot use in about a second, without loading the training
stack (``training.decoupled`` imports JAX).

:func:`check_url` raises ``ValueError`` for a chained URL (a caching layer serves stale fragments);
:func:`check_writable` raises ``OSError`` (or ``ValueError``) when the root cannot be created,
written, read back and cleaned up. Both are ``diloco.exchange.fsspec``'s; see there.
"""

from diloco.exchange.fsspec import check_url, check_writable

__all__ = ["check_url", "check_writable"]
