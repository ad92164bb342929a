"""A decode step as two programs, for rows whose next-token bitmasks are known only once the step before it is
read (a constrained request stepping ahead, engine/overlap.py): the model (`forward`), dispatched before the step
in flight is read, and the LM head and sampling (`pick`), dispatched once the host has read that step, advanced
the rows' grammars and filled their masks. The device runs the model while the host does that work.

The pair of programs of a shape compiles behind the engine, on a thread of its own, the first time a step of
that shape asks for it: until then `programs` answers None and the engine dispatches the one-program step after
the read instead (and for good where its compile failed). Warm-up compiles nothing more for it, and no step
waits for a compile. `pick` is keyed by the rows alone (a forward program hands it only the rows' sampling
columns) and the sampler's mode (sampler.py `sample`), so one compiles per row bucket and mode, and a forward
program per decode shape. On a CPU none of this runs (runner.split_steps): the host and the
programs share the cores there, and the whole step after the read is as fast.

Concurrency: the engine thread calls `programs` and `wait`; one compile thread lowers and compiles. Each shape's
result passes between them in a Future, taken on the engine thread; the compiled forwards by shape and picks by
row count and mode are the compile thread's alone.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import jax

log = logging.getLogger(__name__)


def spec(a, sharding=None):
    """What a program is compiled for in place of `a` (an array or a pytree of them): shapes, dtypes, shardings
    (`sharding` for a host array)."""
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding or v.sharding), a)


@dataclass(frozen=True)
class Pair:
    """The compiled programs of one decode shape."""
    forward: object  # (params, pool, last, x) -> (pool, hidden states [B, 1, H], sampling columns [B, COLS])
    pick: object  # (params, h, prompt_mask, out_counts, last, x, allowed) -> (out_counts, last, packed sample)


@dataclass(frozen=True)
class Forward:
    """A forward program dispatched, its sampling not yet."""
    rows: int  # B, the program's rows
    h: jax.Array  # [B, 1, H]
    x: jax.Array  # [B, COLS] the rows' slots and sampling
    pick: object  # the compiled sampler for B rows


class SplitStep:
    def __init__(self, forward, pick):
        """forward, pick: the runner's jitted programs (their donation and compiler options go with them)."""
        self._fwd, self._pick = forward, pick
        self._ready: dict[tuple, Pair] = {}
        self._pending: dict[tuple, Future] = {}
        self._forwards: dict[tuple, object] = {}  # (B, W, M) -> compiled forward (the compile thread's)
        self._picks: dict[tuple, object] = {}  # (rows, mode) -> compiled pick (the compile thread's)
        self._failed: set[tuple] = set()  # shapes whose compile failed: their steps run whole
        self._jobs: queue.SimpleQueue | None = None  # (future, arguments) for the compile thread

    def programs(self, key: tuple, specs: Callable[[], tuple]) -> Pair | None:
        """The compiled pair for decode shape and sampler mode `key` ((B, W, M, mode): mode as `sample` takes
        it), or None while it compiles; the first call for a
        key starts its compile with specs() -> (forward's argument specs, its static total_blocks, pick's
        argument specs after h and x: prompt_mask, out_counts, last, allowed). A compile that fails is logged
        once it is known, and the shape's steps run whole from then on. The specs are taken on the engine thread
        (`spec`), never the arrays."""
        pair = self._ready.get(key)
        if pair is not None or key in self._failed:
            return pair
        f = self._pending.get(key)
        if f is None:
            if self._jobs is None:
                self._start()
            f = self._pending[key] = Future()
            self._jobs.put((f, (key, *specs())))
            return None
        if not f.done():
            return None
        del self._pending[key]
        try:
            pair = self._ready[key] = f.result()
        except Exception as e:  # noqa: BLE001 - the one-program step still serves the shape
            log.warning("decode shape %s: its split programs did not compile (%s: %s); its constrained steps run "
                        "as one program", key, type(e).__name__, e)
            self._failed.add(key)
            return None
        return pair

    def wait(self) -> None:
        """Until every compile started has ended (tests)."""
        for f in list(self._pending.values()):
            f.exception()

    def _start(self) -> None:
        """The compile thread: a daemon, so a process that exits waits for no queued compile; at exit the queue is
        dropped and the compile under way (in XLA, outside Python) allowed to end first."""
        self._jobs = jobs = queue.SimpleQueue()
        thread = threading.Thread(target=self._run, args=(jobs,), name="split-compile", daemon=True)
        thread.start()

        def stop():
            while True:
                try:
                    jobs.get_nowait()[0].cancel()
                except queue.Empty:
                    break
            jobs.put(None)
            thread.join(timeout=120)
        atexit.register(stop)

    def _run(self, jobs: queue.SimpleQueue) -> None:
        while True:
            item = jobs.get()
            if item is None:
                return
            f, args = item
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(self._compile(*args))
            except BaseException as e:  # taken on the engine thread by `programs`
                f.set_exception(e)

    def _compile(self, key: tuple, fwd_args: tuple, total_blocks, pick_args: tuple) -> Pair:
        B, mode = key[0], key[3]
        if key[:3] not in self._forwards:
            self._forwards[key[:3]] = self._fwd.lower(*fwd_args, total_blocks=total_blocks).compile()
        fwd = self._forwards[key[:3]]
        if (B, mode) not in self._picks:
            params = fwd_args[0]
            _, h, x = fwd.out_info
            pm, counts, last, allowed = pick_args
            self._picks[B, mode] = self._pick.lower(params, h, pm, counts, last, x, allowed, mode=mode).compile()
        return Pair(fwd, self._picks[B, mode])
