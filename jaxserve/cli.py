"""The `jaxserve` command line's engine-level commands and `validate` (a config checked, nothing started);
router/cli.py adds `serve` (the console script)."""

from __future__ import annotations

import json
import sys

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="jaxserve: JAX LLM serving")


@app.command()
def convert(hf_dir: str = typer.Argument(..., help="Hugging Face checkpoint directory"),
            out_dir: str = typer.Argument(..., help="output directory (new or empty)"),
            dtype: str = typer.Option("bfloat16", help="float32 | bfloat16")):
    """Convert a Hugging Face safetensors checkpoint to an Orbax checkpoint."""
    from .checkpoint import convert as _convert
    from .models.config import ConfigError, load_config
    from .models.safetensors_io import CheckpointError
    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter("must be float32 or bfloat16", param_hint="--dtype")
    try:
        _convert(hf_dir, out_dir, load_config(hf_dir), dtype)
    except (ConfigError, CheckpointError, FileNotFoundError, FileExistsError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {out_dir}")


@app.command()
def generate(model: str = typer.Argument(..., help="checkpoint directory (Hugging Face or Orbax)"),
             prompt: str = typer.Option(None, help="text prompt (needs tokenizer.json)"),
             token_ids: str = typer.Option(None, help="comma-separated token ids instead of text"),
             max_tokens: int = 32, temperature: float = 0.0, seed: int = 0,
             dtype: str = typer.Option("auto", help="auto (float32 on a CPU, bfloat16 on an accelerator) | float32 "
                                                    "| bfloat16")):
    """Generate a completion from the terminal."""
    from . import LLM, SamplingParams
    if (prompt is None) == (token_ids is None):
        raise typer.BadParameter("give exactly one of --prompt or --token-ids")
    llm = LLM(model, dtype=dtype)
    p = [int(t) for t in token_ids.split(",")] if token_ids else prompt
    out = llm.generate([p], SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed))[0]
    json.dump({"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason}, sys.stdout)
    sys.stdout.write("\n")


@app.command()
def worker(config: str = typer.Option(None, "--config", "-c", help="cluster YAML (default: the embedded local.yaml)"),
           instance: str = typer.Option(..., "--instance", help="the instance of the config this process runs"),
           router: str = typer.Option(None, "--router", help="HOST:PORT of the router's control port to join"),
           advertise: str = typer.Option(None, "--advertise", help="the host other processes dial for this worker "
                                         "(its pod's IP), where instance.host is a wildcard address"),
           coordinator: str = typer.Option(None, "--coordinator", help="multi-host instance: HOST:PORT of its "
                                           "first process's jax.distributed coordinator (default: the "
                                           "LeaderWorkerSet's LWS_* variables)"),
           num_processes: int = typer.Option(None, "--num-processes", help="multi-host instance: its processes"),
           process_id: int = typer.Option(None, "--process-id", help="multi-host instance: this process's index "
                                          "(0: the leader, which serves; the others follow it)"),
           parent_pid: int = typer.Option(None, "--parent-pid", hidden=True,
                                          help="exit when this process (the launching router) dies")):
    """Run one instance of a cluster (prefill, decode or both) as this process, controlled over gRPC; or one
    process of a multi-host instance (instance.hosts > 1)."""
    from jaxserve.transfer.bufpool import ShmFull
    from .config import ConfigFileError, load
    from .worker.group import resolve
    from .worker.process import run
    try:
        cfg = load(config)
        group = resolve(cfg.instance(instance), coordinator, num_processes, process_id)
        run(cfg, instance, router, parent_pid, advertise, group)
    except ConfigFileError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2)
    except ShmFull as e:
        typer.echo(f"shared memory: {e.strerror}", err=True)
        raise typer.Exit(2)


@app.command()
def profile(config: str = typer.Option(None, "--config", "-c", help="cluster YAML (default: the embedded local.yaml)"),
            instance: str = typer.Option(..., "--instance", help="the instance of the config to measure"),
            json_out: str = typer.Option(..., "--json", help="write the profile here"),
            lengths: str = typer.Option(None, help="prompt lengths, comma-separated (default 16, 32, ... below "
                                                   "max_model_len)"),
            batches: str = typer.Option(None, help="decode batch sizes (default 1, 2, 4, ... max_num_seqs)"),
            tpot_slo_ms: float = typer.Option(100.0, "--tpot-slo-ms", help="the decode step SLO for max_batch"),
            reps: int = typer.Option(3, help="timed prefills per length (median), at least"),
            min_seconds: float = typer.Option(0.5, "--min-seconds", help="more timed prefills of a length until "
                                              "they have taken this many seconds of wall time (short prompts: "
                                              "many runs)"),
            decode_steps: int = typer.Option(16, "--decode-steps", help="timed decode steps per batch size"),
            prefix_new_tokens: int = typer.Option(32, "--prefix-new-tokens",
                                                  help="new tokens behind each cached prefix timed")):
    """Measure one instance on its real programs in the planner's profile format (jaxserve plan --prfaas/--pd)."""
    from .config import ConfigFileError, load
    from .profiler import profile as _profile
    ints = lambda s: [int(x) for x in s.split(",")] if s else None  # noqa: E731
    try:
        out = _profile(load(config), instance, ints(lengths), ints(batches), tpot_slo_ms / 1e3, reps, decode_steps,
                       prefix_new_tokens=prefix_new_tokens, min_seconds=min_seconds)
    except (ConfigFileError, ValueError) as e:
        typer.echo(f"profile error: {e}", err=True)
        raise typer.Exit(2)
    with open(json_out, "w") as f:
        json.dump(out, f, indent=1)
    d = out["decode"]
    typer.echo(f"prefill {dict(zip(out['prefill']['tokens'], (round(s, 4) for s in out['prefill']['seconds'])))} s; "
               f"decode max_batch {d['max_batch']} at {d['step_seconds'] * 1e3:.1f} ms a step "
               f"(SLO {tpot_slo_ms:g} ms); wrote {json_out}")


@app.command()
def validate(config: str = typer.Option(None, "--config", "-c",
                                        help="cluster YAML (default: the embedded local.yaml)")):
    """Check a config without starting anything: every key, the rules between keys and the cluster token's exposure;
    print what it describes."""
    from .config import ConfigFileError, load
    try:
        cfg = load(config)
        cfg.check_exposure()
    except ConfigFileError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"{config or 'local.yaml (embedded)'}: valid")
    typer.echo(f"model: {cfg.model.path} ({cfg.model.dtype})")
    for c in cfg.clusters:
        insts = ", ".join(f"{i.name} ({i.role}{'' if i.launch else ', joins'}{', standby' if i.standby else ''})"
                          for i in c.instances)
        typer.echo(f"cluster {c.name} ({c.kind}): {insts}")
    for lk in cfg.links:
        typer.echo(f"link {lk.src} -> {lk.dst}: {lk.bandwidth_gbps:g} Gbit/s, {lk.latency_ms:g} ms, "
                   f"{lk.connections} connections")
    how = "the router and worker processes" if cfg.disaggregated else "one colocated instance in the server process"
    typer.echo(f"policy: {cfg.policy.name}; served by {how} on http://{cfg.server.host}:{cfg.server.port}/v1")


