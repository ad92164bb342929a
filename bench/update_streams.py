"""What streaming running requests' updates costs a worker and the router per engine step: a stream per request
against one Updates stream per worker (worker/fanout.py, router/updates.py), two processes over real gRPC.

The worker process serves Generate the way a worker does (its updates into worker/fanout.py's queue_for: the
request's own queue, or a Sink into the Updates stream the request names; its own call carries what its queue gets,
as fanout.py `own_messages`) and an engine thread that makes a step every `--step-ms`: one Update per request (a `Grown`
view of its tokens, the text grown by a piece), handed to the loop in one callback as AsyncEngine does. The router
process opens the N calls (and, batched, the Updates stream through router/updates.py's Stream) and rebuilds each
request's updates with `update_of`, as the router's request tasks do. Each side's CPU time over the steps (both
threads), per step, for N requests at once; and the worker's wall time per step (over --step-ms: its loop did not
keep up). The baseline is the stream per request, measured in the same run.

    python -m bench.update_streams --json bench/results/update_streams.json
"""

from __future__ import annotations

import asyncio
import os
import resource
import threading
import time

TOKEN = "bench"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def worker(port: int, n: int, steps: int, step_ms: float, out) -> None:
    from jaxserve.engine.async_engine import _deliver
    from jaxserve.engine.client import Grown, Update
    from jaxserve.worker import messages, rpc
    from jaxserve.worker.fanout import StepStreams, own_messages
    streams, queues, loop = StepStreams(), {}, asyncio.get_running_loop()
    opened = asyncio.Event()

    async def generate(req, ctx):
        own: asyncio.Queue = asyncio.Queue()
        queues[req.request_id] = streams.queue_for(req.updates, req.request_id, own)
        if len(queues) == n:
            opened.set()
        async for msg in own_messages(own):
            yield msg
    server = rpc.server(TOKEN)
    server.add_generic_rpc_handlers((rpc.handler({}, {"Generate": generate, "Updates": lambda r, c: streams.serve(
        r.stream)}, messages.WORKER),))
    rpc.listen(server, f"127.0.0.1:{port}")
    await server.start()
    out.send("ready")
    await opened.wait()
    outs = {rid: [] for rid in queues}

    def engine():
        for s in range(steps + 1):
            time.sleep(step_ms / 1e3)
            items = []
            for rid, q in queues.items():
                outs[rid].append(s)
                done = s == steps
                tokens = list(outs[rid]) if done else Grown(outs[rid])
                items.append((q, Update(0, tokens, "word " * len(outs[rid]), done, "length" if done else None, [], 0,
                                        16)))
            loop.call_soon_threadsafe(_deliver, items)
    c0, t0 = _cpu(), time.perf_counter()
    t = threading.Thread(target=engine)
    t.start()
    while t.is_alive():
        await asyncio.sleep(0.02)
    wall = time.perf_counter() - t0
    await asyncio.sleep(0.5)  # the last messages leave (the loop's time on them counts)
    out.send({"cpu_ms": (_cpu() - c0) / steps * 1e3, "wall_ms": wall / (steps + 1) * 1e3})
    await server.stop(1)


async def router(port: int, n: int, batched: bool, out) -> None:
    from jaxserve.engine.client import update_of
    from jaxserve.router.calls import message
    from jaxserve.router.updates import Stream
    from jaxserve.worker import rpc
    client = rpc.Client(f"127.0.0.1:{port}", TOKEN)
    stream = Stream(client, "w") if batched else None
    if stream is not None:
        assert await stream.ready
    c0, got = None, {}

    async def one(i: int):
        nonlocal c0
        rid = f"r{i}"
        feed: asyncio.Queue | None = None
        if stream is not None:
            feed = asyncio.Queue()
            stream.subscribe(rid, feed)
        msg = message("Generate", request_id=rid, prompt=[1], **({"updates": stream.name} if stream else {}))
        call = client.stream("Generate", msg)
        held, it = None, call.__aiter__()
        read = asyncio.ensure_future(it.__anext__())
        fget = asyncio.ensure_future(feed.get()) if feed else None
        while True:
            await asyncio.wait({read} | ({fget} if fget else set()), return_when=asyncio.FIRST_COMPLETED)
            if c0 is None:
                c0 = _cpu()
            if fget is not None and fget.done():
                held, fget = update_of(fget.result()["update"], held), asyncio.ensure_future(feed.get())
                continue
            held = update_of(read.result()["update"], held)
            if held.finished:
                if fget is not None:
                    fget.cancel()
                got[rid] = len(held.token_ids)
                return
            read = asyncio.ensure_future(it.__anext__())
    await asyncio.gather(*(one(i) for i in range(n)))
    out.send({"cpu_ms_total": (_cpu() - c0) * 1e3, "tokens": sorted(set(got.values()))})
    if stream is not None:
        stream.close()
    await client.close()


def measure(n: int, steps: int, step_ms: float, batched: bool) -> dict:
    """One round: a worker process and a router process, n requests streamed for `steps` steps."""
    import multiprocessing as mp
    from jaxserve.router.launcher import free_ports
    port = free_ports("127.0.0.1")
    ctx = mp.get_context("spawn")
    (wr, ws), (rr, rs) = ctx.Pipe(False), ctx.Pipe(False)
    w = ctx.Process(target=_run, args=(worker, port, n, steps, step_ms, ws))
    w.start()

    r = ctx.Process(target=_run, args=(router, port, n, batched, rs))

    def answer(pipe, what: str):
        deadline = time.monotonic() + 300
        while not pipe.poll(0.2):
            dead = [p for p in (w, r) if p.pid is not None and not p.is_alive() and p.exitcode != 0]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"no answer from the {what} process" + (" (a process failed: its traceback is "
                                                                           "above)" if dead else " in 300 s"))
        return pipe.recv()
    try:
        answer(wr, "worker")  # serving
        r.start()
        wres, rres = answer(wr, "worker"), answer(rr, "router")
    finally:
        for p in (r, w):
            if p.pid is not None:
                p.join(10)
                p.kill()
    if rres["tokens"] != [steps + 1]:
        raise RuntimeError(f"the router rebuilt {rres['tokens']} tokens per request, not {steps + 1}")
    return {"requests": n, "worker_cpu_ms_per_step": round(wres["cpu_ms"], 3),
            "worker_wall_ms_per_step": round(wres["wall_ms"], 3),
            "router_cpu_ms_per_step": round(rres["cpu_ms_total"] / steps, 3)}


def _run(fn, *args) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    asyncio.run(fn(*args))


def main(argv=None) -> int:
    from bench.stamp import arguments, write
    ap = arguments(__doc__)
    ap.add_argument("--requests", default="16,64,256", help="requests streamed at once, per round")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=5.0, help="the engine's step time")
    a = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in a.requests.split(",")):
        per, one = measure(n, a.steps, a.step_ms, False), measure(n, a.steps, a.step_ms, True)
        rows.append({"requests": n, "per_request": per, "one_stream": one,
                     "worker_cpu_ratio": round(one["worker_cpu_ms_per_step"] / per["worker_cpu_ms_per_step"], 3),
                     "router_cpu_ratio": round(one["router_cpu_ms_per_step"] / per["router_cpu_ms_per_step"], 3)})
        print(rows[-1], flush=True)
    write(a.json, {"steps": a.steps, "step_ms": a.step_ms, "rounds": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
