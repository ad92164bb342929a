"""bench.report's sections of disaggregated and clustered serving: the KV transfer, interference, KV footprints,
PrfaaS live and simulated, the simulator against the live system, load balancing, the global KV store, migration,
the fault matrix and the soak. Each renderer takes {result file: its dict} and returns markdown lines."""

from __future__ import annotations

from bench.report_md import Headline, Section, median, ms, num, pct, sig, spread, table

TRANSFER_CPU = (("raw sockets", "raw"), ("raw sockets + the link's checksum", "raw_checksum"), ("KV link (TCP)", "kv"),
                ("KV link over mutual TLS", "kv_tls"), ("device backend (JAX transfer server)", "device"),
                ("device backend (CUDA IPC)", "cuda_ipc"))


def _ipc_cell(e: dict) -> str:
    """CUDA IPC's GB/s and the device's own copy rate beside it, where a GPU measured them."""
    ipc, copy = e.get("cuda_ipc", {}), e.get("device_copy")
    if "bytes_per_s_median" not in ipc:
        return "-"
    return f"{ipc['bytes_per_s_median'] / 1e9:.1f} / {copy['bytes_per_s_median'] / 1e9:.1f}"


def transfer(r: dict[str, dict]) -> list[str]:
    out = []
    rows = []
    for name, d in r.items():
        if "efficiency" not in d:
            continue
        e = d["efficiency"]
        ratios = [k / w for k, w in zip(e["kv_bytes_per_s"], e["raw_bytes_per_s"])]
        rows.append([f"`{name}`", f"{e['bytes'] / 2 ** 20:.0f} MiB over {e['connections']}",
                     f"{e['kv_bytes_per_s_median'] / 1e9:.2f}", f"{e['raw_bytes_per_s_median'] / 1e9:.2f}",
                     f"**{e['efficiency']:.2f}** ({min(ratios):.2f}-{max(ratios):.2f})", f"{e['goal']:.2f}",
                     f"{e['device_backend']['bytes_per_s_median'] / 1e9:.2f}" if "device_backend" in e else "-",
                     _ipc_cell(e), f"{e['tls']['bytes_per_s_median'] / 1e9:.2f}" if "tls" in e else "-"])
    out += ["(a) Efficiency: a KV transfer between two processes against raw sockets moving the same bytes, "
            f"medians of the repetitions (GB/s):", ""]
    out += table(["result", "transfer", "KV link", "raw sockets", "KV / raw (range per repetition)", "goal",
                  "device backend", "CUDA IPC / device copy", "KV link over mutual TLS"], rows)
    d = r.get("transfer.json")
    if d is None:
        return out
    cpu = d["efficiency"]["cpu_s_per_gb"]
    out += ["CPU seconds per GB moved (`transfer.json`):", ""]
    out += table(["transfer", "sender", "receiver", "total"],
                 [[label, *(f"{cpu[k][s]:.3f}" for s in ("sender", "receiver", "total"))] for label, k in TRANSFER_CPU
                  if k in cpu])
    s = d["sends_per_request"]
    out += [f"(b) Sends per request, on block lists from the real block managers under churn ({s['requests']} "
            f"requests, {s['layers']} layers): {num(s['per_block_per_layer_sends_mean'])} per block per layer -> "
            f"{s['aligned_sends_mean']:.2f} aligned runs (at most {s['aligned_sends_max']}).", ""]
    for name, other in r.items():
        if "ttft" in other:
            out += _ttft(name, other["ttft"])
    p = d["phi_kv"]
    lengths = [str(n) for n in d["ttft"]["lengths"]]  # (d) measured at (c)'s lengths
    out += [f"(d) Phi_kv(l) = S_kv(l) / T_prefill(l) per family, {p['dtype']}, MB/s (the KV link: "
            f"{p['link_bytes_per_s'] / 1e9:.2f} GB/s):", ""]
    out += table(["family"] + lengths, [[fam, *(num(f["by_length"][n]["phi_kv_bytes_per_s"] / 1e6, 1) for n in lengths)]
                                         for fam, f in p["families"].items()])
    return out


