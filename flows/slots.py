"""One slot of a Prefect global concurrency limit, held by a process that may die: ``with slot(limit):``.

A sweep cell and a tuning trial (``flows.sweep.sweep_cell``) run inside ``with slot(limit) as held``
(the limit ``sweep-<name>`` or ``tune-<name>``, created or resized by :func:`set_concurrency_limit`),
so that runs of one name share its slots wherever they run. The slot is a Prefect lease, renewed by
a thread of the holder every SLOT_HEARTBEAT_S together with a heartbeat record: the Prefect variable
``ddiloco-slot-<lease id>``, tagged ``ddiloco-slot-holder:<limit>``, whose value (``lease_id``,
``limit``, ``beat``, ``host``, ``pid``) changes at every beat and is deleted on release. A process
waiting for a slot releases the lease of any holder whose heartbeat has not changed for
SLOT_STALE_S on the waiter's own clock (a process killed, a machine gone): a dead holder's slot comes
back within about half a minute, on a persistent server too.

**Why not Prefect's own leases alone** (read in the installed prefect 3.9.1): the server refuses a
lease shorter than 60 s (``lease_duration: Body(300, ge=60, le=86400)`` in
``prefect/server/api/concurrency_limits_v2.py``, for taking and renewing one); its repossessor
revokes expired leases every ``PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS`` (15;
``prefect/server/services/repossessor.py``), so a dead holder keeps even the shortest lease's slot up
to about 75 s; ``prefect.concurrency.sync.concurrency()`` takes 300 s leases renewed at 0.75 × their
duration (``prefect/concurrency/_leases.py``): minutes; and no API route lists a limit's leases or
holders (the server releases on its own only the tag-limit leases of a task run leaving Running,
``ReleaseTaskConcurrencySlots`` in ``prefect/server/orchestration/core_policy.py``, which a killed
process's run never does), so a waiter cannot tell a dead holder from a living one through Prefect:
hence the heartbeat records.

The lease itself stays (the shortest the server takes, renewed at each beat): it frees a dead
holder's slot on its own when nobody waits, and it is what the limit counts.
"""

import contextlib
import os
import socket
import threading
import time

from run.control import stop_requested

__all__ = ["slot", "set_concurrency_limit", "SLOT_LEASE_S", "SLOT_HEARTBEAT_S", "SLOT_STALE_S"]


def set_concurrency_limit(name: str, limit: int) -> None:
    """Create the Prefect global concurrency limit ``name``, or set it to ``limit`` slots."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, limit)


SLOT_LEASE_S = 60.0
"""Prefect's lease on a held slot [s]: the shortest its server accepts. It is renewed at every
heartbeat; it frees a dead holder's slot on its own (within about 75 s) when no cell waits."""
SLOT_HEARTBEAT_S = 5.0
"""A holder renews its lease and its heartbeat record this often [s]."""
SLOT_STALE_S = 30.0
"""A waiting cell takes a holder for dead once its heartbeat has not changed for this long [s] (on
the waiter's own clock: no clocks of two machines are compared). So a slot whose holder died comes
back within SLOT_STALE_S plus the wait's poll interval (2 s) while a cell waits for it."""
_HOLDER_TAG = "ddiloco-slot-holder"


def _holder_record(lease_id) -> str:
    """The Prefect variable that carries the heartbeat of the holder of lease ``lease_id``."""
    return f"ddiloco-slot-{lease_id}"


def _heartbeats(client, limit: str) -> dict[str, object]:
    """Lease id -> latest heartbeat of every recorded holder of ``limit`` (the Prefect variables tagged
    ``ddiloco-slot-holder:<limit>``)."""
    from prefect.client.schemas.objects import Variable

    response = client.request(
        "POST", "/variables/filter", json={"variables": {"tags": {"all_": [f"{_HOLDER_TAG}:{limit}"]}}}
    )
    records = Variable.model_validate_list(response.json())
    return {
        r.value["lease_id"]: r.value.get("beat")
        for r in records
        if isinstance(r.value, dict) and r.value.get("limit") == limit and "lease_id" in r.value
    }


