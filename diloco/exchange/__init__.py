"""Exchanges between learners and the syncer: the interface and its backends."""

from diloco.exchange.base import Exchange, Submission
from diloco.exchange.memory import InMemoryExchange, open_exchange, register_exchange, unregister_exchange

__all__ = ["Exchange", "InMemoryExchange", "Submission", "open_exchange", "register_exchange", "unregister_exchange"]
