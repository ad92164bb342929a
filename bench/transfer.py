"""KV transfer benchmark between two processes on this machine.

(a) efficiency: a real KV transfer (plan frame, staged block arrays cut into frames, a payload checksum on both ends,
    `recv_into` a 64-byte-aligned receive region, per-frame acknowledgement) from this process to a receiver
    process, against a raw-socket baseline moving the same bytes over the same number of connections into a
    preallocated buffer (one 8-byte header per connection, one acknowledgement byte at the end), measured
    alternately in the same run. Reported: median bytes/s of each and their ratio (goal >= 0.85).
(b) sends per request: a mixed workload (random prompt lengths, random finish order) allocated by the real
    block managers of a prefill and a decode instance; per request, the sends of a per-block-per-layer transfer
    (blocks x layers) vs FlowKV-aligned runs (runs x staged block arrays).
(TTFT disaggregated vs colocated with layer-wise streaming and Phi_kv(l) per family need the worker processes:
not measured yet.)

`python -m bench.transfer --json bench/results/transfer.json [--mb 256] [--connections 4] [--reps 5]`
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import socket
import statistics
import struct
import threading
import time

import numpy as np
from tqdm import tqdm

from transfer.align import align
from transfer.bufpool import RecvPool, aligned_empty
from transfer.plan import TransferPlan, bucket
from transfer.receiver import KVReceiver, region_bytes
from transfer.sender import KVSender
from transfer.state import KVPoll
from transfer.tcp import KVServer, TcpLink
from transfer.wire import recv_into_exact

TOKEN = "bench-token"


def _layout(num_blocks: int):
    from jaxserve.cache.layout import PoolLayout
    from jaxserve.models.cache_spec import CacheGroup, CacheSpec
    # an 8B-class dense GQA model: 32 layers, 8 KV heads of 128, bfloat16, blocks of 16 tokens (2 MiB per block)
    spec = CacheSpec((CacheGroup("full", tuple(range(32)), kv_heads=8, k_dim=128, v_dim=128),))
    return PoolLayout.build(spec, 16, num_blocks, 1, 0)


def _receiver(conn, raw_port_q):
    """Receiver process: a KVServer with a receive pool, and a raw-socket sink, driven over a pipe."""
    server = KVServer(TOKEN)
    raw = socket.create_server(("127.0.0.1", 0))
    raw.listen(64)
    raw_port_q.put((server.address, raw.getsockname()[1]))
    pool = None
    sink = None
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            server.close()
            return
        if msg[0] == "expect":
            _, rid, nblocks, dst = msg
            lay = _layout(max(dst) + 1)
            need = region_bytes(lay, "bfloat16", nblocks * 16, 0)
            if pool is None or pool.capacity < need:
                pool = RecvPool(need + (1 << 20))
            r = KVReceiver(rid, lay, "bfloat16", dst, nblocks * 16, 0, pool.allocate(need), 60.0,
                           on_done=lambda r: r.release())
            server.expect(r)
            conn.send("ok")
        elif msg[0] == "raw":
            _, nbytes, nconn = msg
            if sink is None or sink.nbytes < nbytes:
                sink = aligned_empty(nbytes)
            per = -(-nbytes // nconn)
            socks = [raw.accept()[0] for _ in range(nconn)]

            def drain(i, s):
                (n,) = struct.unpack("<Q", s.recv(8, socket.MSG_WAITALL))
                recv_into_exact(s, memoryview(sink)[i * per:i * per + n])
                s.sendall(b"k")
                s.close()
            ts = [threading.Thread(target=drain, args=(i, s)) for i, s in enumerate(socks)]
            for t in ts:
                t.start()
            conn.send("ok")
            for t in ts:
                t.join()


def _kv_once(ctrl, link, lay, arr, nblocks, rid):
    blocks = list(range(nblocks))
    ctrl.send(("expect", rid, nblocks, blocks))
    assert ctrl.recv() == "ok"
    plan = TransferPlan.build(lay, "bfloat16", nblocks * 16, blocks, blocks, 0, [(0, 32)])
    st = plan.check(lay, "bfloat16", blocks, nblocks * 16, 0)
    t = time.perf_counter()
    s = KVSender(rid, link, plan, st)
    s.start()
    s.send_array(0, arr)
    s.finish({"token": 0})
    state = s.wait(120)
    dt = time.perf_counter() - t
    if state is not KVPoll.DONE:
        raise RuntimeError(f"transfer failed: {s.state.reason}")
    return st.sent_bytes / dt, s.frames, s.sends


def _raw_once(ctrl, port, buf, conns):
    ctrl.send(("raw", buf.nbytes, conns))
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(conns)]
    assert ctrl.recv() == "ok"
    per = -(-buf.nbytes // conns)
    view = memoryview(buf.reshape(-1).view(np.uint8))

    def push(i, s):
        part = view[i * per:(i + 1) * per]
        s.sendall(struct.pack("<Q", len(part)))
        s.sendall(part)
        s.recv(1)
        s.close()
    t = time.perf_counter()
    ts = [threading.Thread(target=push, args=(i, s)) for i, s in enumerate(socks)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    return buf.nbytes / (time.perf_counter() - t)


def efficiency(mb: int, conns: int, reps: int) -> dict:
    nblocks = max(1, mb // 2)
    lay = _layout(nblocks)
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 2**16, (bucket(nblocks), 32, 2, 16, 8, 128), dtype=np.uint16)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    q = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(b, q), daemon=True)
    proc.start()
    addr, raw_port = q.get(timeout=120)
    kv, raw, frames = [], [], 0
    link = TcpLink(addr, TOKEN, connections=conns)  # links persist between transfers, as in a worker
    try:
        for i in tqdm(range(reps + 1), desc="transfer efficiency", unit="rep"):
            r = _raw_once(a, raw_port, arr[:nblocks], conns)
            k, frames, sends = _kv_once(a, link, lay, arr, nblocks, f"req{i}")
            if i:  # the first round warms both paths up
                raw.append(r)
                kv.append(k)
    finally:
        link.close()
        a.send(("stop",))
        proc.join(10)
    ratio = statistics.median(kv) / statistics.median(raw)
    return {"bytes": nblocks * 2 * 1024 * 1024, "connections": conns, "reps": reps,
            "kv_bytes_per_s_median": statistics.median(kv), "raw_bytes_per_s_median": statistics.median(raw),
            "efficiency": ratio, "goal": 0.85, "kv_frames": frames, "kv_sends": sends,
            "kv_bytes_per_s": kv, "raw_bytes_per_s": raw}


def sends_per_request(num_requests: int, seed: int = 0) -> dict:
    """Per-block-per-layer sends vs aligned runs, on block lists from the real block managers under churn."""
    from jaxserve.cache.block_manager import BlockManager
    rng = np.random.default_rng(seed)
    bs, layers = 16, 32
    pm, dm = BlockManager(4096, bs, 0, False), BlockManager(4096, bs, 0, False)
    live: list[tuple[list[int], list[int]]] = []
    naive, aligned, runs_hist = [], [], []
    for _ in range(num_requests):
        n = int(rng.integers(64, 8192))
        while len(live) > 8 or pm.num_free < pm.blocks_for(n) or dm.num_free < dm.blocks_for(n):
            p, d = live.pop(int(rng.integers(len(live))))
            pm.free(p)
            dm.free(d)
        p, d = pm.allocate([], n), dm.allocate([], n)
        live.append((p, d))
        runs = align(p, d)
        naive.append(len(p) * layers)
        aligned.append(len(runs))  # one staged block array when prefill sends all layers at once
        runs_hist.append(len(runs))
    return {"requests": num_requests, "layers": layers, "block_size": bs,
            "per_block_per_layer_sends_mean": float(np.mean(naive)),
            "aligned_sends_mean": float(np.mean(aligned)), "aligned_sends_max": int(np.max(aligned)),
            "reduction": float(np.mean(naive) / np.mean(aligned))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--mb", type=int, default=256, help="KV megabytes per transfer (2 MiB blocks)")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--requests", type=int, default=500)
    args = ap.parse_args(argv)
    out = {"benchmark": "transfer", "host": platform.node(), "cpus": mp.cpu_count(),
           "efficiency": efficiency(args.mb, args.connections, args.reps),
           "sends_per_request": sends_per_request(args.requests),
           "not_measured": ["ttft_disagg_vs_colocated", "phi_kv_per_family"]}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    e, s = out["efficiency"], out["sends_per_request"]
    print(f"efficiency {e['efficiency']:.2f} (kv {e['kv_bytes_per_s_median'] / 1e9:.2f} GB/s, raw "
          f"{e['raw_bytes_per_s_median'] / 1e9:.2f} GB/s, {e['connections']} connections); sends per request "
          f"{s['per_block_per_layer_sends_mean']:.0f} -> {s['aligned_sends_mean']:.2f}")


if __name__ == "__main__":
    main()
