"""Hypothesis stateful testing of the real worker handlers (jaxserve/worker/main.py): a prefill and a decode
`Worker` with a tiny Llama, each behind its own gRPC server (the cluster token, the schemas), the decode one
known to the prefill one through a real router registry's peer table. Random sequences of: Generate (valid and
invalid), a Decode reservation, a Prefill into a reservation, a reservation abandoned before or after its
Prefill, a Prefill naming a destination it may not, Health. After every step, every answer was OK or a status
that names the caller's mistake or a refusal (INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED,
ABORTED); never INTERNAL, UNKNOWN or a hang. Every completed disaggregated request's tokens equal the same
request's Generate on the decode worker (greedy). At the end of each run: no reservation, block or pool byte
held on either worker."""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule, run_state_machine_as_test

from jaxserve.config import parse
from jaxserve.worker import rpc
from jaxserve.worker.main import Worker
from jaxserve.router.registry import Registry

pytestmark = pytest.mark.slow
TOKEN = "stateful-token"
ENGINE = dict(block_size=4, num_blocks=48, chunk_size=8, max_num_batched_tokens=16, max_prefill_seqs=2,
              max_num_seqs=4, num_snapshots=8, max_model_len=64, warmup=False)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
CALL_S = 60.0  # no call may take longer (a hang fails the test)
W: dict = {}  # the module's workers, loop and clients (set by the fixture)
SEEN: collections.Counter = collections.Counter()  # (call, status) over every run


@pytest.fixture(scope="module")
def workers(checkpoint_dir):
    cfg = parse({"model": {"path": checkpoint_dir("llama")}, "engine": ENGINE,
                 "transfer": {"token": TOKEN, "connections": 1, "deadline_s": 10.0, "shared_memory": False},
                 "clusters": [{"name": "pd", "instances": [{"name": "p0", "role": "prefill"},
                                                           {"name": "d0", "role": "decode"}]}]})
    loop = rpc.LoopThread("stateful")
    p0, d0 = Worker(cfg, cfg.instance("p0")), Worker(cfg, cfg.instance("d0"))
    servers = [loop.run(w.start(), 30) for w in (p0, d0)]
    registry = Registry({"p0": "prefill", "d0": "decode"}, 60.0)
    for w in (p0, d0):
        registry.register(w._describe(w.engine.stats()))
    p0.peers.table = registry.peers()  # what a heartbeat would bring
    clients = {w.inst.name: loop.run(_client(w.address), 10) for w in (p0, d0)}
    W.update(loop=loop, p0=p0, d0=d0, clients=clients, vocab=d0.llm.model_config.vocab_size)
    yield W
    for c in clients.values():
        loop.run(c.close(), 10)
    for s in servers:
        loop.run(s.stop(0), 10)
    for w in (p0, d0):
        w.close()
    loop.stop()


async def _client(address: str) -> rpc.Client:
    return rpc.Client(address, TOKEN)  # made on the loop thread, which its calls run on


def run(coro):
    return W["loop"].run(asyncio.wait_for(coro, CALL_S), CALL_S + 5)


async def _collect(call) -> tuple[grpc.StatusCode, list]:
    """A stream call's messages to its end (read(): a Decode stream's first message was read the same way)."""
    msgs = []
    try:
        while (m := await call.read()) is not grpc.aio.EOF:
            msgs.append(m)
    except grpc.aio.AioRpcError as e:
        return e.code(), msgs
    return grpc.StatusCode.OK, msgs


async def _stream(on: str, method: str, msg: dict) -> tuple[grpc.StatusCode, list]:
    """Call a stream method of worker `on` (the call is made here, on the loop thread) and collect it."""
    return await _collect(W["clients"][on].stream(method, msg))


GREEDY = {"temperature": 0.0, "ignore_eos": True}
prompts = st.lists(st.integers(1, 200), min_size=1, max_size=20)
bad_params = st.sampled_from([{"top_p": 0.0}, {"max_tokens": 10_000}, {"repetition_penalty": -1.0},
                              {"n": 2}, {"logprobs": 99}])


