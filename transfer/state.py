"""The transfer state machine shared by `KVSender` and `KVReceiver` (sglang-jax's KVPoll, with checked moves).

    INIT -> TRANSFERRING -> DONE
      \\          \\
       +-> FAILED  +-> FAILED

A sender enters TRANSFERRING when it starts sending, a receiver when its plan is accepted; DONE when every
expected byte (and the first-token record) has been confirmed; FAILED on a rejected plan, a dead peer, a
deadline, or too many corrupt resends. DONE and FAILED are final. Any other move raises `IllegalTransition`,
so a bug that would e.g. admit a request twice or revive a failed transfer is caught where it happens.
Thread-safe: transitions happen under a lock and waiters are woken on every change; an asyncio caller awaits
the final state with `wait_async`, which holds no thread while it waits.
"""

from __future__ import annotations

import asyncio
import enum
import threading


class KVPoll(enum.Enum):
    INIT = "init"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


LEGAL: dict[KVPoll, frozenset[KVPoll]] = {
    KVPoll.INIT: frozenset({KVPoll.TRANSFERRING, KVPoll.FAILED}),
    KVPoll.TRANSFERRING: frozenset({KVPoll.DONE, KVPoll.FAILED}),
    KVPoll.DONE: frozenset(),
    KVPoll.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


class TransferState:
    def __init__(self, name: str):
        self.name = name
        self.state = KVPoll.INIT
        self.reason: str | None = None  # why it failed
        self._cond = threading.Condition()
        self._on_final: list = []  # callbacks run once when DONE or FAILED is reached

    def advance(self, new: KVPoll, reason: str | None = None) -> None:
        with self._cond:
            if new not in LEGAL[self.state]:
                raise IllegalTransition(f"{self.name}: {self.state.value} -> {new.value} is not a legal transition")
            self.state = new
            if reason is not None:
                self.reason = reason
            self._cond.notify_all()
            callbacks, self._on_final = (self._on_final, []) if self.final else ([], self._on_final)
        for fn in callbacks:
            fn()

    def fail(self, reason: str) -> bool:
        """Move to FAILED unless already final; True if this call failed it."""
        with self._cond:
            if self.state in (KVPoll.DONE, KVPoll.FAILED):
                return False
            self.advance(KVPoll.FAILED, reason)
            return True

    @property
    def final(self) -> bool:
        return self.state in (KVPoll.DONE, KVPoll.FAILED)

    def wait(self, timeout: float | None = None) -> KVPoll:
        """Block until DONE or FAILED (or the timeout); returns the state."""
        with self._cond:
            self._cond.wait_for(lambda: self.final, timeout)
            return self.state

    def on_final(self, fn) -> None:
        """Call fn() (from the thread that makes the move, or now) once the state is DONE or FAILED."""
        with self._cond:
            if not self.final:
                self._on_final.append(fn)
                return
        fn()

    async def wait_async(self, timeout: float | None = None) -> KVPoll:
        """`wait` for an asyncio caller."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake():
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
            except RuntimeError:  # the waiter's loop is gone
                pass
        self.on_final(wake)
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except asyncio.TimeoutError:
            pass
        return self.state

    def poll(self) -> KVPoll:
        return self.state