def _ttft(name: str, t: dict) -> list[str]:
    """Part (c) of one result file: TTFT and the second token's time per setup and prompt length."""
    lengths = [str(n) for n in t["lengths"]]
    whole = max(t["lengths"])
    chunks = ("" if t.get("chunk_size", whole) >= whole else
              f", prompts prefilled in chunks of {t['chunk_size']} tokens (the KV of a chunk's whole blocks leaves as "
              "the next chunks compute)")
    out = [f"(c) TTFT and the second token's time, disaggregated against colocated through the router (`{name}`"
           f"{chunks}; median of {t['reps']} per length, ms; overhead over colocated):", ""]
    rows = []
    for key, c in t["setups"].items():
        cells = []
        for f, over in (("ttft_s_median", "overhead"), ("second_token_s_median", "second_token_overhead")):
            for n in lengths:
                x = 100 * c[over][n] if over in c else None
                cells.append(ms(c[f][n]) + ("" if x is None else f" ({x:+.0f}%)" if abs(x) >= 10 else f" ({x:+.1f}%)"))
        rows.append([_setup(key, c, bool(chunks))] + cells)
    return out + table(["setup"] + [f"TTFT {n}" for n in lengths] + [f"2nd token {n}" for n in lengths], rows)


def _setup(key: str, c: dict, chunked: bool = False) -> str:
    where = f"emulated {c['link_gbps']} Gb/s link" if c.get("link_gbps") else "shared memory"
    if key == "colocated":
        return "colocated"
    if c.get("layers_per_group"):
        how = f"layer groups of {c['layers_per_group']}" + (" in the last chunk" if chunked else "")
    else:
        how = "sent after each chunk" if chunked else "sent after prefill"
    return f"disaggregated, {where}, {how}"


def interference(r: dict[str, dict]) -> list[str]:
    d = r["interference.json"]
    w = d["workload"]
    out = [f"{w['decodes']} requests decode {w['decode_tokens']} tokens each while {w['prefills']} prompts of "
           f"{w['prefill_len']} tokens arrive {w['gap']} s apart.", ""]
    out += table(["setup", "TPOT p50 (ms)", "TPOT p99 (ms)", "prefill TTFT, median (ms)"],
                 [[k, ms(s["tpot_p50_s"], 1), ms(s["tpot_p99_s"], 1), ms(s["prefill_ttft_median_s"])]
                  for k, s in d["setups"].items()])
    return out + [f"p99 TPOT colocated / disaggregated: **{d['p99_tpot_ratio']:.1f}x** (goal {d['goal']:g}x).", ""]


def update_streams(r: dict[str, dict]) -> list[str]:
    d = r["update_streams.json"]
    def pair(x: dict, key: str) -> str:
        return f"{x['per_request'][key]:.2f} / {x['one_stream'][key]:.2f}"
    rows = [[x["requests"], pair(x, "worker_cpu_ms_per_step"), f"{x['worker_cpu_ratio']:.2f}x",
             pair(x, "worker_wall_ms_per_step"), pair(x, "router_cpu_ms_per_step"), f"{x['router_cpu_ratio']:.2f}x"]
            for x in d["rounds"]]
    return [f"{d['steps']} steps of {d['step_ms']:g} ms; each pair: a stream per request / one Updates stream per "
            "worker.", ""] + table(
        ["requests", "worker CPU ms a step", "one stream / per request", "worker wall ms a step",
         "router CPU ms a step", "one stream / per request"], rows)


def kv_footprint(r: dict[str, dict]) -> list[str]:
    d = r["kv_footprint.json"]
    names = {1024: "1K", 8192: "8K", 32768: "32K", 131072: "128K"}
    head = ["model", *(names.get(n, str(n)) for n in d["lengths"]),
            f"smaller than {' / '.join(d['dense_baseline'])} at 32K"]
    rows = [[f"{m} ({v['model_type']})", *(num(v["kv_bytes"][str(n)] / 2 ** 20, 1) for n in d["lengths"]),
             " / ".join(f"{v['ratio_vs_dense'][b]['32768']:.1f}x" for b in d["dense_baseline"])]
            for m, v in d["models"].items()]
    return [f"KV MiB per request after a prefill of L tokens, {d['dtype']}:", ""] + table(head, rows)


PRFAAS_POLICIES = {"never": "never offload (all on the PD cluster)", "always": "always offload (naive heterogeneous)",
                   "selective": "selective (threshold, adaptive)"}


