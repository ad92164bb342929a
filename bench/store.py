"""The global KV store live: TTFT of a prefill whose prefix comes from the store, against the same prefix already
in the prefill instance's own cache, and against no cached prefix at all, over prompt lengths.

Cluster (real worker processes, the bench-size llama of bench/families.py): prefill instances p0-p3 on core 0,
decode d0 and the store s0 on core 1. Per prefix share r (`--hits`: BanaServe's evaluation assumes r = 0.5;
0.97 leaves the prefill almost nothing to compute), prompt length L and repetition, a fresh prefix S of r x L
tokens (whole blocks) and three requests of S plus L - |S| fresh tokens, one output token each:
  cold   on p0, nothing cached (its prompt goes to the store too, each layer group as the prefill computes it)
then, in an order that rotates with the repetition (an instance that ran last runs faster on a shared core):
  local  on p0 again, once the store holds S: the prefix is in p0's own cache
  store  on p1, which has never seen S: beside d0's reservation the router asks p1 to load S (Load), and p1
         finds S's blocks in the store's shared pool (the same host) by hash and copies them into its own cache
         in one pass (cache/pool_copy.py), with no call to the store; its prefill then finds S cached
  store_tcp  on p2, S over the transfer layer as between hosts: the router loads S from the store into p2
         (Import on p2, Export on s0), starting with the placement, beside d0's reservation, and p2 computes the
         rest over it as it lands, layer group by layer group (the pipelined load)
  store_serial  the same on p3, but the load first and then the prefill (the pipeline's baseline)
TTFT is the router's (arrival to first token), split at the decode reservation (the route's `placed_s`: the
store's Load runs beside the reservation, the prefill after it). The bench's policy object pins each request
to its instance.
Ratios against `local` are paired: per repetition against the local run of the same repetition (the machine's
slow moments fall on both), median and quartiles; TTFT medians beside them.

    python -m bench.store --json bench/results/store.json
"""

from __future__ import annotations

import asyncio
import platform
import time

import numpy as np

from bench.clusters import finish, run


def config(path: str, max_len: int) -> dict:
    return {"model": {"path": path, "name": "bench"},
            "engine": dict(block_size=16, num_blocks=1024, max_num_seqs=8, max_num_batched_tokens=512,
                           chunk_size=256, max_prefill_seqs=4, max_model_len=max_len + 64, num_snapshots=16,
                           warmup=True),
            "clusters": [{"name": "pd", "instances": [
                {"name": "p0", "role": "prefill", "cpus": [0]}, {"name": "p1", "role": "prefill", "cpus": [0]},
                {"name": "p2", "role": "prefill", "cpus": [0]}, {"name": "p3", "role": "prefill", "cpus": [0]},
                {"name": "d0", "role": "decode", "cpus": [1]},
                {"name": "s0", "role": "store", "cpus": [1], "kv_blocks": 4096}]}],
            "transfer": {"token": "bench-store", "layers_per_group": 2, "deadline_s": 60},
            "router": {"heartbeat_s": 0.25, "down_after_s": 10.0, "busy_wait_s": 60},
            "policy": {"name": "banaserve"}, "server": {"request_timeout_s": 600}}


class Pinned:
    """The bench's placement: prefill on `self.on`, decode on d0; `self.from_store` loads the prefix the store
    holds first."""
    name = "pinned"

    def __init__(self):
        self.on, self.from_store, self.overlap = "p0", False, True

    def state(self) -> dict:
        return {}

    def place(self, snap):
        from jaxserve.router.policies.base import Placement, PrefixMove
        p = next(i for i in snap.instances if i.name == self.on)
        total = snap.request.prompt_tokens
        if self.from_store:
            if not snap.store_tokens:
                raise RuntimeError("the store holds none of the prompt")
            return Placement("d0", p.name, "pd", "bench: from the store",
                             PrefixMove(snap.store, snap.store_tokens, self.overlap), total - snap.store_tokens,
                             snap.store)
        return Placement("d0", p.name, "pd", "bench: pinned", None, total - p.cached_tokens,
                         p.name if p.cached_tokens else None)


