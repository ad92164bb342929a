"""jaxserve's XLA flags (jaxserve/xla_flags.py): added once, before JAX starts, never over the user's own, and only
for a jaxlib whose XLA knows them (an unknown flag aborts the process)."""

import subprocess
import sys

from jaxserve import xla_flags


def test_cpu_flags_are_added_once_and_never_over_the_users(monkeypatch):
    monkeypatch.setattr(xla_flags.metadata, "version", lambda name: "0.10.2")
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert xla_flags.add_cpu_flags(env) == list(xla_flags.CPU_FLAGS)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", *xla_flags.CPU_FLAGS]
    assert xla_flags.add_cpu_flags(env) == [] and env["XLA_FLAGS"].count("fusion_emitters") == 1
    mine = {"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true"}
    assert xla_flags.add_cpu_flags(mine) == [] and mine["XLA_FLAGS"] == "--xla_cpu_use_fusion_emitters=true"


def test_an_unknown_jaxlib_gets_no_flags(monkeypatch):
    monkeypatch.setattr(xla_flags.metadata, "version", lambda name: "0.11.2")
    env = {}
    assert xla_flags.add_cpu_flags(env) == [] and env == {}


def test_importing_jaxserve_sets_them_before_jax_starts():
    """In a fresh process: `import jaxserve` adds the flags, and JAX started after it compiles with them."""
    code = ("import os, jaxserve, jax, jax.numpy as jnp; "
            "print(os.environ['XLA_FLAGS']); print(int(jax.jit(lambda x: x + 1)(jnp.int32(1))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}).stdout.split("\n")
    assert out[0] == " ".join(xla_flags.CPU_FLAGS) and out[1] == "2"
