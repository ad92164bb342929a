"""Migration live: what a move costs (bytes, seconds) and what the source's decode steps cost afterwards, with
the KV of half the KV heads (attention-level) or half the layers (layer-level) on a helper instance, against
the same requests without a move.

Cluster (real worker processes, the bench-size llama of bench/families.py: 8 layers, 4 KV heads): prefill p0
and the helper d1 on core 0, the source d0 on core 1. Per prompt length L and repetition, N requests of L
random tokens and 64 greedy output tokens each are prefilled on p0 and decode on d0; once every one has 4
tokens, the move (POST /admin/migrate's Router.migrate: heads [2, 3] or layers [4, 8]) is made, and the time per
output token (TPOT) is taken over the tokens after it (for `none`, after the same point). The answers must be
the ones without a move. On two shared cores this measures the overhead of the split step (a gRPC round trip
per full-attention layer for heads, per step for layers, and the helper's part), not a relief: the source
still computes the rest, and the helper shares its core with the prefill instance.

    python -m bench.migration --json bench/results/migration.json
"""

from __future__ import annotations

import asyncio
import platform
import time

import numpy as np

from bench.clusters import finish, run

MOVES = {"none": None, "heads": {"heads": [2, 3]}, "layers": {"layers": [4, 8]}}


def config(path: str, max_len: int) -> dict:
    return {"model": {"path": path, "name": "bench"},
            "engine": dict(block_size=16, num_blocks=1024, max_num_seqs=8, max_num_batched_tokens=512,
                           chunk_size=256, max_prefill_seqs=4, max_model_len=max_len + 128, warmup=True),
            "clusters": [{"name": "pd", "instances": [
                {"name": "p0", "role": "prefill", "cpus": [0]}, {"name": "d1", "role": "decode", "cpus": [0]},
                {"name": "d0", "role": "decode", "cpus": [1]}]}],
            "transfer": {"token": "bench-migration", "layers_per_group": 4, "deadline_s": 60},
            "router": {"heartbeat_s": 0.25, "down_after_s": 10.0, "busy_wait_s": 60},
            "server": {"request_timeout_s": 600}}


class Pinned:
    """Prefill on p0, decode on d0."""
    name = "pinned"

    def state(self) -> dict:
        return {}

    def place(self, snap):
        from jaxserve.router.policies.base import Placement
        return Placement("d0", "p0", "pd", "bench: pinned", None, snap.request.prompt_tokens, None)


def main(argv=None):
    from bench.stamp import arguments
    ap = arguments(__doc__)
    ap.add_argument("--lengths", default="256,1024")
    ap.add_argument("--requests", type=int, default=4, help="requests decoding together")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", default="bench/.models", help="where bench-size checkpoints are built")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    from bench.families import checkpoint
    from jaxserve.sampling import SamplingParams
    from tqdm import tqdm
    path = checkpoint("llama", a.models)
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(0)

    async def go(cluster):
        cluster.policy = Pinned()
        out = {}
        bar = tqdm(total=len(lengths) * len(MOVES) * a.reps, desc="migration", unit="run")

        async def batch(tag, prompts, move):
            seen: dict[int, list] = {i: [] for i in range(len(prompts))}
            started = asyncio.Event()

            def watch(i):
                def on(u):
                    seen[i].append((time.monotonic(), len(u.token_ids)))
                    if all(s and s[-1][1] >= 4 for s in seen.values()):
                        started.set()
                return on
            qs = [await cluster.add(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
            tasks = [asyncio.create_task(finish(q, watch(i))) for i, q in enumerate(qs)]
            await started.wait()
            ans = await cluster.migrate(*move[0], **move[1]) if move else None
            t0 = time.monotonic()
            finals = await asyncio.gather(*tasks)
            tpot = []
            for s in seen.values():
                after = [(t, n) for t, n in s if t >= t0]
                if len(after) >= 2 and after[-1][1] > after[0][1]:
                    tpot.append((after[-1][0] - after[0][0]) / (after[-1][1] - after[0][1]))
            return [u.token_ids for u in finals], float(np.median(tpot)), ans, [u.migrations for u in finals]

        await batch("warm", [[int(x) for x in rng.integers(1, 1000, 64)]] * 2, None)
        for L in lengths:
            cell = {}
            for rep in range(a.reps):
                prompts = [[int(x) for x in rng.integers(1, 1000, L)] for _ in range(a.requests)]
                base = None
                for kind, arg in MOVES.items():
                    move = None if arg is None else ((kind, "d0", "d1"), arg)
                    toks, tpot, ans, moves = await batch(f"L{L}-{rep}-{kind}", prompts, move)
                    if base is None:
                        base = toks
                    elif toks != base:
                        raise RuntimeError(f"{kind}: the answers changed with the move")
                    if arg is not None and not all(m and m[0]["kind"] == kind for m in moves):
                        raise RuntimeError(f"{kind}: a request does not list its move: {moves}")
                    c = cell.setdefault(kind, {"tpot_s": [], "move_s": [], "move_bytes": []})
                    c["tpot_s"].append(tpot)
                    if ans:
                        c["move_s"].append(ans["seconds"])
                        c["move_bytes"].append(ans["bytes"])
                    bar.update()
            for kind, c in cell.items():
                c["tpot_median_s"] = float(np.median(c["tpot_s"]))
                c["over_none"] = c["tpot_median_s"] / float(np.median(cell["none"]["tpot_s"]))
            out[str(L)] = cell
        bar.close()
        return out

    t0 = time.monotonic()
    by = run(config(path, max(lengths)), go)
    result = {"benchmark": "migration", "host": platform.node(), "wall_s": time.monotonic() - t0,
              "what": f"decode TPOT on the source after moving the KV of half the KV heads or half the layers of "
                      f"{a.requests} running requests to a helper (median of --reps, each the median over the "
                      f"requests), against no move; the move's bytes and seconds; bench-size llama, real worker "
                      f"processes, 2 cores",
              "by_length": by}
    from bench.stamp import write
    write(a.json, result)
    for L, cell in by.items():
        for kind, c in cell.items():
            extra = (f", move {np.median(c['move_bytes']) / 1e6:.2f} MB in {1e3 * np.median(c['move_s']):.0f} ms"
                     if c["move_s"] else "")
            print(f"L {L:>5}: {kind:6s} TPOT {1e3 * c['tpot_median_s']:.1f} ms ({c['over_none']:.2f}x){extra}")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