def main(argv=None):
    from bench.stamp import arguments
    ap = arguments(__doc__)
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--hits", default="0.5,0.97", help="prefix shares of the prompt")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--models", default="bench/.models", help="where bench-size checkpoints are built")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    hits = [float(x) for x in a.hits.split(",")]
    from bench.families import checkpoint
    from jaxserve.sampling import SamplingParams
    from tqdm import tqdm
    path = checkpoint("llama", a.models)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(0)

    async def go(cluster):
        pol = Pinned()
        cluster.policy = pol
        out = {}
        bar = tqdm(total=len(hits) * len(lengths) * a.reps, desc="store", unit="rep")

        async def ttft(rid, prompt, on, from_store=False, overlap=True, shared=True):
            # the router writes each prompt to the store after its prefill: that copy runs before, not during
            await asyncio.gather(*list(cluster.prefixes.store_tasks))
            pol.on, pol.from_store, pol.overlap = on, from_store, overlap
            cluster.prefixes.shared_loads = shared
            u = await finish(await cluster.add(rid, prompt, params))
            return u.ttft_s, u.route or {}

        await ttft("warm", [int(x) for x in rng.integers(1, 1000, 64)], "p1")  # first calls: connections
        deadline = time.monotonic() + 120  # the prefill instances compile their copy out of the store's pool
        while not all(cluster.registry.get(p).stats.get("store_copies") for p in ("p0", "p1", "p2", "p3")):
            if time.monotonic() > deadline:
                raise RuntimeError("the prefill instances did not compile their copies out of the store's pool")
            await asyncio.sleep(0.1)
        for r, L in [(r, L) for r in hits for L in lengths]:
            prefix = int(r * L) // 16 * 16
            rows = {"cold": [], "local": [], "store": [], "store_tcp": [], "store_serial": []}
            placed = {k: [] for k in rows}  # the route's placed_s: arrival to the decode reservation

            def keep(how, t, route):
                rows[how].append(t)
                placed[how].append(route["placed_s"])
            moved = {"store": [], "store_tcp": [], "store_serial": []}
            for k in range(a.reps):
                S = [int(x) for x in rng.integers(1, 1000, prefix)]
                fresh = lambda: [int(x) for x in rng.integers(1, 1000, L - prefix)]  # noqa: E731
                keep("cold", *await ttft(f"L{L}-{k}-cold", S + fresh(), "p0"))
                probe = S + fresh()
                deadline = time.monotonic() + 30
                while cluster.index.match(probe, {"s0"}).get("s0", 0) < prefix:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the store did not get the {prefix}-token prefix: "
                                           f"{cluster.prefixes.store_puts}")
                    await asyncio.sleep(0.05)
                runs = [("local", "p0"), ("store", "p1"), ("store_tcp", "p2"), ("store_serial", "p3")]
                for how, on in runs[k % 4:] + runs[:k % 4]:  # each goes first, second, ... in turn
                    if how == "local":
                        keep("local", *await ttft(f"L{L}-{k}-local", probe, "p0"))
                        continue
                    t, route = await ttft(f"L{L}-{k}-{how}", S + fresh(), on, True, how != "store_serial",
                                          how == "store")
                    mv = route.get("prefix_move") or {}
                    if mv.get("tokens") != prefix or mv.get("via") != ("shared" if how == "store" else "transfer"):
                        raise RuntimeError(f"the prefix did not come from the store as {how} asks: {route}")
                    if how == "store" and not mv.get("one_pass"):
                        raise RuntimeError(f"the store's prefix was staged, not copied in one pass: {route}")
                    keep(how, t, route)
                    moved[how].append(route["prefix_move"])
                bar.update()
            med = {k: float(np.median(v)) for k, v in rows.items()}

            def paired(how):  # per repetition against the local run of the same repetition
                x = np.asarray(rows[how]) / np.asarray(rows["local"])
                return {"median": float(np.median(x)), "p25": float(np.percentile(x, 25)),
                        "p75": float(np.percentile(x, 75)), "min": float(x.min()), "max": float(x.max())}
            out[f"{r}/{L}"] = {"hit": r, "length": L, "prefix_tokens": prefix, "ttft_s": rows, "median_s": med,
                           "store_over_local": paired("store"), "tcp_over_local": paired("store_tcp"),
                           "serial_over_local": paired("store_serial"), "cold_over_local": paired("cold"),
                           "load_s_median": {k: float(np.median([m["seconds"] for m in v])) for k, v in moved.items()},
                           # the TTFT split: to the decode reservation (the store's Load runs beside it), and after
                           "placed_s_median": {k: float(np.median(v)) for k, v in placed.items()},
                           "after_placed_s_median": {k: float(np.median(np.subtract(rows[k], v)))
                                                     for k, v in placed.items()},
                           "load_kv_bytes": moved["store"][0]["kv_bytes"]}
        bar.close()
        return out

    t0 = time.monotonic()
    by = run(config(path, max(lengths)), go)
    result = {"benchmark": "store", "host": platform.node(), "wall_s": time.monotonic() - t0,
              "what": "TTFT (median of --reps; ratios: per repetition against local, median and quartiles) of "
                      "one-token requests whose prefix is in the prefill instance's own "
                      "cache (local), comes from the global KV store's shared pool on the same host (store), over "
                      "the transfer layer while the prefill runs (store_tcp) or before it (store_serial), or is "
                      "cached nowhere (cold); "
                      "bench-size llama, real worker processes, 2 cores",
              "by_hit_and_length": by}
    from bench.stamp import write
    write(a.json, result)
    for r in by.values():
        m = r["median_s"]
        q = {k: f"{r[k]['median']:.2f}x [{r[k]['p25']:.2f}-{r[k]['p75']:.2f}]"
             for k in ("store_over_local", "tcp_over_local", "serial_over_local", "cold_over_local")}
        print(f"r {r['hit']:.2f} L {r['length']:>5d} (prefix {r['prefix_tokens']}, {r['load_kv_bytes'] / 1e6:.2f} MB): "
              f"TTFT local {1e3 * m['local']:.1f} ms, store shared pool {1e3 * m['store']:.1f} ms "
              f"({q['store_over_local']}), store over TCP pipelined {1e3 * m['store_tcp']:.1f} ms "
              f"({q['tcp_over_local']}), loaded first {1e3 * m['store_serial']:.1f} ms "
              f"({q['serial_over_local']}), cold {1e3 * m['cold']:.1f} ms ({q['cold_over_local']}); "
              f"to the reservation / after it: local {1e3 * r['placed_s_median']['local']:.1f} / "
              f"{1e3 * r['after_placed_s_median']['local']:.1f} ms, store shared pool "
              f"{1e3 * r['placed_s_median']['store']:.1f} / {1e3 * r['after_placed_s_median']['store']:.1f} ms")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
