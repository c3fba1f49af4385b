"""One slot of a Prefect global concurrency limit, held by a process that may die: ``with slot(limit):``.

A sweep cell or tuning trial (``flows.sweep.sweep_cell``) holds a slot of ``sweep-<name>`` or
``tune-<name>`` (made by :func:`set_concurrency_limit`) while it runs. The slot is a Prefect lease,
renewed by a thread of the holder every SLOT_HEARTBEAT_S together with a heartbeat record: the Prefect
variable ``ddiloco-slot-<lease id>``, tagged ``ddiloco-slot-holder:<limit>``, whose value (``lease_id``,
``limit``, ``beat``, ``host``, ``pid``) changes at every beat and is deleted on release. A waiter
releases the lease of any holder whose heartbeat has not changed for SLOT_STALE_S on its own clock.

**Why not Prefect's own leases alone** (prefect 3.9.1): the server refuses leases under 60 s
(``prefect/server/api/concurrency_limits_v2.py``) and its repossessor runs every 15 s
(``prefect/server/services/repossessor.py``), so a dead holder keeps a slot up to ~75 s;
``prefect.concurrency.sync.concurrency()`` takes 300 s leases (``prefect/concurrency/_leases.py``);
and no API route lists a limit's holders, so a waiter cannot tell a dead holder from a living one
through Prefect. The lease stays (the shortest the server takes): it is what the limit counts, and it
frees a dead holder's slot on its own when nobody waits.
"""

import contextlib
import logging
import os
import socket
import threading
import time
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.client.schemas.objects import Variable
from prefect.exceptions import ObjectNotFound

from run.control import STOP, stop_requested

__all__ = ["slot", "set_concurrency_limit", "SLOT_LEASE_S", "SLOT_HEARTBEAT_S", "SLOT_STALE_S"]

SLOT_LEASE_S = 60.0
"""Prefect's lease on a held slot [s]: the shortest its server accepts, renewed at every heartbeat."""
SLOT_HEARTBEAT_S = 5.0
"""A holder renews its lease and its heartbeat record this often [s]."""
SLOT_STALE_S = 30.0
"""A waiter takes a holder for dead once its heartbeat has not changed for this long [s] (on the
waiter's own clock: no clocks of two machines are compared)."""
_HOLDER_TAG = "ddiloco-slot-holder"


def set_concurrency_limit(name: str, limit: int) -> None:
    """Create the Prefect global concurrency limit ``name``, or set it to ``limit`` slots."""
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, limit)


def _heartbeats(client, limit: str) -> dict[str, object]:
    """Lease id -> latest heartbeat of every recorded holder of ``limit``."""
    tags = {"all_": [f"{_HOLDER_TAG}:{limit}"]}
    records = Variable.model_validate_list(
        client.request("POST", "/variables/filter", json={"variables": {"tags": tags}}).json()
    )
    return {
        r.value["lease_id"]: r.value.get("beat")
        for r in records
        if isinstance(r.value, dict) and r.value.get("limit") == limit and "lease_id" in r.value
    }


def _release(client, lease_id) -> None:
    client.release_concurrency_slots_with_lease(UUID(str(lease_id)))  # a no-op once released
    with contextlib.suppress(ObjectNotFound):  # another waiter was first
        client.delete_variable_by_name(f"ddiloco-slot-{lease_id}")


def _try_acquire(client, limit: str):
    """One slot of ``limit`` under a lease: its id, or None when every slot is taken (``ValueError``: no limit)."""
    try:
        response = client.increment_concurrency_slots_with_lease(
            names=[limit], slots=1, mode="concurrency", lease_duration=SLOT_LEASE_S
        )
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code == 423:  # locked: no free slot
            return None
        raise
    body = response.json()
    if not body.get("limits"):
        raise ValueError(f"the Prefect global concurrency limit {limit} does not exist (the sweep creates it)")
    return UUID(body["lease_id"])


def _heartbeat(lease_id, limit: str, beat: int) -> dict:
    return {"lease_id": str(lease_id), "limit": limit, "beat": beat, "host": socket.gethostname(), "pid": os.getpid()}


def _beat(lease_id, limit: str, every_s: float, stop: threading.Event) -> None:
    """Every ``every_s`` s until ``stop``: renew the lease and move the heartbeat on (a failure is logged)."""
    beat = 0
    with get_client(sync_client=True) as client:
        while not stop.wait(every_s):
            beat += 1
            try:
                client.renew_concurrency_lease(lease_id, SLOT_LEASE_S)
                client.update_variable(
                    VariableUpdate(name=f"ddiloco-slot-{lease_id}", value=_heartbeat(lease_id, limit, beat))
                )
            except Exception as exc:
                logging.getLogger(__name__).warning(
                    "sweep slot %s of %s: heartbeat %d failed (%s: %s)", lease_id, limit, beat, type(exc).__name__, exc
                )


@contextlib.contextmanager
def slot(limit: str, poll_s: float = 2.0):
    """Hold one slot of the global concurrency limit ``limit`` while the block runs (see the module);
    yields False (holding nothing) when a stop signal came while waiting (checked every ``poll_s`` s).
    Raises ``ValueError`` if the limit does not exist."""
    lease_id = None
    seen: dict[str, tuple[object, float]] = {}  # holder's lease id -> (heartbeat, when this waiter first saw it)
    with get_client(sync_client=True) as client:
        while not stop_requested():
            lease_id = _try_acquire(client, limit)
            if lease_id is not None:
                tags = [_HOLDER_TAG, f"{_HOLDER_TAG}:{limit}"]
                value = _heartbeat(lease_id, limit, 0)
                client.create_variable(VariableCreate(name=f"ddiloco-slot-{lease_id}", value=value, tags=tags))
                break
            now, beats = time.monotonic(), _heartbeats(client, limit)
            seen = {k: v for k, v in seen.items() if k in beats}
            for holder, beat in beats.items():  # a holder whose heartbeat stopped for SLOT_STALE_S is dead
                if holder not in seen or seen[holder][0] != beat:
                    seen[holder] = (beat, now)
                elif now - seen[holder][1] >= SLOT_STALE_S:
                    _release(client, holder)
                    del seen[holder]
            STOP.wait(poll_s)
    if lease_id is None:
        yield False
        return
    stop = threading.Event()
    beater = threading.Thread(
        target=_beat, args=(lease_id, limit, SLOT_HEARTBEAT_S, stop), daemon=True, name=f"sweep-slot-{lease_id}"
    )
    beater.start()
    try:
        yield True
    finally:
        stop.set()
        beater.join(timeout=30)
        with get_client(sync_client=True) as client:
            _release(client, lease_id)
