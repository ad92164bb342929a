"""YAML configs: presets validate, errors name the file and the field."""

import pytest

from jaxserve.config import ConfigFileError, load, parse


@pytest.mark.parametrize("path,disaggregated", [("configs/local.yaml", True), ("configs/colocated.yaml", False),
                                                ("configs/disagg.yaml", True), (None, True)])
def test_presets_load(path, disaggregated):
    cfg = load(path)
    assert cfg.disaggregated == disaggregated
    if disaggregated:  # the router starts a prefill and a decode worker, each on its own core
        roles = sorted(i.role for i in cfg.instances())
        assert roles == ["decode", "prefill"] and all(i.launch and len(i.cpus) == 1 for i in cfg.instances())
        assert len({i.cpus[0] for i in cfg.instances()}) == 2
    else:  # one colocated instance, served inside the server process
        assert [i.role for i in cfg.instances()] == ["both"]
    assert cfg.engine.chunk_size is None or cfg.engine.chunk_size % cfg.engine.block_size == 0  # None: the engine's
    cfg.engine.engine_config(cfg.server.max_waiting)  # the engine accepts it too


def test_errors_name_file_and_field(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("engine:\n  block_size: 0\nserver:\n  port: 'x'\n")
    with pytest.raises(ConfigFileError) as e:
        load(str(f))
    msg = str(e.value)
    assert f"{f}: engine.block_size" in msg and f"{f}: server.port" in msg
    f.write_text("modle:\n  path: x\n")
    with pytest.raises(ConfigFileError, match="modle: Extra inputs are not permitted"):
        load(str(f))
    f.write_text("engine: [1, 2\n")
    with pytest.raises(ConfigFileError, match="not valid YAML"):
        load(str(f))
    with pytest.raises(ConfigFileError, match="no such config file"):
        load(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigFileError, match="chunk_size .* multiple of block_size"):
        parse({"engine": {"block_size": 16, "chunk_size": 24}})
    with pytest.raises(ConfigFileError, match="model.dtype"):
        parse({"model": {"dtype": "float8"}})
    with pytest.raises(ConfigFileError, match="instance names must be unique"):
        parse({"clusters": [{"name": "a", "instances": [{"name": "x"}, {"name": "x"}]}]})


def test_cluster_configs_are_checked():
    cfg = parse({"clusters": [{"name": "a", "instances": [{"name": "p", "role": "prefill"},
                                                          {"name": "d", "role": "decode"}]}]})
    assert cfg.disaggregated  # served through the router and worker processes
    assert parse({"clusters": [{"name": "a", "instances": [{"name": "b", "launch": False}]}]}).disaggregated
    with pytest.raises(ConfigFileError, match="no instance can decode"):
        parse({"clusters": [{"name": "a", "instances": [{"name": "p", "role": "prefill"}]}]})
    with pytest.raises(ConfigFileError, match="router: .*down_after_s .* must exceed heartbeat_s"):
        parse({"router": {"heartbeat_s": 2, "down_after_s": 1}})
    two = lambda adv: {"clusters": [{"name": "a", "instances": [  # noqa: E731
        {"name": "p", "role": "prefill"}, {"name": "d", "role": "decode", "kv_advertise": adv}]}]}
    assert parse(two("10.0.0.5:7300")).instances()[1].kv_advertise == "10.0.0.5:7300"
    for bad in ("10.0.0.5", ":7300", "host:0", "host:http"):
        with pytest.raises(ConfigFileError, match="kv_advertise must be host:port"):
            parse(two(bad))


def test_layerwise_streaming_starts_at_stream_min_tokens():
    """transfer.layers_per_group applies to transfers of stream_min_tokens tokens or more; shorter ones go in one
    group after the step; no layers_per_group: never streamed."""
    t = parse({"transfer": {"layers_per_group": 4, "stream_min_tokens": 300}}).transfer
    assert t.groups_of(299) is None and t.groups_of(300) == 4 and t.groups_of(5000) == 4
    assert parse({"transfer": {"layers_per_group": 4}}).transfer.groups_of(511) is None  # default 512
    assert parse({"transfer": {"layers_per_group": 2, "stream_min_tokens": 0}}).transfer.groups_of(1) == 2
    assert parse({}).transfer.groups_of(10**6) is None
    with pytest.raises(ConfigFileError, match="transfer.stream_min_tokens"):
        parse({"transfer": {"stream_min_tokens": -1}})


def test_device_transfer_setting():
    """transfer.device_transfer: auto turns the device backend on off the CPU only; on / off are as written."""
    auto = parse({}).transfer
    assert auto.device_transfer == "auto" and not auto.pulls("cpu") and auto.pulls("gpu") and auto.pulls("tpu")
    assert parse({"transfer": {"device_transfer": "on"}}).transfer.pulls("cpu")
    assert not parse({"transfer": {"device_transfer": "off"}}).transfer.pulls("gpu")
    with pytest.raises(ConfigFileError, match="transfer.device_transfer"):
        parse({"transfer": {"device_transfer": "nccl"}})


def test_a_default_cluster_token_is_refused_off_loopback():
    """A token anyone can read here (the presets' jaxserve-local / change-me) must not guard a control or KV
    port that is not on loopback; the error names transfer.token and the exposed address."""
    pd = {"clusters": [{"name": "c", "instances": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}]}]}
    parse(pd).check_exposure()  # loopback everywhere: fine
    for token in ("jaxserve-local", "change-me"):
        with pytest.raises(ConfigFileError, match=r"transfer.token: .*router.host: 0.0.0.0"):
            parse({**pd, "router": {"host": "0.0.0.0"}, "transfer": {"token": token}}).check_exposure()
    exposed = {"clusters": [{"name": "c", "instances": [{"name": "p", "role": "prefill", "host": "10.1.2.3"},
                                                        {"name": "d", "role": "decode"}]}]}
    with pytest.raises(ConfigFileError, match=r"clusters.instances\[p\].host: 10.1.2.3"):
        parse(exposed).check_exposure()
    parse({**exposed, "transfer": {"token": "a-real-secret"}}).check_exposure()
    # one colocated instance serves no control or KV port: only the HTTP host, which the token does not guard
    parse({"server": {"host": "0.0.0.0"}}).check_exposure()


