"""The HTTP app's waits on a request's queue (server/streaming.py `stream`, server/api.py `collect`) against a
scripted queue, no engine: a client behind gets the latest update's additions in one chunk; at the deadline the
stream ends with a 408 event and the request is aborted; a request waiting for its final update is abandoned when
its client goes or its deadline passes, and in between takes running updates at a queue's cost."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from jaxserve.engine.client import Update
from jaxserve.server import api as api_module
from jaxserve.server.protocol import APIError, CompletionRequest
from jaxserve.server.streaming import stream


def update(ids: list[int], finished=False, error=None) -> Update:
    return Update(0, ids, "".join(chr(97 + t) for t in ids), finished, "length" if finished else None,
                  [(-0.5, [])] * len(ids), 0, 3, error=error)


def fake_api(timeout_s: float):
    aborted = []
    def decode(ids, skip_special_tokens):
        return "".join(chr(97 + t) for t in ids)
    api = SimpleNamespace(srv=SimpleNamespace(request_timeout_s=timeout_s), model_name="m",
                          tok=SimpleNamespace(decode=decode),
                          meta=lambda us: {"n": len(us)}, usage=lambda us: {}, engine=SimpleNamespace(
                              abort=aborted.append))
    return api, aborted


async def events(gen) -> list:
    out = []
    async for chunk in gen:
        assert chunk.startswith("data: ") and chunk.endswith("\n\n")
        out.append(chunk[6:-2])
    assert out[-1] == "[DONE]"
    return [json.loads(e) for e in out[:-1]]


def test_a_client_behind_gets_the_latest_updates_additions_in_one_chunk():
    async def go():
        api, aborted = fake_api(60)
        q = asyncio.Queue()
        for u in (update([0]), update([0, 1]), update([0, 1, 2])):
            q.put_nowait(u)
        body = CompletionRequest(model="m", prompt="x", stream=True, logprobs=0)
        gen = stream(api, "r", q, False, body, [1])
        first = json.loads((await gen.__anext__())[6:])  # three running updates were waiting: one chunk
        assert first["choices"][0]["text"] == "abc" and len(first["choices"][0]["logprobs"]["token_logprobs"]) == 3
        q.put_nowait(update([0, 1, 2, 3]))
        q.put_nowait(update([0, 1, 2, 3, 4], finished=True))  # a running one and the final one: the final's
        got = await events(gen)
        assert [e["choices"][0]["text"] for e in got] == ["de"] and got[0]["choices"][0]["finish_reason"] == "length"
        assert len(got[0]["choices"][0]["logprobs"]["token_logprobs"]) == 2 and aborted == ["r"]
    asyncio.run(go())


def test_at_its_deadline_a_stream_ends_with_a_timeout_event_and_the_request_is_aborted():
    async def go():
        api, aborted = fake_api(0.2)
        q = asyncio.Queue()
        q.put_nowait(update([0]))
        body = CompletionRequest(model="m", prompt="x", stream=True)
        t0 = asyncio.get_running_loop().time()
        got = await asyncio.wait_for(events(stream(api, "r", q, False, body, [1])), 10)
        assert 0.2 <= asyncio.get_running_loop().time() - t0 < 5
        assert got[0]["choices"][0]["text"] == "a" and got[-1]["error"]["type"] == "timeout", got
        assert aborted == ["r"]
    asyncio.run(go())


def test_collect_takes_the_final_updates_and_gives_up_on_a_gone_client_or_the_deadline(monkeypatch):
    async def go():
        gone = asyncio.Event()

        async def disconnected():
            return gone.is_set()
        request = SimpleNamespace(is_disconnected=disconnected)
        for timeout_s, leave, want in ((60, False, None), (60, True, 499), (0.5, False, 408)):
            aborted = []
            app = SimpleNamespace(srv=SimpleNamespace(request_timeout_s=timeout_s),
                                  engine=SimpleNamespace(abort=aborted.append))
            q = asyncio.Queue()
            for k in range(50):  # running updates: taken and passed over
                q.put_nowait(update(list(range(k + 1))))
            if want is None:
                q.put_nowait(update([0, 1], finished=True))
                (u,) = await api_module.Api.collect(app, request, "r", q, 1)
                assert u.finished and u.token_ids == [0, 1] and not aborted
                continue
            if leave:
                gone.set()
            with pytest.raises(APIError) as e:
                await asyncio.wait_for(api_module.Api.collect(app, request, "r", q, 1), 10)
            assert e.value.status == want and aborted == ["r"]
            gone.clear()
    asyncio.run(go())


@pytest.mark.parametrize("streamed", [True, False])
def test_a_request_that_does_not_stream_asks_the_engine_for_its_final_update_alone(streamed):
    """Api.submit queues a non-streamed request final_only (the engine makes and delivers no running update of
    it: engine/async_engine.py, router/cluster.py), a streamed one with every update."""
    async def go():
        asked = []

        async def add(rid, ids, params, final_only=False):
            asked.append((ids, final_only))
            return asyncio.Queue()
        api = SimpleNamespace(engine=SimpleNamespace(max_model_len=64, encode=list, add=add))
        await api_module.Api.submit(api, [1, 2], None, streamed)
        assert asked == [([1, 2], not streamed)]
    asyncio.run(go())
