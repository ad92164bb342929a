"""The simulator's clock and instance models, built from profiles (router/planner.py `Profile`).

- `Clock`: a heap of timed callbacks (the simulator's only scheduler; a plain heap rather than SimPy: an
  event here is one tuple and one call, where a SimPy process pays for a generator and its events, and the
  10,000-accelerator run is millions of events).
- `Prefill`: a FIFO queue served in steps; a step takes the request at the head and, while they fit in
  `chunk_tokens` together, the ones behind it (chunked batching of short prompts); a step of n tokens takes
  the profile's prefill time for n. Only uncached tokens are computed. `queued_tokens` counts a request's
  tokens until its prefill has ended, as the live router's meter does.
- `Decode`: `max_batch` slots; a request holds one for output_tokens x the profile's step time (the SLO-governed
  constants of the throughput model); when every slot is taken requests wait in order. A prefill the decode
  instance runs itself (the colocated route) queues on its own `local` prefill queue and stalls its decoding
  while it computes: a running request finishes when its decode time has passed outside the stalls.
  Instances that share a core (`peers`) share it: a prefill step takes its profile time x (1 + the peers
  computing when it starts), and a decode instance decodes at half speed while a peer's prefill step runs.
- `Link`: a FIFO pipe of a given bandwidth (changed on a schedule, scaled per transfer by a random
  fluctuation) and latency; it reports recent throughput, bytes in flight and queued, as the live links do.
- `PrefixCache`: per instance, the tokens of each conversation whose KV it holds, LRU-evicted to a capacity.
Single-threaded: everything runs inside Clock callbacks.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque


class Clock:
    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)
        self.now = until


class PrefixCache:
    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.used = 0
        self._held: OrderedDict[object, int] = OrderedDict()  # conversation -> tokens, least recent first

    def get(self, conv) -> int:
        n = self._held.get(conv, 0)
        if n:
            self._held.move_to_end(conv)
        return n

    def held(self, conv) -> int:
        """What get() answers, without counting as a use (the policy looking is not a hit)."""
        return self._held.get(conv, 0)

    def put(self, conv, tokens: int) -> None:
        self.used += tokens - self._held.pop(conv, 0)
        self._held[conv] = tokens
        while self.used > self.capacity and self._held:
            _, n = self._held.popitem(last=False)
            self.used -= n


class _Job:
    __slots__ = ("tokens", "on_start", "on_done", "fetch_s", "cached", "done")

    def __init__(self, tokens, on_start, on_done, fetch_s, cached):
        self.tokens, self.on_start, self.on_done, self.fetch_s, self.cached = tokens, on_start, on_done, fetch_s, cached
        self.done = 0  # tokens computed so far (chunked prefill)


class Prefill:
    """A prefill queue served in steps. chunk_size None: whole prompts, as many as fit in chunk_tokens (one
    at least). chunk_size set: the live scheduler's chunked prefill (engine/scheduler.py): each step takes up to
    chunk_size tokens of each queued request, partly prefilled ones first, at most max_seqs requests and
    chunk_tokens tokens in all; a request's first token comes at the end of the step with its last chunk. A
    step of chunks k_i, each after d_i tokens already computed, takes F(sum k_i) + sum (F(d_i + k_i) - F(d_i) -
    F(k_i)) for the d_i > 0, F the profile's prefill time: the batch's tokens as one prompt, plus what a
    continued chunk's attention over its request's earlier tokens adds (the chunks of one prompt alone sum to
    F of the whole prompt)."""
    BUCKET_S = 10.0

    def __init__(self, clock: Clock, name: str, cluster: str, kind: str, profile, chunk_tokens: int,
                 cache_tokens: int, chunk_size: int | None = None, max_seqs: int | None = None):
        self.clock, self.name, self.cluster, self.kind, self.profile = clock, name, cluster, kind, profile
        self.chunk_tokens, self.chunk_size, self.max_seqs = chunk_tokens, chunk_size, max_seqs
        self.cache = PrefixCache(cache_tokens)
        self.queue: deque = deque()  # _Job, waiting, in arrival order
        self.partial: list = []  # _Job, started and not finished (chunked prefill)
        self.queued_tokens = 0
        self.busy = False
        self.inflight = 0  # placed here and not finished (the router's count)
        self.busy_s = 0.0
        self.tokens_done = 0
        self.busy_by: dict[int, float] | None = None  # busy seconds per BUCKET_S of time, when tracked
        self.peers: list = []  # instances sharing its core (Deployment.shared_cores): processor sharing
        self.layers = 32  # the pipeline's stages (store fetches overlap compute layer by layer)
        self.on_step = None  # called with each step's duration as it starts (a decode instance's stall)

    @property
    def rate(self) -> float | None:
        return self.tokens_done / self.busy_s if self.busy_s > 0 else None

    def submit(self, tokens: int, on_start, on_done, fetch_s: float = 0.0, cached: int = 0) -> None:
        """tokens: the uncached tokens it computes; cached: the prefix before them it reads from the cache (the
        profile's prefix_seconds: attention over it); fetch_s: time to load this request's cached prefix from
        the global KV store, overlapped with the step's compute layer by layer (BanaServe's three-stage
        pipeline): a step takes max(compute, fetch) plus one layer's share of the fetch."""
        self.queue.append(_Job(max(1, tokens), on_start, on_done, fetch_s, cached))
        self.queued_tokens += max(1, tokens)
        if not self.busy:
            self._step()

    def _plan(self) -> list:
        """This step's [(job, tokens)] (see the class docstring)."""
        if self.chunk_size is None:
            first = self.queue.popleft()
            batch, total = [(first, first.tokens)], first.tokens
            while self.queue and total + self.queue[0].tokens <= self.chunk_tokens:
                batch.append((self.queue[0], self.queue[0].tokens))
                total += self.queue.popleft().tokens
            return batch
        batch, budget = [], self.chunk_tokens
        while budget > 0 and not (self.max_seqs and len(batch) >= self.max_seqs):
            if len(batch) < len(self.partial):
                j = self.partial[len(batch)]
            elif self.queue:
                j = self.queue.popleft()
                self.partial.append(j)
            else:
                break
            k = min(j.tokens - j.done, self.chunk_size, budget)
            batch.append((j, k))
            budget -= k
        return batch

    def _step(self) -> None:
        if not self.queue and not self.partial:
            self.busy = False
            return
        self.busy = True
        batch = self._plan()
        F, total = self.profile.prefill_seconds, sum(k for _, k in batch)
        dt = F(total) + sum(max(0.0, F(j.done + k) - F(j.done) - F(k)) for j, k in batch if j.done)
        dt += sum(self.profile.prefix_seconds(j.cached) * k / j.tokens for j, k in batch)
        dt *= 1 + sum(p.computing for p in self.peers)
        fetch = sum(j.fetch_s for j, _ in batch if not j.done)
        dt = max(dt, fetch) + fetch / max(1, self.layers)
        for p in self.peers:
            p.shared(dt)
        if self.on_step is not None:
            self.on_step(dt)
        if self.busy_by is not None:
            t, end = self.clock.now, self.clock.now + dt
            while t < end:
                k = int(t // self.BUCKET_S)
                nxt = min(end, (k + 1) * self.BUCKET_S)
                self.busy_by[k] = self.busy_by.get(k, 0.0) + nxt - t
                t = nxt
        for j, _ in batch:
            if not j.done:
                j.on_start(dt)
        self.busy_s += dt
        self.tokens_done += total
        self.clock.after(dt, self._done, batch)

    @property
    def computing(self) -> bool:
        return self.busy

    def shared(self, dt: float) -> None:
        """A peer on its core computes for dt (its steps already count this one's): nothing to do here."""

    def _done(self, batch) -> None:
        for j, k in batch:
            j.done += k
            if j.done >= j.tokens:
                if self.chunk_size is not None:
                    self.partial.remove(j)
                self.queued_tokens -= j.tokens  # as the live router counts them: until the prefill has ended
                j.on_done()
        self._step()


class Decode:
    def __init__(self, clock: Clock, name: str, cluster: str, kind: str, profile, cache_tokens: int,
                 chunk_tokens: int = 8192, chunk_size: int | None = None, max_seqs: int | None = None):
        self.clock, self.name, self.cluster, self.kind, self.profile = clock, name, cluster, kind, profile
        self.slots, self.step_s = int(profile.max_batch), profile.step_seconds
        self.cache = PrefixCache(cache_tokens)
        self.active = 0
        self.queue: deque = deque()  # (output_tokens, on_done)
        self.inflight = 0
        self.local = Prefill(clock, name, cluster, kind, profile, chunk_tokens, 0, chunk_size, max_seqs)  # its own
        self.local.on_step = self._stall
        self._stalled = 0.0  # seconds of stalls that have ended, or begun (counted up to stall_end)
        self._stall_end = 0.0

    def _virtual(self) -> float:
        """Decode time so far: the clock less the stalls (the one under way counted up to now)."""
        now = self.clock.now
        return now - self._stalled + max(0.0, self._stall_end - now)

    def _stall(self, dt: float) -> None:
        self._stalled += dt
        self._stall_end = max(self._stall_end, self.clock.now) + dt

    @property
    def computing(self) -> bool:
        return self.active > 0 or self.local.busy

    def shared(self, dt: float) -> None:
        """A peer on its core computes for dt: its decoding runs at half speed meanwhile (counted as a stall
        of dt / 2: the same progress by the end of it)."""
        if self.active:
            self._stall(dt / 2)

    def admit(self, output_tokens: int, on_done) -> None:
        if self.active < self.slots:
            self.active += 1
            self._wait(self._virtual() + output_tokens * self.step_s, on_done)
        else:
            self.queue.append((output_tokens, on_done))

    def _wait(self, target: float, on_done) -> None:
        left = target - self._virtual()
        if left > 1e-12:
            self.clock.after(left, self._wait, target, on_done)  # a stall since: later
        else:
            self._finish(on_done)

    def _finish(self, on_done) -> None:
        self.active -= 1
        on_done()
        if self.queue:
            self.admit(*self.queue.popleft())


class Link:
    WINDOW_S = 2.0  # recent throughput is taken over this long, as the live links report it

    def __init__(self, clock: Clock, src: str, dst: str, gbps: float, latency_s: float, fluctuation: float, rng):
        self.clock, self.src, self.dst = clock, src, dst
        self.gbps, self.latency_s, self.fluctuation, self.rng = gbps, latency_s, fluctuation, rng
        self.free_at = 0.0
        self.pending_bytes = 0
        self.queued_bytes = 0
        self.bytes_sent = 0
        self._recent: deque = deque()  # (end time, bytes)

    def set_gbps(self, gbps: float) -> None:
        self.gbps = gbps

    @property
    def capacity_bytes_s(self) -> float:
        return self.gbps * 1e9 / 8

    def egress_bytes_s(self) -> float:
        now = self.clock.now
        while self._recent and self._recent[0][0] < now - self.WINDOW_S:
            self._recent.popleft()
        return sum(b for t, b in self._recent if t <= now) / self.WINDOW_S

    def send(self, nbytes: int, on_done) -> None:
        """Queue `nbytes` now; on_done() once they have crossed (FIFO behind what is queued)."""
        now = self.clock.now
        rate = self.capacity_bytes_s * max(0.05, 1.0 + self.fluctuation * self.rng.standard_normal())
        start = max(now, self.free_at)
        self.free_at = start + nbytes / rate
        self.pending_bytes += nbytes
        if start > now:
            self.queued_bytes += nbytes
            self.clock.at(start, self._started, nbytes)
        self._recent.append((self.free_at, nbytes))
        self.clock.at(self.free_at + self.latency_s, self._arrived, nbytes, on_done)

    def _started(self, nbytes: int) -> None:
        self.queued_bytes -= nbytes

    def _arrived(self, nbytes: int, on_done) -> None:
        self.pending_bytes -= nbytes
        self.bytes_sent += nbytes
        on_done()
