"""KV transfer benchmark between two processes on this machine.

(a) efficiency: a real KV transfer (plan frame, staged block arrays cut into frames, a payload checksum on both ends,
    `recv_into` a 64-byte-aligned receive region, per-frame acknowledgement) from this process to a receiver
    process, against a raw-socket baseline moving the same bytes over the same number of connections into a
    preallocated buffer (one 8-byte header per connection, one acknowledgement byte at the end), measured
    alternately in the same run. Reported: median bytes/s of each and their ratio (goal >= 0.85). Also, in the
    same rotation, raw sockets plus the link's own payload checksum loops on both ends and nothing else of the
    link (`raw_checksum`): what the checksum alone costs raw sockets, and how the link compares with that. And the
    device backend (transfer/pull.py) moving the same bytes, pulled through JAX's transfer server, and its ratio;
    on a GPU the same array shared through CUDA IPC (transfer/ipc.py: the receiver copies it out of the sender's
    memory on the GPU both share); both beside the device's own copy rate of the array (`device_copy`); the
    KV link over mutual TLS (transfer/tls.py, `kv_tls`): what encryption costs against the plaintext link; and
    where the CPU goes: CPU seconds per GB moved of each process (sender, receiver) for each kind of transfer,
    the cores they keep busy, the CPU seconds per GB of the payload checksum alone (XXH3 over the payload as
    it lies in memory), and the efficiency a transfer whose only extra work is that checksum on each end would
    reach when both are CPU bound (`checksum_ceiling` = raw CPU / (raw CPU + 2 x checksum CPU)).
(b) sends per request: a mixed workload (random prompt lengths, random finish order) allocated by the real
    block managers of a prefill and a decode instance; per request, the sends of a per-block-per-layer transfer
    (blocks x layers) vs FlowKV-aligned runs (runs x staged block arrays).
(c) TTFT disaggregated vs colocated over prompt lengths, through the router (router/cluster.py) and real
    worker processes: colocated = one `both` instance on core 0 (the request runs whole there); disaggregated
    = a prefill worker on core 0 (the same compute for the prompt) and a decode worker on core 1, KV over
    TCP, once sent after the prefill (one layer group) and once streamed layer-wise. Random prompts, no
    prefix hits; the first 2 requests of each length (compiles, settling) are not counted; median of `--ttft-reps`.
    overhead = TTFT_disagg / TTFT_colocated - 1 (goal <= 0.10 with layer-wise streaming where the link is
    faster than the KV production rate). Four disaggregated setups: loopback as is, and an emulated 0.2 Gb/s
    link (transfer time comparable to prefill time), each with the KV sent after the prefill (one group) or
    streamed in layer groups of 2 (from transfer.stream_min_tokens, 512 by default: shorter prompts go in one
    group after the step). TTFT is when the router hands the client its first token: disaggregated, that is
    the prefill call's first message, sent as soon as the token is sampled, so the transfer shows in the
    second token's time (max_tokens = 2: the request's end), reported with its overhead too. `--ttft-chunk N`:
    every engine prefills in chunks of N tokens (default: a prompt in one chunk), so a longer prompt's KV leaves
    chunk by chunk while its later chunks compute.
(d) Phi_kv(l) = S_kv(l) / T_prefill(l) per model family (the PrfaaS document's Table 3, on this machine):
    S_kv from the model's cache groups (what a transfer of a fresh prompt of l tokens moves, float32), T_prefill
    the time of one prefill step of l tokens (one chunk) in-process, median of `--phi-reps` after a warm-up;
    compared with the KV link bandwidth measured in (a).
Models for (c) and (d): bench-size random checkpoints of each family (bench/families.py), built on first use
under `--models`.

`python -m bench.transfer --json bench/results/transfer.json [--parts a,b,c,d] [--mb 256] [--connections 4]`
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
import struct
import threading
import time

import numpy as np
from tqdm import tqdm

from jaxserve.transfer import wire
from jaxserve.transfer.align import align
from jaxserve.transfer.bufpool import RecvPool, aligned_empty
from jaxserve.transfer.plan import TransferPlan, bucket
from jaxserve.transfer.receiver import KVReceiver, region_bytes
from jaxserve.transfer.sender import KVSender
from jaxserve.transfer.state import KVPoll
from jaxserve.transfer.tcp import KVServer, TcpLink

TOKEN = "bench-token"


def _layout(num_blocks: int):
    from jaxserve.cache.layout import PoolLayout
    from jaxserve.models.cache_spec import CacheGroup, CacheSpec
    # an 8B-class dense GQA model: 32 layers, 8 KV heads of 128, bfloat16, blocks of 16 tokens (2 MiB per block)
    spec = CacheSpec((CacheGroup("full", tuple(range(32)), kv_heads=8, k_dim=128, v_dim=128),))
    return PoolLayout.build(spec, 16, num_blocks, 1, 0)


def _receiver(conn, raw_port_q, tls):
    """Receiver process: a KVServer with a receive pool (and a JAX transfer server for the device backend), a
    second one speaking TLS (`tls`: transfer.tls.Tls), and a raw-socket sink, driven over a pipe."""
    from jaxserve.transfer.pull import PullServer
    servers = {"plain": KVServer(TOKEN, puller=PullServer(ipc=_ipc_share()[0])),
               "tls": KVServer(TOKEN, tls=tls.server_context())}
    raw = socket.create_server(("127.0.0.1", 0))
    raw.listen(64)
    raw_port_q.put(({k: v.address for k, v in servers.items()}, raw.getsockname()[1]))
    pool = None
    sink = None
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            for server in servers.values():
                server.close()
            return
        if msg[0] == "cpu":
            conn.send(_cpu_s())
            continue
        if msg[0] == "expect":
            _, rid, nblocks, dst, which = msg
            lay = _layout(max(dst) + 1)
            need = region_bytes(lay, "bfloat16", nblocks * 16, 0)
            if pool is None or pool.capacity < need:
                pool = RecvPool(need + (1 << 20))
            r = KVReceiver(rid, lay, "bfloat16", dst, nblocks * 16, 0, pool.allocate(need), 60.0,
                           on_done=lambda r: r.release())
            servers[which].expect(r)
            conn.send("ok")
        elif msg[0] == "raw":
            _, nbytes, nconn, checked = msg
            if sink is None or sink.nbytes < nbytes:
                sink = aligned_empty(nbytes)
            per = -(-nbytes // nconn)
            socks = [raw.accept()[0] for _ in range(nconn)]

            def drain(i, s):
                (n,) = struct.unpack("<Q", s.recv(8, socket.MSG_WAITALL))
                check = wire.Checksum() if checked else None
                wire.recv_into_exact(s, memoryview(sink)[i * per:i * per + n], check)
                tail = wire.recv_exact(s, wire.tail_len(n, True)) if checked else b""  # the link's trailer and pad
                ok = check is None or wire.TRAILER.unpack_from(tail)[0] == check.digest()
                s.sendall(b"k" if ok else b"x")
                s.close()
            ts = [threading.Thread(target=drain, args=(i, s)) for i, s in enumerate(socks)]
            for t in ts:
                t.start()
            conn.send("ok")
            for t in ts:
                t.join()


def _ipc_share():
    """(this process's CUDA IPC share, None) on a GPU; (None, why not) elsewhere or where it cannot start."""
    import jax
    if jax.default_backend() != "gpu":
        return None, f"JAX runs on {jax.default_backend()}: CUDA IPC needs a GPU"
    from jaxserve.transfer.cuda import CudaError
    from jaxserve.transfer.ipc import cuda_share
    try:
        return cuda_share(jax.local_devices()[0]), None
    except CudaError as e:
        return None, f"no CUDA IPC: {e}"


def _device_copy(x, reps: int = 5) -> float:
    """Bytes/s of the device's own copy of `x` (a device-to-device copy on its device), median of `reps`."""
    import jax
    dev = next(iter(x.devices()))
    jax.device_put(x, dev, may_alias=False).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.device_put(x, dev, may_alias=False).block_until_ready()
        times.append(time.perf_counter() - t)
    return x.nbytes / statistics.median(times)


def _cpu_s() -> float:
    """CPU seconds (user + system, all threads) this process has used."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _checksum_s_per_gb(arr: np.ndarray, reps: int = 3) -> float:
    """CPU seconds per GB of the payload checksum alone, piece by piece as the link computes it."""
    view = memoryview(arr.reshape(-1).view(np.uint8))
    times = []
    for _ in range(reps):
        t = time.process_time()
        for i in range(0, len(view), wire.PIECE):
            wire.checksum(view[i:i + wire.PIECE])
        times.append(time.process_time() - t)
    return statistics.median(times) / (len(view) / 1e9)


def _kv_once(ctrl, link, lay, arr, nblocks, rid, which="plain"):
    """One transfer of `arr` (numpy: DATA frames; a jax.Array on a PullLink: pulled by the receiver) to the
    receiver's `which` server (plain or tls)."""
    blocks = list(range(nblocks))
    ctrl.send(("expect", rid, nblocks, blocks, which))
    assert ctrl.recv() == "ok"
    plan = TransferPlan.build(lay, "bfloat16", nblocks * 16, blocks, blocks, 0, [(0, 32)])
    st = plan.check(lay, "bfloat16", blocks, nblocks * 16, 0)
    t = time.perf_counter()
    s = KVSender(rid, link, plan, st)
    s.start()
    if isinstance(arr, np.ndarray):
        s.send_array(0, arr)
    else:
        s.offer_arrays([(0, arr)])
    s.finish({"token": 0})
    state = s.wait(120)
    dt = time.perf_counter() - t
    if state is not KVPoll.DONE:
        raise RuntimeError(f"transfer failed: {s.state.reason}")
    return st.sent_bytes / dt, s.frames, s.sends


def _raw_once(ctrl, port, buf, conns, checked=False):
    """Raw sockets: one 8-byte length and the bytes per connection, one acknowledgement byte back. checked: the
    bytes go out and land through the link's own checksummed loops (wire.send_payload: 1 MiB pieces, each
    hashed after the socket copied it, then the trailer; wire.recv_into_exact hashing each read), so this
    baseline adds to raw sockets exactly the checksum the link computes, and nothing else of the link."""
    ctrl.send(("raw", buf.nbytes, conns, checked))
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(conns)]
    assert ctrl.recv() == "ok"
    per = -(-buf.nbytes // conns)
    view = memoryview(buf.reshape(-1).view(np.uint8))
    acks = []

    def push(i, s):
        part = view[i * per:(i + 1) * per]
        s.sendall(struct.pack("<Q", len(part)))
        if checked:
            wire.send_payload(s.sendall, part)
        else:
            s.sendall(part)
        acks.append(s.recv(1))
        s.close()
    t = time.perf_counter()
    ts = [threading.Thread(target=push, args=(i, s)) for i, s in enumerate(socks)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    dt = time.perf_counter() - t
    if acks != [b"k"] * conns:
        raise RuntimeError(f"raw transfer not acknowledged: {acks}")
    return buf.nbytes / dt


def efficiency(mb: int, conns: int, reps: int) -> dict:
    nblocks = max(1, mb // 2)
    lay = _layout(nblocks)
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 2**16, (bucket(nblocks), 32, 2, 16, 8, 128), dtype=np.uint16)
    import tempfile

    from jaxserve.transfer.tls import Tls, make_certs
    cert_dir = tempfile.mkdtemp(prefix="jaxserve-bench-certs-")
    made = make_certs(cert_dir, ["127.0.0.1"], ["receiver", "sender"])
    tls = {k: Tls(made["ca"][0], *made[k], mutual=True) for k in ("receiver", "sender")}
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    q = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(b, q, tls["receiver"]), daemon=True)
    proc.start()
    addrs, raw_port = q.get(timeout=120)
    addr = addrs["plain"]
    import jax
    import jax.numpy as jnp

    from jaxserve.transfer.pull import PullLink, PullServer
    kv, raw, raw_cs, dev, ktls, ipc, copies, frames = [], [], [], [], [], [], [], 0
    share, no_ipc = _ipc_share()
    # per kind: sender s, receiver s, wall s (counted reps)
    cpu = {k: [0.0, 0.0, 0.0] for k in ("raw", "raw_checksum", "kv", "kv_tls", "device")
           + (("cuda_ipc",) if share else ())}

    def timed(kind, counted, fn, *args):  # fn's result; counted: the CPU both processes spent on it adds to cpu[kind]
        a.send(("cpu",))
        s0, r0, t0 = _cpu_s(), a.recv(), time.perf_counter()
        res = fn(*args)
        a.send(("cpu",))
        s1, r1, t1 = _cpu_s(), a.recv(), time.perf_counter()
        if counted:
            for j, d in enumerate((s1 - s0, r1 - r0, t1 - t0)):
                cpu[kind][j] += d
        return res
    link = TcpLink(addr, TOKEN, connections=conns)  # links persist between transfers, as in a worker
    plink = PullLink(addr, TOKEN, PullServer(connections=conns), 120.0, connections=1)
    tlink = TcpLink(addrs["tls"], TOKEN, connections=conns, tls=tls["sender"].client_context())
    ilink = PullLink(addr, TOKEN, PullServer(connections=conns, ipc=share), 120.0, ipc=True, connections=1) \
        if share else None
    on_device = jnp.asarray(arr[:nblocks])
    try:
        for i in tqdm(range(reps + 1), desc="transfer efficiency", unit="rep"):
            counted = i > 0  # the first round warms the paths up
            r = timed("raw", counted, _raw_once, a, raw_port, arr[:nblocks], conns)
            rc = timed("raw_checksum", counted, _raw_once, a, raw_port, arr[:nblocks], conns, True)
            k, frames, sends = timed("kv", counted, _kv_once, a, link, lay, arr, nblocks, f"req{i}")
            d, _, _ = timed("device", counted, _kv_once, a, plink, lay, on_device, nblocks, f"dev{i}")
            kt, _, _ = timed("kv_tls", counted, _kv_once, a, tlink, lay, arr, nblocks, f"tls{i}", "tls")
            if ilink is not None:
                try:
                    ip, _, _ = timed("cuda_ipc", counted, _kv_once, a, ilink, lay, on_device, nblocks, f"ipc{i}")
                    if counted:
                        ipc.append(ip)
                except Exception as e:  # noqa: BLE001 - recorded; the other kinds' figures are kept
                    no_ipc = f"failed: {type(e).__name__}: {e}"
                    print(f"CUDA IPC transfer {no_ipc}", flush=True)
                    ilink.close()
                    ilink, ipc = None, []
                    cpu.pop("cuda_ipc", None)
            copy = _device_copy(on_device)
            if counted:
                copies.append(copy)
                raw.append(r)
                raw_cs.append(rc)
                kv.append(k)
                dev.append(d)
                ktls.append(kt)
        cipher = tls_cipher(tlink)
    finally:
        link.close()
        plink.close()
        tlink.close()
        if ilink is not None:
            ilink.close()
        a.send(("stop",))
        proc.join(10)
        import shutil
        shutil.rmtree(cert_dir, ignore_errors=True)
    ratio = statistics.median(kv) / statistics.median(raw)
    med_cs = statistics.median(raw_cs)
    gb = reps * nblocks * 2 * 1024 * 1024 / 1e9
    cpu_per_gb = {k: {"sender": v[0] / gb, "receiver": v[1] / gb, "total": (v[0] + v[1]) / gb,
                      "cores_busy": (v[0] + v[1]) / v[2]} for k, v in cpu.items()}
    check = _checksum_s_per_gb(arr[:nblocks])
    copy = statistics.median(copies)
    return {"bytes": nblocks * 2 * 1024 * 1024, "connections": conns, "reps": reps,
            "kv_bytes_per_s_median": statistics.median(kv), "raw_bytes_per_s_median": statistics.median(raw),
            "efficiency": ratio, "goal": 0.85, "kv_frames": frames, "kv_sends": sends,
            "kv_bytes_per_s": kv, "raw_bytes_per_s": raw,
            "cpu_s_per_gb": cpu_per_gb, "checksum_cpu_s_per_gb": check,
            "checksum_ceiling": cpu_per_gb["raw"]["total"] / (cpu_per_gb["raw"]["total"] + 2 * check),
            "raw_checksum": {"what": "raw sockets plus the link's own checksum loops on both ends (wire.send_payload, "
                                     "wire.recv_into_exact with a Checksum): nothing else of the link",
                             "bytes_per_s_median": med_cs, "vs_raw": med_cs / statistics.median(raw),
                             "kv_vs_this": statistics.median(kv) / med_cs, "bytes_per_s": raw_cs},
            "device_backend": {"what": "the same bytes as one device array pulled by the receiver through JAX's "
                                       "transfer server (transfer/pull.py), its transport on the same number of "
                                       "connections; the arrays on JAX's default backend, here "
                                       f"{jax.default_backend()} (cpu: host memory to host memory; gpu: from "
                                       "one GPU's memory to the same GPU's, both processes sharing it)",
                               "bytes_per_s_median": statistics.median(dev),
                               "vs_raw": statistics.median(dev) / statistics.median(raw),
                               "vs_device_copy": statistics.median(dev) / copy, "bytes_per_s": dev},
            "device_copy": {"what": "the device's own copy of the same array (jax.device_put, may_alias=False), "
                                    "bytes copied per second, median of 5 per repetition: the rate the device "
                                    "backends compare with", "bytes_per_s_median": copy, "bytes_per_s": copies},
            "cuda_ipc": {"what": "the same array shared through CUDA IPC (transfer/ipc.py): the receiver maps the "
                                 "sender's allocation and copies the array out of it on the GPU both processes share "
                                 "(staged: the sender first copies it into driver memory, JAX's being unshareable)",
                         "staged": share.staged,
                         "bytes_per_s_median": statistics.median(ipc), "vs_device_copy": statistics.median(ipc) / copy,
                         "vs_device_backend": statistics.median(ipc) / statistics.median(dev), "bytes_per_s": ipc}
            if ipc else {"not_measured": no_ipc},
            "tls": {"what": "the same KV link (same frames, checksums, connections) over mutual TLS (transfer/tls.py: "
                            "Python ssl, the OpenSSL build's default cipher suite), against the plaintext link",
                    "cipher": cipher, "bytes_per_s_median": statistics.median(ktls),
                    "vs_kv": statistics.median(ktls) / statistics.median(kv),
                    "vs_raw": statistics.median(ktls) / statistics.median(raw), "bytes_per_s": ktls}}


def tls_cipher(link) -> str | None:
    """The protocol and cipher suite a connection like `link`'s negotiates (a probe; it sends no HELLO)."""
    ctx = link.tls
    with socket.create_connection(link.address, timeout=10) as s, ctx.wrap_socket(s, server_hostname=link.address[0]) as t:
        return f"{t.version()} {t.cipher()[0]}"


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


def _engine_section(max_len: int, warmup: bool = False, chunk: int | None = None) -> dict:
    """chunk: the prefill's chunk (None: the longest prompt's power of two, one chunk a prompt)."""
    whole = 16
    while whole < max_len:
        whole *= 2
    chunk = chunk or whole
    return dict(block_size=16, num_blocks=2 * whole // 16 + 16, max_num_seqs=4, max_num_batched_tokens=chunk,
                chunk_size=chunk, max_prefill_seqs=1, max_model_len=whole + 64, prefix_caching=False,
                num_snapshots=0, warmup=warmup)


WARM = 2  # requests per length before timing (compiles; the first requests after start-up run slower)
PD = [{"name": "p0", "role": "prefill", "cpus": [0]}, {"name": "d0", "role": "decode", "cpus": [1]}]
SLOW_GBPS = 0.2  # the emulated link of the *_link setups: 25 MB/s
LAYERS_PER_GROUP = 2
TTFT_SETUPS = {  # name -> (instances, transfer.layers_per_group, emulated link Gb/s or None: loopback as is)
    "colocated": ([{"name": "c0", "role": "both", "cpus": [0]}], None, None),
    "disagg": (PD, None, None),
    "disagg_layerwise": (PD, LAYERS_PER_GROUP, None),
    "disagg_link": (PD, None, SLOW_GBPS),
    "disagg_link_layerwise": (PD, LAYERS_PER_GROUP, SLOW_GBPS),
}


def ttft(path: str, lengths: list[int], reps: int, connections: int, setups: list[str], seed: int = 0,
         pinned: bool = True, chunk: int | None = None) -> dict:
    """Median router-measured TTFT per prompt length for each of `setups` (TTFT_SETUPS; real worker processes,
    pinned as listed there, or on any core); chunk: every engine's prefill chunk (None: one a prompt)."""
    from bench import clusters
    from jaxserve.config import TransferSection
    from jaxserve.models.config import load_config
    from jaxserve.sampling import SamplingParams
    vocab = load_config(path).vocab_size
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def one_setup(instances, per_group, gbps):
        link = [{"src": "b", "dst": "b", "bandwidth_gbps": gbps, "connections": connections}] if gbps else []
        config = {"model": {"path": path, "dtype": "float32"}, "engine": _engine_section(max(lengths), chunk=chunk),
                  "clusters": [{"name": "b", "instances": instances}], "links": link,
                  "transfer": {"token": TOKEN, "connections": connections, "layers_per_group": per_group},
                  "router": {"ready_timeout_s": 600}}

        async def measure(cluster):
            rng = np.random.default_rng(seed)
            out, second, route = {}, {}, None
            for L in lengths:
                times, t2 = [], []
                for r in range(reps + WARM):  # the first of each length compile, the next settle: not counted
                    t0 = time.perf_counter()
                    u = await clusters.finish(await cluster.add(f"{L}-{r}", rng.integers(3, vocab, L).tolist(),
                                                                params))
                    if r >= WARM:
                        times.append(u.ttft_s)
                        t2.append(time.perf_counter() - t0)
                    route = u.route
                out[L], second[L] = times, t2
            return out, second, route
        return clusters.run(config, measure, pinned)

    res = {}
    for name in tqdm(setups, desc="ttft setups", unit="setup"):
        instances, per_group, gbps = TTFT_SETUPS[name]
        times, second, route = one_setup(instances, per_group, gbps)
        res[name] = {"instances": instances, "layers_per_group": per_group, "link_gbps": gbps, "route": route,
                     "stream_min_tokens": TransferSection().stream_min_tokens if per_group else None,
                     "ttft_s_median": {L: statistics.median(t) for L, t in times.items()}, "ttft_s": times,
                     "second_token_s_median": {L: statistics.median(t) for L, t in second.items()}}
    co, co2 = res["colocated"]["ttft_s_median"], res["colocated"]["second_token_s_median"]
    for name in [n for n in res if n != "colocated"]:
        res[name]["overhead"] = {L: res[name]["ttft_s_median"][L] / co[L] - 1 for L in lengths}
        res[name]["second_token_overhead"] = {L: res[name]["second_token_s_median"][L] / co2[L] - 1
                                              for L in lengths}
    return {"model": os.path.basename(path), "lengths": lengths, "reps": reps, "goal_overhead": 0.10,
            "pinned": pinned, "chunk_size": _engine_section(max(lengths), chunk=chunk)["chunk_size"], "setups": res}


def phi_kv(families: list[str], root: str, lengths: list[int], reps: int, link_bytes_per_s: float | None) -> dict:
    """S_kv(l), T_prefill(l) and Phi_kv(l) = S_kv / T_prefill per family (in-process, this machine)."""
    import time as _time

    from bench.families import checkpoint
    from jaxserve.engine.llm_engine import EngineConfig, LLMEngine
    from jaxserve.sampling import SamplingParams
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = {}
    for fam in tqdm(families, desc="phi_kv families", unit="family"):
        path = checkpoint(fam, root)
        ec = {k: v for k, v in _engine_section(max(lengths)).items() if k != "warmup"}
        llm = LLMEngine(path, "float32", EngineConfig(**ec), progress=False)
        rows = {}
        for L in lengths:
            times = []
            for r in range(reps + 1):
                seq, = llm.add_request(f"{fam}-{L}-{r}", rng.integers(3, llm.model_config.vocab_size, L).tolist(),
                                       params)
                t0 = _time.perf_counter()
                while llm.has_work:
                    llm.step()
                if r:
                    times.append(_time.perf_counter() - t0)
                llm.release(seq)
            t = statistics.median(times)
            s = llm.cache_spec.transfer_bytes(L, 16, 4, 0)
            rows[L] = {"s_kv_bytes": s, "t_prefill_s": t, "phi_kv_bytes_per_s": s / t,
                       "link_over_phi": (link_bytes_per_s / (s / t)) if link_bytes_per_s else None}
        out[fam] = {"cache_groups": [[g.kind, len(g.layers)] for g in llm.cache_spec.groups], "by_length": rows}
        del llm
    return {"dtype": "float32", "block_size": 16, "reps": reps, "link_bytes_per_s": link_bytes_per_s,
            "families": out}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--parts", default="a,b,c,d", help="which parts to run (a,b,c,d)")
    ap.add_argument("--mb", type=int, default=256, help="(a) KV megabytes per transfer (2 MiB blocks)")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--models", default="bench/.models", help="(c, d) where bench-size checkpoints are built")
    ap.add_argument("--ttft-family", default="llama")
    ap.add_argument("--ttft-lengths", default="256,1024,2048")
    ap.add_argument("--ttft-reps", type=int, default=7)
    ap.add_argument("--ttft-setups", default=",".join(TTFT_SETUPS), help="which setups (colocated always runs)")
    ap.add_argument("--ttft-chunk", type=int, default=None, help="(c) the engines' prefill chunk in tokens "
                    "(default: a prompt in one chunk)")
    ap.add_argument("--phi-families", default="llama,qwen3,deepseek_v3,kimi_linear,qwen3_next,gpt_oss,mimo_v2_flash")
    ap.add_argument("--phi-lengths", default="256,1024,2048")
    ap.add_argument("--phi-reps", type=int, default=3)
    ap.add_argument("--unpinned", action="store_true", help="(c) the workers on any core (default: as TTFT_SETUPS "
                    "pins them)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"a", "b", "c", "d"}:
        ap.error(f"--parts: unknown parts {sorted(parts - {'a', 'b', 'c', 'd'})}")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    out = {"benchmark": "transfer", "host": platform.node(), "cpus": mp.cpu_count()}
    if "a" in parts:
        out["efficiency"] = efficiency(args.mb, args.connections, args.reps)
    if "b" in parts:
        out["sends_per_request"] = sends_per_request(args.requests)
    if "c" in parts:
        from bench.families import checkpoint
        setups = ["colocated"] + [n for n in args.ttft_setups.split(",") if n != "colocated"]
        unknown = set(setups) - set(TTFT_SETUPS)
        if unknown:
            ap.error(f"--ttft-setups: unknown {sorted(unknown)}; have {list(TTFT_SETUPS)}")
        out["ttft"] = ttft(checkpoint(args.ttft_family, args.models), ints(args.ttft_lengths), args.ttft_reps,
                           args.connections, setups, pinned=not args.unpinned, chunk=args.ttft_chunk)
    if "d" in parts:
        link = out.get("efficiency", {}).get("kv_bytes_per_s_median")
        out["phi_kv"] = phi_kv(args.phi_families.split(","), args.models, ints(args.phi_lengths), args.phi_reps, link)
    from bench.stamp import write
    write(args.json, out, indent=1)
    if "efficiency" in out:
        e = out["efficiency"]
        print(f"(a) efficiency {e['efficiency']:.2f} (kv {e['kv_bytes_per_s_median'] / 1e9:.2f} GB/s, raw "
              f"{e['raw_bytes_per_s_median'] / 1e9:.2f} GB/s, {e['connections']} connections)")
        c = e["cpu_s_per_gb"]
        print("(a) CPU s/GB (sender + receiver, cores busy): " + ", ".join(
            f"{k} {v['sender']:.3f} + {v['receiver']:.3f} ({v['cores_busy']:.2f})" for k, v in c.items())
            + f"; checksum alone {e['checksum_cpu_s_per_gb']:.3f} per end, ceiling {e['checksum_ceiling']:.2f}")
        rc = e["raw_checksum"]
        print(f"(a) raw + checksum {rc['bytes_per_s_median'] / 1e9:.2f} GB/s, {rc['vs_raw']:.2f} of raw; the link is "
              f"{rc['kv_vs_this']:.2f} of it")
        d = e["device_backend"]
        print(f"(a) device backend {d['bytes_per_s_median'] / 1e9:.2f} GB/s, {d['vs_raw']:.2f} of raw")
        t = e["tls"]
        print(f"(a) KV link over TLS ({t['cipher']}) {t['bytes_per_s_median'] / 1e9:.2f} GB/s, {t['vs_kv']:.2f} of the "
              f"plaintext link, {t['vs_raw']:.2f} of raw")
    if "sends_per_request" in out:
        s = out["sends_per_request"]
        print(f"(b) sends per request {s['per_block_per_layer_sends_mean']:.0f} -> {s['aligned_sends_mean']:.2f}")
    if "ttft" in out:
        for name, r in out["ttft"]["setups"].items():
            tail = "" if "overhead" not in r else "  overhead " + ", ".join(
                f"{L}: {o:+.1%}" for L, o in r["overhead"].items())
            print(f"(c) {name:17s} TTFT " + ", ".join(f"{L}: {t * 1e3:.0f} ms" for L, t in r["ttft_s_median"].items())
                  + tail)
            if "second_token_overhead" in r:
                print(f"(c) {name:17s} second token overhead " + ", ".join(
                    f"{L}: {o:+.1%}" for L, o in r["second_token_overhead"].items()))
    if "phi_kv" in out:
        for fam, r in out["phi_kv"]["families"].items():
            print(f"(d) {fam:14s} Phi_kv " + ", ".join(f"{L}: {v['phi_kv_bytes_per_s'] / 1e6:.1f} MB/s"
                                                      for L, v in r["by_length"].items()))


if __name__ == "__main__":
    main()
