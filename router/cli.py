"""The `jaxserve` command: jaxserve/cli.py's commands (convert, generate, worker, certs, bench), `serve`, which
builds a router over a cluster's workers, `deploy kubernetes` (router/kubernetes.py) and `plan` (the PrfaaS-PD
planner, router/planner.py), so they live here, above the engine packages."""

from __future__ import annotations

import os

import typer

from jaxserve.cli import app


@app.command()
def serve(config: str = typer.Option(None, "--config", "-c", help="cluster YAML (default: the embedded local.yaml)"),
          port: int = typer.Option(None, help="override server.port"),
          host: str = typer.Option(None, help="override server.host"),
          launcher: str = typer.Option("local", "--launcher", help="local: workers as child processes; ray: on "
                                                                   "the Ray cluster at --address"),
          address: str = typer.Option(None, "--address", help="the Ray cluster's address (with --launcher ray; "
                                                              "auto: the one this host belongs to)")):
    """Serve the OpenAI-compatible API for the cluster a config describes."""
    from jaxserve.config import ConfigFileError, load

    from .serve import serve as _serve
    if launcher not in ("local", "ray"):
        raise typer.BadParameter("must be local or ray", param_hint="--launcher")
    if (launcher == "ray") != (address is not None):
        raise typer.BadParameter("--address goes with --launcher ray, and only with it", param_hint="--address")
    try:
        cfg = load(config)
        _serve(cfg, port, host, address)
    except ConfigFileError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2)


deploy = typer.Typer(no_args_is_help=True, help="Write what runs a cluster config elsewhere than `serve`'s own "
                                                  "child processes.")
app.add_typer(deploy, name="deploy")


@deploy.command()
def kubernetes(config: str = typer.Option(..., "--config", "-c", help="cluster YAML"),
               image: str = typer.Option(..., "--image", help="container image with jaxserve and the model"),
               out: str = typer.Option(..., "--out", help="directory to write the kustomize base into (new or "
                                                          "empty)"),
               name: str = typer.Option("jaxserve", "--name", help="prefix of every object's name"),
               namespace: str = typer.Option(None, "--namespace", help="namespace of every object"),
               gpu_resource: str = typer.Option(None, "--gpu-resource", help="device resource each worker requests, "
                                                "one per instance device (e.g. nvidia.com/gpu)"),
               memory: str = typer.Option("8Gi", "--memory", help="memory request of each worker pod"),
               kind: str = typer.Option("leaderworkerset", "--kind", help="leaderworkerset: one per instance; "
                                        "disaggregatedset: one DisaggregatedSet, the instances its roles")):
    """A kustomize base for Kubernetes (LeaderWorkerSet controller installed): the router, one LeaderWorkerSet per
    instance (or one DisaggregatedSet of them), the config and the cluster token. Apply it with `kubectl apply -k
    OUT`."""
    from jaxserve.config import ConfigFileError, load

    from .kubernetes import Options, write
    try:
        paths = write(load(config), Options(image=image, name=name, namespace=namespace, gpu_resource=gpu_resource,
                                            memory=memory, kind=kind), out)
    except ConfigFileError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2)
    for p in paths:
        typer.echo(f"wrote {p}")
    typer.echo(f"{os.path.join(out, 'token.yaml')} holds the cluster token: keep it out of version control")


@app.command()
def plan(prfaas: str = typer.Option(..., "--prfaas", help="profile JSON of a PrfaaS prefill instance"),
         pd: str = typer.Option(..., "--pd", help="profile JSON of a PD-cluster instance"),
         workload: str = typer.Option(..., "--workload", help="workload JSON (truncated log-normal lengths)"),
         n_prfaas: int = typer.Option(..., "--n-prfaas", help="PrfaaS prefill instances"),
         n_pd: int = typer.Option(..., "--n-pd", help="PD-cluster instances (prefill + decode)"),
         egress_gbps: float = typer.Option(..., "--egress-gbps", help="PrfaaS egress bandwidth, Gbit/s"),
         n_homogeneous: int = typer.Option(None, "--n-homogeneous",
                                           help="instances of the homogeneous baseline (default n_prfaas + n_pd)"),
         t_step: int = typer.Option(256, "--t-step", help="threshold search step, tokens"),
         json_out: str = typer.Option(None, "--json", help="write the result here")):
    """The throughput-optimal PrfaaS-PD configuration (threshold, prefill/decode split) and its baselines."""
    import json

    from .planner import PlanError, Profile, Workload, format_plan, load_json
    from .planner import plan as _plan
    try:
        result = _plan(Profile.from_json(load_json(prfaas, "--prfaas"), "prfaas"),
                       Profile.from_json(load_json(pd, "--pd"), "pd"),
                       Workload.from_json(load_json(workload, "--workload")), n_prfaas, n_pd, egress_gbps,
                       n_homogeneous, t_step)
    except PlanError as e:
        typer.echo(f"plan error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(format_plan(result))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=1)
        typer.echo(f"wrote {json_out}")


if __name__ == "__main__":
    app()