def prfaas_live(r: dict[str, dict]) -> list[str]:
    out = []
    d = r.get("prfaas_live.json")
    if d:
        a, c = d["args"], d["calibration"]
        out += [f"The PD cluster's capacity, measured first: {c['capacity_rps']:.2f} req/s; offered {a['load']}x it "
                f"({c['rate']:.2f} conversations/s) for {a['duration']} s per policy; link {a['bandwidth_gbps']} "
                f"Gbit/s; goodput: requests/s whose TTFT met {a['slo_ttft']:g} s; threshold {a['threshold']}.", ""]
        rows = []
        for key, p in d["policies"].items():
            routes = " / ".join(str(p["routes"].get(x, 0)) for x in ("pd", "prfaas", "colocated"))
            rows.append([PRFAAS_POLICIES.get(key, key), f"{p['throughput_rps']:.2f}", f"{p['goodput_rps']:.2f}",
                         pct(p["slo_attainment"]), f"{sig(p['ttft_p50_s'])} / {sig(p['ttft_p90_s'])}", routes,
                         f"{p['failed']} of {p['requests']}"])
        out += table(["policy", "requests/s", "goodput (req/s)", "SLO met", "TTFT p50 / p90 (s)",
                      "routes (pd / prfaas / colocated)", "failed"], rows)
        out += ["![PrfaaS live](../bench/results/prfaas_live.png)", ""]
    d = r.get("prfaas_live_drop.json")
    if d:
        a = d["args"]
        out += [f"The bandwidth drop (`prfaas_live_drop.json`): the link falls to {a['bandwidth_gbps']} Gbit/s mid-run "
                f"at {a['rate']} conversations/s; p90 over the minute after the drop, each run:", ""]
        rows = []
        for key, v in d["verdict_drop"].items():
            runs = d["bandwidth_drop"][key]
            rows.append([{"fixed": "fixed threshold", "selective": "adaptive threshold"}.get(key, key),
                         " / ".join(f"{x:.1f}" for x in v["tt2t_p90_after_s"]),
                         " / ".join(f"{x:.2f}" for x in v["ttft_p90_after_s"]),
                         " / ".join(str(run["after"]["routes"].get("prfaas", 0)) for run in runs),
                         " / ".join(str(run["after"]["failed"]) for run in runs)])
        out += table(["threshold", "time to 2nd token (s)", "TTFT (s)", "offloaded after the drop", "failed"], rows)
        out += ["![PrfaaS bandwidth drop](../bench/results/prfaas_live_drop.png)", ""]
    return out


def prfaas_sim(r: dict[str, dict]) -> list[str]:
    d = r["prfaas_sim.json"]
    rows = []
    for key, c in d["case"].items():
        t, paper = c["sim_ttft_at_1_5_rps"], c["paper"]
        rows.append([key, f"{paper['lambda_max']:.2f}", f"{c['planner_lambda_max']:.2f}",
                     f"{c['sim_throughput_rps']:.2f}",
                     f"{t['mean']:.2f} / {t['p90']:.2f} ({paper['ttft_mean_s']:.2f} / {paper['ttft_p90_s']:.2f})"])
    out = table(["case study (4 PrfaaS + 8 PD, 100 Gbit/s)", "the document (req/s)", "planner", "simulated",
                 "TTFT mean / p90 at 1.5 req/s, simulated (the document's) (s)"], rows)
    b, dr, sh, sc = d["bursts"], d["drop"], d["shift"], d["scale"]
    out += [f"- Bursts ({b['rate']} req/s, {b['burst']}): TTFT p50 / p90 / p99 {b['ttft_s']['p50']:.1f} / "
            f"{b['ttft_s']['p90']:.1f} / {b['ttft_s']['p99']:.1f} s.",
            f"- The link halving: KV-ready p90 after the drop {dr['fixed']['kv_ready_p90_after_drop_s']:.0f} s with "
            f"the fixed threshold, {dr['adaptive']['kv_ready_p90_after_drop_s']:.0f} s with the adaptive one (TTFT p90 "
            f"{dr['fixed']['ttft_s']['p90']:.1f} against {dr['adaptive']['ttft_s']['p90']:.1f} s).",
            f"- A traffic-mix shift: the static split serves {sh['static']['throughput_rps']:.2f} req/s (TTFT p90 "
            f"{sh['static']['ttft_s']['p90']:.0f} s), long-term re-planning {sh['replan']['throughput_rps']:.2f} req/s "
            f"(TTFT p90 {sh['replan']['ttft_s']['p90']:.0f} s, {len(sh['replan']['flips'])} flips).",
            f"- Scale: {sc['cells']} cells, {num(sc['accelerators'])} accelerators, {sc['traffic_s'] / 3600:g} h of "
            f"traffic: {num(sc['requests'])} requests, {num(sc['events'])} events, {num(sc['wall_s'])} s of wall time, "
            f"{sc['failed']} failed.", "", "![PrfaaS simulated](../bench/results/prfaas_sim.png)", ""]
    return out


