"""The `jaxserve` command: jaxserve/cli.py's commands (convert, generate, worker, certs, bench) and `serve`,
which builds a router over a cluster's workers, so it lives here, above the engine packages."""

from __future__ import annotations

import typer

from jaxserve.cli import app


@app.command()
def serve(config: str = typer.Option(None, "--config", "-c", help="cluster YAML (default: the embedded local.yaml)"),
          port: int = typer.Option(None, help="override server.port"),
          host: str = typer.Option(None, help="override server.host")):
    """Serve the OpenAI-compatible API for the cluster a config describes."""
    from jaxserve.config import ConfigFileError, load

    from .serve import serve as _serve
    try:
        cfg = load(config)
        _serve(cfg, port, host)
    except ConfigFileError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2)


if __name__ == "__main__":
    app()