@app.command()
def certs(out_dir: str = typer.Argument(..., help="directory to write the PEM files to"),
          hosts: str = typer.Option("127.0.0.1,localhost", help="comma-separated addresses the certificates are "
                                    "valid for (every host a router or worker listens on)"),
          names: str = typer.Option("node", help="comma-separated certificate names (one file pair each)"),
          days: int = typer.Option(365, min=1, help="validity")):
    """Write a cluster CA and certificates for transfer.tls (gRPC and KV links over TLS)."""
    from jaxserve.transfer.tls import make_certs
    out = make_certs(out_dir, [h for h in hosts.split(",") if h], [n for n in names.split(",") if n], days)
    for name, (cert, key) in out.items():
        typer.echo(f"{name}: {cert} {key}")
    first = next(n for n in out if n != "ca")
    typer.echo(f"\ntransfer:\n  tls:\n    ca_file: {out['ca'][0]}\n    cert_file: {out[first][0]}\n"
               f"    key_file: {out[first][1]}\n    mutual: true")


@app.command()
def bench(name: str = typer.Argument(..., help="benchmark module under bench/ (e.g. serving, kv_footprint)"),
          json_out: str = typer.Option(..., "--json", help="where to write the JSON result"),
          args: list[str] = typer.Argument(None, help="extra arguments passed to the benchmark")):
    """Run a benchmark (`python -m bench.NAME --json OUT`) from a checkout: bench/ is not in the wheel."""
    import importlib
    try:
        mod = importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("bench", f"bench.{name}"):
            raise  # the benchmark's own import
        where = ("bench/ is not installed with jaxserve: run benchmarks from a checkout of the repository"
                 if e.name == "bench" else f"no benchmark named {name!r} (bench/{name}.py)")
        typer.echo(f"error: {where}", err=True)
        raise typer.Exit(2)
    mod.main(["--json", json_out] + list(args or []))


if __name__ == "__main__":
    app()