def sim_validate(r: dict[str, dict]) -> list[str]:
    d = r["sim_validate.json"]
    live, sim, drawn = d["live"], d["simulated"], d["simulated_drawn"]
    ratio, ratio_drawn = d["ratio_sim_over_live"], d["ratio_drawn_over_live"]
    rows = [["throughput (req/s)", f"{live['throughput_rps']:.3f}", f"{sim['throughput_rps']:.3f}",
             f"{ratio['throughput']:.2f}", f"{drawn['throughput_rps']:.3f}", f"{ratio_drawn['throughput']:.2f}"]]
    for p in ("p50", "p90"):
        rows.append([f"TTFT {p} (ms)", ms(live[f"ttft_{p}_s"]), ms(sim["ttft_s"][p]), f"{ratio[f'ttft_{p}']:.2f}",
                     ms(drawn["ttft_s"][p]), f"{ratio_drawn[f'ttft_{p}']:.2f}"])
    for route in live["ttft_by_route"]:
        def by_route(s: dict) -> str:
            r = s["ttft_by_route"][route]
            return f"{ms(r['p50_s'])} / {ms(r['p90_s'])}"
        rows.append([f"TTFT p50 / p90, {route} (ms)", by_route(live), by_route(sim), "", by_route(drawn), ""])
    within = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in d["within_15_percent"].items())
    return table(["", "live", "replayed", "replayed / live", "drawn (an hour)", "drawn / live"], rows) + [
        f"Replayed within 15% of live: {within}.", ""]


BALANCE = {"cache_aware_sglang": "cache_aware (sglang)", "cache_aware_dynamo": "cache_aware (dynamo)",
           "banaserve_no_store": "banaserve, no store", "banaserve_store": "banaserve over the store",
           "banaserve_store_tcp": "banaserve over the store (transfer layer)"}


def balance(r: dict[str, dict]) -> list[str]:
    d = r["balance.json"]
    out = []
    for part in ("hot", "scale"):
        h = d[part]
        inst = h["instances"]
        out += [f"Simulated ({part}): {inst['prefill']} prefill + {inst['decode']} decode instances, {h['prefixes']} "
                f"hot prefixes of {num(h['prefix_tokens'])} tokens:", ""]
        rows = []
        for rate, by in h["by_rate"].items():
            for key, p in by.items():
                rows.append([f"{float(rate):g}", BALANCE.get(key, key), f"{p['throughput_rps']:.2f}",
                             f"{p['ttft_s']['p50']:.3f} / {p['ttft_s']['p90']:.3f}",
                             f"{p['utilisation_max_over_min']:.2f}"])
        out += table(["req/s", "policy", "served (req/s)", "TTFT p50 / p90 (s)", "prefill utilisation max / min"], rows)
    s = d["shift"]
    out += ["Under a traffic-mix shift (simulated): " + "; ".join(
        f"{k.replace('_', ' ')} {v['throughput_rps']:.2f} req/s, TTFT p90 {v['ttft_s']['p90']:.0f} s, "
        f"{len(v['flips'])} flips" for k, v in s.items() if isinstance(v, dict) and "throughput_rps" in v) + ".", ""]
    lv = d["live"]
    out += [f"Live ({lv['rate']} req/s for {lv['duration_s']} s, the same arrivals for each policy):", ""]
    rows = []
    for key, p in lv["by_policy"].items():
        inst = sorted(p["busy_mean"])
        rows.append([BALANCE.get(key, key), f"{p['throughput_rps']:.2f}", f"{ms(p['ttft_s']['p50'])} / "
                     f"{ms(p['ttft_s']['p90'])}", " / ".join(f"{p['busy_mean'][i]:.2f}" for i in inst),
                     " / ".join(str(p["per_instance_requests"].get(i, 0)) for i in inst), p["failed"]])
    out += table(["policy", "served (req/s)", "TTFT p50 / p90 (ms)", "prefill busy fraction", "requests per prefill "
                  "instance", "failed"], rows)
    return out + ["![Load balancing](../bench/results/balance.png)", ""]