class _HolderWatch:
    """What a cell waiting for a slot of ``limit`` has seen of the holders' heartbeats: a holder
    whose heartbeat has not changed for ``stale_s`` seconds of this process's clock is dead; its
    lease is released (its slot comes back) and its record deleted."""

    def __init__(self, limit: str, stale_s: float) -> None:
        self.limit, self.stale_s = limit, stale_s
        self.seen: dict[str, tuple[object, float]] = {}  # lease id -> (heartbeat, when it was first seen)

    def reap(self, client) -> list[str]:
        """Release the leases of the holders found dead; returns their lease ids."""
        from uuid import UUID

        from prefect.exceptions import ObjectNotFound

        now = time.monotonic()
        beats = _heartbeats(client, self.limit)
        self.seen = {k: v for k, v in self.seen.items() if k in beats}
        dead = []
        for lease_id, beat in beats.items():
            last = self.seen.get(lease_id)
            if last is None or last[0] != beat:
                self.seen[lease_id] = (beat, now)
            elif now - last[1] >= self.stale_s:
                client.release_concurrency_slots_with_lease(UUID(lease_id))  # a no-op once released
                with contextlib.suppress(ObjectNotFound):  # another waiter was first
                    client.delete_variable_by_name(_holder_record(lease_id))
                del self.seen[lease_id]
                dead.append(lease_id)
        return dead


def _try_acquire(client, limit: str):
    """One slot of ``limit`` under a lease of SLOT_LEASE_S; returns the lease id, or None when every
    slot is taken. Raises ``ValueError`` when the limit does not exist."""
    from uuid import UUID

    import httpx

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


def _beat(lease_id, limit: str, every_s: float, stop: threading.Event) -> None:
    """Every ``every_s`` seconds until ``stop``: renew the lease and move the heartbeat record on. A
    failure is logged and retried at the next beat (the cell goes on; if its lease was taken for dead
    meanwhile, the limit may briefly admit one cell more)."""
    import logging

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableUpdate

    log = logging.getLogger(__name__)
    beat = 0
    with get_client(sync_client=True) as client:
        while not stop.wait(every_s):
            beat += 1
            try:
                client.renew_concurrency_lease(lease_id, SLOT_LEASE_S)
                client.update_variable(
                    VariableUpdate(name=_holder_record(lease_id), value=_heartbeat(lease_id, limit, beat))
                )
            except Exception as exc:
                log.warning(
                    "sweep slot %s of %s: heartbeat %d failed (%s: %s)", lease_id, limit, beat, type(exc).__name__, exc
                )


def _heartbeat(lease_id, limit: str, beat: int) -> dict:
    return {"lease_id": str(lease_id), "limit": limit, "beat": beat, "host": socket.gethostname(), "pid": os.getpid()}


@contextlib.contextmanager
def slot(limit: str, poll_s: float = 2.0):
    """Hold one slot of the global concurrency limit ``limit`` while the block runs; yields False
    (holding nothing) when a stop signal came while waiting for it (checked every ``poll_s`` s).

    The slot is a Prefect lease of SLOT_LEASE_S, renewed every SLOT_HEARTBEAT_S together with a
    heartbeat record (a Prefect variable tagged ``ddiloco-slot-holder:<limit>``). While it waits, a
    cell releases the slots of holders whose heartbeat has stopped for SLOT_STALE_S (a process
    killed, a machine gone), so a dead cell's slot comes back well within a minute, on a
    persistent server too. Raises ``ValueError`` if the limit does not exist.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate
    from prefect.exceptions import ObjectNotFound

    from run.control import STOP

    lease_id = None
    watch = _HolderWatch(limit, SLOT_STALE_S)
    with get_client(sync_client=True) as client:
        while not stop_requested():
            lease_id = _try_acquire(client, limit)
            if lease_id is not None:
                client.create_variable(
                    VariableCreate(
                        name=_holder_record(lease_id),
                        value=_heartbeat(lease_id, limit, 0),
                        tags=[_HOLDER_TAG, f"{_HOLDER_TAG}:{limit}"],
                    )
                )
                break
            watch.reap(client)
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
            client.release_concurrency_slots_with_lease(lease_id)
            with contextlib.suppress(ObjectNotFound):
                client.delete_variable_by_name(_holder_record(lease_id))