def test_tls_section_names_a_missing_file_and_builds(tmp_path):
    from jaxserve.transfer.tls import make_certs
    made = make_certs(str(tmp_path), ["127.0.0.1"], ["node"])
    tls = {"ca_file": made["ca"][0], "cert_file": made["node"][0], "key_file": made["node"][1], "mutual": True}
    cfg = parse({"transfer": {"tls": tls}})
    built = cfg.transfer.tls.build()
    assert built.mutual and built.server_context().verify_mode.name == "CERT_REQUIRED"
    with pytest.raises(ConfigFileError, match=r"transfer.tls: .*key_file: no such file 'nope.pem'"):
        parse({"transfer": {"tls": {**tls, "key_file": "nope.pem"}}})
    with pytest.raises(ConfigFileError, match=r"transfer.tls.cert_file: Field required"):
        parse({"transfer": {"tls": {"ca_file": made["ca"][0], "key_file": made["node"][1]}}})


def test_prfaas_preset_and_topology_rules():
    cfg = load("configs/prfaas.yaml")
    kinds = {c.name: (c.kind, sorted(i.role for i in c.instances)) for c in cfg.clusters}
    assert kinds == {"prfaas": ("prfaas", ["prefill"]), "pd": ("pd", ["decode", "prefill"])}
    # the PrfaaS prefill instance has a core of its own; the PD cluster's two instances share the other
    cpus = {i.name: tuple(i.cpus) for i in cfg.instances()}
    assert cpus["pd-p0"] == cpus["pd-d0"] and not set(cpus["prfaas-p0"]) & set(cpus["pd-p0"])
    assert cfg.link("prfaas", "pd").bandwidth_gbps > 0 and cfg.policy.name == "prfaas"
    two = {"name": "x", "kind": "prfaas", "instances": [{"name": "x0", "role": "decode"}]}
    with pytest.raises(ConfigFileError, match=r"clusters\[x\]: a prfaas cluster holds prefill instances only"):
        parse({"clusters": [two, {"name": "y", "instances": [{"name": "y0"}]}]})