def store(r: dict[str, dict]) -> list[str]:
    d = r["store.json"]
    rows = []
    for c in d["by_hit_and_length"].values():
        m = c["median_s"]
        cell = lambda k, rk: f"{ms(m[k])} ms, {spread(c[rk], low='p25', high='p75')}"  # noqa: E731
        rows.append([f"{c['hit']} / {num(c['length'])}", f"{ms(m['local'])} ms", cell("store", "store_over_local"),
                     cell("store_tcp", "tcp_over_local"), cell("store_serial", "serial_over_local"),
                     f"{ms(m['cold'])} ms"])
    return ["TTFT of one-token requests, medians; the ratio to the prefix in the instance's own cache taken per "
            "repetition (median and quartiles):", ""] + table(
        ["prefix share / prompt tokens", "prefix in the instance's cache", "from the store's shared pool",
         "from the store over TCP, pipelined", "over TCP, loaded first", "nothing cached"], rows)


def migration(r: dict[str, dict]) -> list[str]:
    d = r["migration.json"]
    rows = []
    for length, c in d["by_length"].items():
        move = lambda k: (f"{median(c[k]['move_bytes']) / 1e6:.1f} MB in {ms(median(c[k]['move_s']))} ms")  # noqa
        rows.append([f"{num(int(length))} tokens", f"{ms(c['none']['tpot_median_s'], 1)} ms",
                     f"{ms(c['heads']['tpot_median_s'], 1)} ms ({c['heads']['over_none']:.1f}x)",
                     f"{ms(c['layers']['tpot_median_s'], 1)} ms ({c['layers']['over_none']:.1f}x)",
                     f"{move('heads')} / {move('layers')}"])
    return ["TPOT after the move against no move (medians), and the move itself:", ""] + table(
        ["prompt", "no move", "KV heads on the helper", "layers on the helper", "move (heads / layers)"], rows)


FAULTS = {"sigkill": "SIGKILL", "sigstop_10s": "SIGSTOP 10 s", "sigstop": "SIGSTOP forever",
          "partition": "partition (veth down)", "corrupt": "corrupting link (10 s)"}


def faults(r: dict[str, dict]) -> list[str]:
    out = []
    for name, d in r.items():
        s, t = d["settings"], d["totals"]
        phases = s["phases"].split(",")
        out += [f"`{name}`: {s['requests']} greedy requests per cell, {s['concurrency']} at a time, compared token by "
                f"token with the colocated engine. Totals: {num(t['requests'])} requests, {num(t['token_exact'])} "
                f"token-exact, {t['near_ties']} near ties, {t['wrong_tokens']} wrong, {t['failed']} failed, "
                f"{t['hung']} hung, {t['leaked_blocks']} blocks and {t['leaked_pool_bytes']} pool bytes held after; "
                f"{t.get('compiled_during_cells', 0)} programs compiled during a cell; "
                f"{t.get('served_whole_on_decode', 0)} requests served whole on a decode instance.", ""]
        rows = []
        for role, fault in dict.fromkeys((c["role"], c["fault"]) for c in d["cells"]):
            by = {c["phase"]: c for c in d["cells"] if (c["role"], c["fault"]) == (role, fault)}
            ph = [p for p in phases if p in by]
            rows.append([role, FAULTS.get(fault, fault), " / ".join(str(by[p]["token_exact"]) for p in ph),
                         sum(by[p]["failed"] for p in ph), sum(by[p]["hung"] for p in ph),
                         ", ".join(f"{by[p]['recover_p50_s']:.1f}/{by[p]['recover_p99_s']:.1f}" for p in ph),
                         f"{sum(by[p]['leaked_blocks'] for p in ph)} / {sum(by[p]['leaked_pool_bytes'] for p in ph)}"])
        out += table(["victim", "fault", f"token-exact per phase ({' / '.join(phases)})", "failed", "hung",
                      "recovery p50/p99 (s), per phase", "leaked blocks / pool bytes"], rows)
        st = d.get("cancellation_storm") or {}
        if st.get("requests"):
            leaked = sum(v for v in st["leaked"].values())
            out += [f"Cancellation storm: {st['requests']} requests abandoned at random moments ("
                    + ", ".join(f"{v} in {k}" for k, v in st["aborted_in"].items())
                    + f"); the longest reservation lived {st['longest_reservation_s']:.2f} s; held afterwards: "
                    f"{leaked}.",
                    ""]
    return out