class WorkerMachine(RuleBasedStateMachine):
    reservations = Bundle("reservations")

    def __init__(self):
        super().__init__()
        self.n = 0
        self.codes: list[tuple[str, grpc.StatusCode]] = []
        self.open: dict[str, dict] = {}  # rid -> {"call", "reserved", "prompt", "params"}
        self.refs: dict[tuple, list[int]] = {}

    def _rid(self) -> str:
        self.n += 1
        return f"s{id(self) % 10**6}-{self.n}"

    def _note(self, what: str, code: grpc.StatusCode) -> grpc.StatusCode:
        self.codes.append((what, code))
        SEEN[what, code.name] += 1
        return code

    def _reference(self, prompt: list[int], max_tokens: int) -> list[int] | None:
        key = (tuple(prompt), max_tokens)
        if key not in self.refs:
            code, msgs = run(_stream("d0", "Generate", {
                "request_id": self._rid(), "prompt": prompt, "params": {**GREEDY, "max_tokens": max_tokens}}))
            if self._note("Generate(reference)", code) is not grpc.StatusCode.OK:
                return None
            self.refs[key] = msgs[-1]["update"]["token_ids"]
        return self.refs[key]

    @rule(prompt=prompts, max_tokens=st.integers(1, 6), bad=st.none() | bad_params,
          on=st.sampled_from(["p0", "d0"]))
    def generate(self, prompt, max_tokens, bad, on):
        params = {**GREEDY, "max_tokens": max_tokens, **(bad or {})}
        code, msgs = run(_stream(on, "Generate", {"request_id": self._rid(), "prompt": prompt, "params": params}))
        self._note("Generate", code)
        if bad is not None:
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (bad, code)
        elif code is grpc.StatusCode.OK:
            u = msgs[-1]["update"]
            assert u["finished"] and len(u["token_ids"]) == max_tokens and not u["error"]

    @rule(target=reservations, prompt=prompts, max_tokens=st.integers(1, 6))
    def reserve(self, prompt, max_tokens):
        rid = self._rid()
        params = {**GREEDY, "max_tokens": max_tokens}

        async def go():
            call = W["clients"]["d0"].stream("Decode", {"request_id": rid, "prompt": prompt, "params": params,
                                                       "kv_tokens": len(prompt), "deadline_s": 10.0})
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as e:
                return e.code(), None
            return grpc.StatusCode.OK, (call, first["reserved"])
        code, got = run(go())
        self._note("Decode", code)
        if got is None:
            return rid  # refused (no room): later rules on it find nothing open
        self.open[rid] = {"call": got[0], "reserved": got[1], "prompt": prompt, "params": params}
        return rid

    def _prefill(self, rid: str, entry: dict, dst: dict | None = None) -> grpc.StatusCode:
        msg = {"request_id": rid, "prompt": entry["prompt"], "params": entry["params"],
               "kv_tokens": len(entry["prompt"]), "dst": dst or {"instance": "d0", **entry["reserved"]}}
        code, _ = run(_stream("p0", "Prefill", msg))
        return self._note("Prefill", code)

    @rule(rid=consumes(reservations))
    def prefill(self, rid):
        entry = self.open.pop(rid, None)
        if entry is None:
            return
        code = self._prefill(rid, entry)
        dcode, msgs = run(_collect(entry["call"]))
        self._note("Decode(stream)", dcode)
        if code is grpc.StatusCode.OK and dcode is grpc.StatusCode.OK:
            want = self._reference(entry["prompt"], entry["params"]["max_tokens"])
            assert want is None or msgs[-1]["update"]["token_ids"] == want

    @rule(rid=consumes(reservations), after_prefill=st.booleans())
    def abandon(self, rid, after_prefill):
        entry = self.open.pop(rid, None)
        if entry is None:
            return
        if not after_prefill:
            run(self._cancel(entry["call"]))
        self._prefill(rid, entry)  # into a reservation that is gone: refused (ABORTED), or it raced ahead
        if after_prefill:
            run(self._cancel(entry["call"]))

    @staticmethod
    async def _cancel(call) -> None:
        call.cancel()

    @rule(rid=reservations, dst=st.sampled_from([{"instance": "nowhere"}, {"instance": "p0"},
                                                 {"blocks": []}, {"skip": 99}, {"shm_base": 3}]))
    def forged_prefill(self, rid, dst):
        entry = self.open.get(rid)
        if entry is None:
            return
        reserved = {"instance": "d0", **entry["reserved"], **dst}
        code = self._prefill(rid, entry, reserved)  # refused before any work: the reservation stays usable
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (dst, code)

    @rule(on=st.sampled_from(["p0", "d0"]))
    def health(self, on):
        ans = run(W["clients"][on].call("Health", {}))
        assert ans["name"] == on and ans["stats"]["blocks_used"] >= 0

    @invariant()
    def only_expected_codes(self):
        bad = [(w, c) for w, c in self.codes if c not in ALLOWED]
        assert not bad, bad

    def teardown(self):
        for entry in self.open.values():
            run(self._cancel(entry["call"]))
        self.open.clear()
        deadline = time.monotonic() + 30
        while True:
            d = run(W["clients"]["d0"].call("Health", {}))["stats"]
            p = run(W["clients"]["p0"].call("Health", {}))["stats"]
            held = {"d0 blocks": d["blocks_used"], "d0 reservations": d["reservations"],
                    "d0 pool bytes": d["pool_used_bytes"], "d0 running": d["running"],
                    "p0 blocks": p["blocks_used"], "p0 running": p["running"]}
            if not any(held.values()):
                break
            assert time.monotonic() < deadline, f"still held after the run: {held}"
            time.sleep(0.05)


def test_random_call_sequences_on_real_workers(workers):
    run_state_machine_as_test(WorkerMachine, settings=settings(
        max_examples=20, stateful_step_count=15, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck)))
    print("calls and answers:", dict(sorted(SEEN.items())))
    # the runs reached every outcome: completed disaggregated requests, refusals of bad input, refused transfers
    assert SEEN["Prefill", "OK"] and SEEN["Decode(stream)", "OK"] and SEEN["Generate", "OK"]
    assert SEEN["Generate", "INVALID_ARGUMENT"] and SEEN["Prefill", "INVALID_ARGUMENT"]