def test_max_num_seqs_is_sized_from_the_cache_unless_set():
    from jaxserve.engine.llm_engine import EngineConfig
    assert EngineConfig().max_num_seqs is None  # the cache is sized from memory first (tests/engine/test_memory.py)
    assert EngineConfig(num_blocks=512).max_num_seqs == 512 * 16 // 256  # 512 blocks hold 32 slots of 256 tokens
    assert EngineConfig(num_blocks=64).max_num_seqs == 8  # never fewer than 8
    assert EngineConfig(num_blocks=1 << 20).max_num_seqs == 256  # nor more than 256
    assert EngineConfig(num_blocks=64, max_num_seqs=3).max_num_seqs == 3
    assert parse({"engine": {"num_blocks": 512}}).engine.engine_config(16).max_num_seqs == 32
    with pytest.raises(ConfigFileError, match=r"engine.max_num_seqs"):
        parse({"engine": {"max_num_seqs": 0}})


def test_banaserve_preset_and_the_store_role():
    from jaxserve.router.policies.banaserve import BanaServe
    from jaxserve.router.policies import make
    cfg = load("configs/banaserve.yaml")
    roles = sorted(i.role for i in cfg.instances())
    assert roles == ["decode", "decode", "prefill", "prefill", "store"]
    assert isinstance(make(cfg.policy), BanaServe) and make(cfg.policy).p.store
    assert next(i for i in cfg.instances() if i.role == "store").kv_blocks == 8192
    assert cfg.policy.migrate and cfg.policy.control_s == 2.0  # its migration planner runs every 2 s
    inst = {"clusters": [{"name": "c", "instances": [{"name": "d", "role": "decode"}]}]}
    for bad, what in (({"name": "flowkv", "control_s": 1, "migrate": True},
                       "policy.migrate: a key of the banaserve policy; this section is name: flowkv"),
                      ({"name": "banaserve", "migrate": True}, "policy: migrate needs control_s"),
                      ({"name": "banaserve", "control_s": 1}, "policy: control_s needs migrate"),
                      ({"control_s": 1}, "control_s: a key of the banaserve and flowkv policies; this section is "
                                         "name: least_loaded"),
                      ({"name": "banaserve", "control_s": 1, "migrate": True, "migrate_delta_down": 0.5},
                       "migrate_delta_down")):
        with pytest.raises(ConfigFileError, match=what):
            parse({**inst, "policy": bad})
    spill = parse({"clusters": [{"name": "c", "instances": [{"name": "d", "role": "decode"},
                                                            {"name": "s", "role": "store", "spill_mb": 64}]}]})
    assert next(i for i in spill.instances() if i.role == "store").spill_path().endswith("spill/s")
    for bad, what in (({"role": "decode", "spill_mb": 64}, "only the global KV store"),
                      ({"role": "store", "spill_dir": "/tmp/x"}, "spill_dir needs spill_mb")):
        with pytest.raises(ConfigFileError, match=what):
            parse({"clusters": [{"name": "c", "instances": [{"name": "s", **bad}]}]})
    two = {"clusters": [{"name": "c", "instances": [{"name": "d", "role": "decode"}, {"name": "s", "role": "store"},
                                                    {"name": "t", "role": "store"}]}]}
    with pytest.raises(ConfigFileError, match="one instance of role 'store' at most"):
        parse(two)


def test_standby_instances_are_started_by_the_router_and_are_not_stores():
    base = [{"name": "d", "role": "decode"}, {"name": "p", "role": "prefill"}]
    cfg = parse({"clusters": [{"name": "c", "instances": base + [{"name": "q", "role": "prefill", "standby": True}]}]})
    assert [i.name for i in cfg.instances() if i.standby] == ["q"]  # tests/router/test_balance.py starts one live
    for bad in ({"launch": False}, {"role": "store"}):
        with pytest.raises(ConfigFileError, match="standby"):
            parse({"clusters": [{"name": "c", "instances": base + [{"name": "q", "role": "prefill", "standby": True,
                                                                    **bad}]}]})


def test_the_token_comes_from_a_file_when_named(tmp_path):
    (tmp_path / "token").write_text("s3cret-from-a-secret\n")
    cfg = parse({"transfer": {"token_file": str(tmp_path / "token")}})
    assert cfg.transfer.token == "s3cret-from-a-secret"
    (tmp_path / "empty").write_text(" \n")
    for transfer, why in (({"token_file": str(tmp_path / "none")}, "transfer: .*token_file: cannot read"),
                          ({"token_file": str(tmp_path / "empty")}, "token_file: .* is empty"),
                          ({"token_file": str(tmp_path / "token"), "token": "x"}, "token_file: give the token or")):
        with pytest.raises(ConfigFileError, match=why):
            parse({"transfer": transfer})