def soak(r: dict[str, dict]) -> list[str]:
    d = r["soak.json"]
    lo, cap = d["locust"], d["capacity"]
    rows = []
    for proc, s in d["slopes"].items():
        rss, th, fds = s["rss_mb"], s["threads"], s["fds"]
        rows.append([proc, f"{rss['start']:.0f} -> {rss['end']:.0f}", f"{rss['slope_per_hour']:+.0f}",
                     f"{th['start']} -> {th['end']}", f"{fds['end']} ({fds['after']} after the load)"])
    return [f"Capacity {cap['requests_per_s']:.1f} req/s (closed loop, {cap['concurrency']} at a time); then "
            f"{d['duration_s']:.0f} s of Poisson load at {pct(d['utilisation'])} of it: {lo['requests_per_s']:.1f} "
            f"req/s sent of {d['rate_requests_per_s']:.1f} asked, {num(lo['requests'])} requests, {lo['failures']} "
            f"failed, latency p50 / p99 {lo['latency_s']['50']:.2f} / {lo['latency_s']['99']:.2f} s; free blocks "
            f"{num(d['blocks']['baseline_free'])} before, {num(d['blocks']['end_free'])} after.", ""] + table(
        ["process", "resident MB over the settled load", "slope MB/h", "threads", "file descriptors"], rows) + [
        "![Soak](../bench/results/soak.png)", ""]


SECTIONS = [
    Section("KV transfer", "bench.transfer", ("transfer.json", "transfer_tls.json", "transfer_h200.json",
                                              "transfer_chunked.json"), transfer),
    Section("Prefill/decode interference", "bench.interference", ("interference.json",), interference),
    Section("Requests' updates from a worker to the router", "bench.update_streams", ("update_streams.json",),
            update_streams),
    Section("KV footprint by architecture", "bench.kv_footprint", ("kv_footprint.json",), kv_footprint),
    Section("PrfaaS live", "bench.prfaas_live", ("prfaas_live.json", "prfaas_live_drop.json"), prfaas_live),
    Section("PrfaaS at datacenter scale, simulated", "bench.prfaas_sim", ("prfaas_sim.json",), prfaas_sim),
    Section("The simulator against the live system", "bench.sim_validate", ("sim_validate.json",), sim_validate),
    Section("Load balancing", "bench.balance", ("balance.json",), balance),
    Section("Global KV store", "bench.store", ("store.json",), store),
    Section("Migration", "bench.migration", ("migration.json",), migration),
    Section("Fault matrix", "bench.faults", ("faults.json", "faults_decode_sigstop.json",
                                             "faults_prefill_sigkill.json"), faults),
    Section("Soak", "bench.soak", ("soak.json",), soak),
]

HEADLINES = [
    Headline("KV transfer between processes / raw sockets (256 MiB, 4 TCP connections)", "transfer.json",
             lambda d: f"{d['efficiency']['efficiency']:.2f}", "KV transfer"),
    Headline("p99 TPOT colocated / disaggregated, long prefills arriving", "interference.json",
             lambda d: f"{d['p99_tpot_ratio']:.1f}x", "Prefill/decode interference"),
    Headline("PrfaaS selective offload: goodput over never-offload", "prfaas_live.json",
             lambda d: f"{d['verdict']['selective_goodput_over_never']:.1f}x", "PrfaaS live"),
    Headline("fault matrix: token-exact answers with workers killed, stopped, partitioned", "faults.json",
             lambda d: f"{num(d['totals']['token_exact'])} / {num(d['totals']['requests'])}", "Fault matrix"),
    Headline("KV transfer between processes / raw sockets, on the GPU machine", "transfer_h200.json",
             lambda d: f"{d['efficiency']['efficiency']:.2f}", "KV transfer"),
]