def test_instances_sharing_a_device_split_its_memory():
    """Launched instances on this machine that share a device split SHARED_DEVICES of it evenly (an explicit
    device_memory is taken first); one alone keeps JAX's default; too much asked is an error naming the field;
    the worker's pin() hands the share to JAX's allocator."""
    local = load(None)  # the embedded default: a prefill and a decode worker on device 0
    assert [local.device_share(i.name) for i in local.instances()] == [pytest.approx(0.45)] * 2
    inst = lambda name, role, **kw: {"name": name, "role": role, **kw}  # noqa: E731
    cfg = lambda *insts: parse({"clusters": [{"name": "a", "instances": list(insts)}]})  # noqa: E731
    c = cfg(inst("p", "prefill", devices=[0]), inst("d", "decode", devices=[1]))
    assert c.device_share("p") is None and c.device_share("d") is None  # each alone on its device
    c = cfg(inst("p", "prefill", device_memory=0.3), inst("q", "prefill"), inst("d", "decode"))
    assert c.device_share("p") == 0.3 and c.device_share("q") == c.device_share("d") == pytest.approx(0.3)
    c = cfg(inst("p", "prefill", launch=False),
            inst("d", "decode"))
    assert c.device_share("p") is None and c.device_share("d") is None  # p runs elsewhere
    with pytest.raises(ConfigFileError, match=r"instances\[.\]\.device_memory: .* take 1.2 of them"):
        cfg(inst("p", "prefill", device_memory=0.6), inst("d", "decode", device_memory=0.6))
    with pytest.raises(ConfigFileError, match=r"instances\[d\]\.device_memory: 0.000 of its devices is left"):
        cfg(inst("p", "prefill", device_memory=0.95), inst("d", "decode"))
    with pytest.raises(ConfigFileError, match="device_memory"):
        cfg(inst("p", "both", device_memory=0))
    import subprocess
    import sys
    code = ("import os\nfrom jaxserve.config import load\nfrom jaxserve.worker.setup import pin\ncfg = load(None)\n"
            "pin(cfg.instance('local-p0'), cfg.device_share('local-p0'))\nimport jax\n"
            "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'], len(jax.devices()))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["0.4500", "1"], out.stderr[-2000:]


def test_prefill_instances_scan_their_layers_unless_told_otherwise():
    """engine.scan_layers: null leaves it to the engine (scanned with the CPU kernels, unrolled with Pallas ones),
    except on a prefill instance, whose start waits on compiling: there layers are scanned (worker/setup.py);
    an explicit value wins everywhere; kv_blocks still sets the instance's cache; a wrong value names the field."""
    from jaxserve.worker.setup import engine_settings
    insts = [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode", "kv_blocks": 77},
             {"name": "b", "role": "both"}]
    cfg = parse({"clusters": [{"name": "a", "instances": insts}]})
    got = {i.name: engine_settings(cfg, i) for i in cfg.instances()}
    assert {n: e.scan_layers for n, e in got.items()} == {"p": True, "d": None, "b": None}
    assert got["d"].num_blocks == 77 and got["p"].num_blocks is None
    for value in (True, False):
        cfg = parse({"engine": {"scan_layers": value}, "clusters": [{"name": "a", "instances": insts}]})
        assert {engine_settings(cfg, i).scan_layers for i in cfg.instances()} == {value}
    with pytest.raises(ConfigFileError, match="engine.scan_layers"):
        parse({"engine": {"scan_layers": "sometimes"}})


def test_packed_prefill_reaches_the_engine_and_a_wrong_value_names_it():
    """engine.packed_prefill: null (the engine's choice), true or false reach EngineConfig; anything else is an
    error naming the key, from the config file and from EngineConfig alike."""
    from jaxserve.engine.settings import EngineConfig
    for value in (None, True, False):
        assert parse({"engine": {"packed_prefill": value}}).engine.engine_config(8).packed_prefill is value
    with pytest.raises(ConfigFileError, match="engine.packed_prefill"):
        parse({"engine": {"packed_prefill": "sometimes"}})
    with pytest.raises(ValueError, match="engine.packed_prefill"):
        EngineConfig(packed_prefill="yes")
