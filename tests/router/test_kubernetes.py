"""`jaxserve deploy kubernetes` (router/kubernetes.py): the kustomize base renders with kubectl, its core objects
validate (kubernetes-validate, offline) and its LeaderWorkerSets (or its DisaggregatedSet) validate against the
upstream CRD schemas (jsonschema); the objects match the config (group size, leader and worker templates, restart
policy, ports, probes, environment, resources);
and the pod commands the manifests hold, run as local processes (each "pod" on a loopback address of its own,
the ConfigMap and Secret written where the mounts put them), form the cluster and serve, answering as a
colocated engine does. No Kubernetes cluster: this machine has no container runtime."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from jaxserve.config import ConfigFileError, parse
from jaxserve.router.kubernetes import CONFIG_DIR, POD_IP, TOKEN_DIR, Options, manifests, write
from jaxserve.router.launcher import free_ports
from tests.router.test_cluster_http import complete, tokens

HERE = os.path.dirname(__file__)
CRD = os.path.join(HERE, "..", "data", "k8s", "leaderworkerset.x-k8s.io_leaderworkersets.yaml")


def config(path: str = "bundled") -> dict:
    return {"model": {"path": path, "name": "m"},
            "engine": dict(block_size=4, num_blocks=64, chunk_size=8, max_num_batched_tokens=16, max_prefill_seqs=2,
                           max_num_seqs=4, num_snapshots=8, warmup=False),
            "clusters": [{"name": "pd", "instances": [
                {"name": "p0", "role": "prefill", "cpus": [0]},
                {"name": "d0", "role": "decode", "cpus": [1], "devices": [0, 1], "tp": 4, "hosts": 2},
                {"name": "s0", "role": "store", "kv_blocks": 128}]}],
            "transfer": {"token": "a-secret-of-ours", "layers_per_group": 2},
            "router": {"heartbeat_s": 0.25, "down_after_s": 5.0}}


def by_kind(files: dict) -> dict:
    out: dict = {}
    for objs in files.values():
        for o in objs:
            out.setdefault(o["kind"], []).append(o)
    return out


def test_the_base_renders_and_validates_offline(tmp_path):
    import jsonschema
    import kubernetes_validate
    opts = Options(image="registry.example/jaxserve:1", namespace="llm", gpu_resource="nvidia.com/gpu")
    paths = write(parse(config()), opts, str(tmp_path / "base"))
    assert sorted(os.path.basename(p) for p in paths) == sorted(
        ["config.yaml", "token.yaml", "router.yaml", "worker-p0.yaml", "worker-d0.yaml", "worker-s0.yaml",
         "kustomization.yaml"])
    assert os.stat(tmp_path / "base" / "token.yaml").st_mode & 0o077 == 0  # the token: owner only
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(tmp_path / "base")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    objs = [o for o in yaml.safe_load_all(out.stdout) if o]
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ConfigMap", "Deployment", "LeaderWorkerSet", "LeaderWorkerSet", "LeaderWorkerSet", "Secret",
                     "Service"]
    assert all(o["metadata"]["namespace"] == "llm" for o in objs)
    crd = yaml.safe_load(open(CRD))
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    version = kubernetes_validate.latest_version()
    for o in objs:
        if o["kind"] == "LeaderWorkerSet":
            jsonschema.validate(o, schema)
        else:
            kubernetes_validate.validate(o, version, strict=True)
    # a LeaderWorkerSet the CRD refuses is caught (the check can fail)
    bad = next(o for o in objs if o["kind"] == "LeaderWorkerSet")
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_a_disaggregatedset_holds_the_instances_as_its_roles(tmp_path):
    import jsonschema
    cfg = parse(config())
    opts = Options(image="img:1", kind="disaggregatedset", token="t" * 32)
    paths = write(cfg, opts, str(tmp_path / "ds"))
    assert sorted(os.path.basename(p) for p in paths) == sorted(
        ["config.yaml", "token.yaml", "router.yaml", "disaggregatedset.yaml", "kustomization.yaml"])
    (ds,) = by_kind(manifests(cfg, opts))["DisaggregatedSet"]
    assert ds["apiVersion"] == "disaggregatedset.x-k8s.io/v1"
    # each role is the LeaderWorkerSet spec the instance gets on its own
    lws = {o["metadata"]["name"]: o["spec"] for o in by_kind(manifests(
        cfg, Options(image="img:1", token="t" * 32)))["LeaderWorkerSet"]}
    assert [r["name"] for r in ds["spec"]["roles"]] == ["p0", "d0", "s0"]
    assert all(r["spec"] == lws[f"jaxserve-{r['name']}"] for r in ds["spec"]["roles"])
    crd = yaml.safe_load(open(CRD.replace("leaderworkerset.x-k8s.io_leaderworkersets",
                                          "disaggregatedset.x-k8s.io_disaggregatedsets")))
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    jsonschema.validate(ds, schema)
    one = {**ds, "spec": {"roles": ds["spec"]["roles"][:1]}}  # the CRD wants two roles at least
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(one, schema)
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        out = subprocess.run([kubectl, "kustomize", str(tmp_path / "ds")], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert "DisaggregatedSet" in {o["kind"] for o in yaml.safe_load_all(out.stdout) if o}
    alone = {**config(), "clusters": [{"name": "pd", "instances": [{"name": "b0", "role": "both"}]}]}
    with pytest.raises(ConfigFileError, match=r"clusters.instances: a DisaggregatedSet has 2 to 10 roles"):
        manifests(parse(alone), opts)
    with pytest.raises(ConfigFileError, match="--kind"):
        Options(image="i", kind="statefulset")


def test_the_objects_match_the_config():
    cfg = parse(config())
    opts = Options(image="img:1", gpu_resource="nvidia.com/gpu", memory="16Gi")
    k = by_kind(manifests(cfg, opts))
    pod = yaml.safe_load(k["ConfigMap"][0]["data"]["config.yaml"])
    assert pod["transfer"]["token_file"] == f"{TOKEN_DIR}/token" and "token" not in pod["transfer"]
    assert k["Secret"][0]["stringData"]["token"] == "a-secret-of-ours"
    assert pod["transfer"]["shared_memory"] is False  # pods share no memory segment
    assert (pod["router"]["host"], pod["router"]["port"]) == ("0.0.0.0", opts.control_port)
    assert (pod["server"]["host"], pod["server"]["port"]) == ("0.0.0.0", opts.http_port)
    svc = k["Service"][0]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"http": opts.http_port,
                                                                   "control": opts.control_port}
    router = k["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert router["command"] == ["jaxserve", "serve", "--config", f"{CONFIG_DIR}/config.yaml"]
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    lws = {o["metadata"]["name"]: o for o in k["LeaderWorkerSet"]}
    assert sorted(lws) == ["jaxserve-d0", "jaxserve-p0", "jaxserve-s0"]
    probes = ("startupProbe", "readinessProbe", "livenessProbe")
    for inst in cfg.instances():
        spec = lws[f"jaxserve-{inst.name}"]["spec"]
        assert spec["replicas"] == 1
        t = spec["leaderWorkerTemplate"]
        assert t["size"] == inst.hosts and t["restartPolicy"] == "RecreateGroupOnPodRestart"
        # the leader's pod (one pod: the only template) serves and is probed; the others of a group are not
        c = (t["leaderTemplate"] if inst.hosts > 1 else t["workerTemplate"])["spec"]["containers"][0]
        pods = [c] + ([t["workerTemplate"]["spec"]["containers"][0]] if inst.hosts > 1 else [])
        for p_ in pods:
            assert p_["command"] == ["jaxserve", "worker", "--config", f"{CONFIG_DIR}/config.yaml", "--instance",
                                     inst.name, "--router", f"jaxserve-router:{opts.control_port}", "--advertise",
                                     POD_IP]
            assert p_["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
            assert p_["resources"]["requests"] == {"cpu": str(max(1, len(inst.cpus))), "memory": "16Gi"}
            assert p_["resources"]["limits"] == {"nvidia.com/gpu": str(len(inst.devices))}  # each host's devices
        want_ports = {"grpc": opts.grpc_port, "kv": opts.kv_port}
        if inst.hosts > 1:
            want_ports.update(coordinator=8476, group=8477)
            assert not any(p in pods[1] for p in probes + ("ports",))
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == want_ports
        assert all(c[p]["tcpSocket"]["port"] == "grpc" for p in probes)
        mine = next(i for c_ in pod["clusters"] for i in c_["instances"] if i["name"] == inst.name)
        assert (mine["launch"], mine["host"], mine["port"], mine["kv_port"], mine["cpus"]) == (
            False, "0.0.0.0", opts.grpc_port, opts.kv_port, [])
        assert (mine["role"], mine["devices"], mine["tp"]) == (inst.role, inst.devices, inst.tp)
        assert mine.get("hosts", 1) == inst.hosts and (inst.hosts == 1 or mine["group_port"] == 8476)


def test_what_cannot_run_is_refused_naming_the_field(tmp_path):
    base = config()
    cases = [
        ({**base, "clusters": [{"name": "pd", "instances": [{"name": "P_0", "role": "prefill"},
                                                             {"name": "d0", "role": "decode"}]}]},
         "clusters.instances[P_0].name"),
        ({**base, "clusters": [{"name": "pd", "instances": [{"name": "p0", "role": "prefill", "standby": True},
                                                             {"name": "d0", "role": "decode"}]}]},
         "clusters.instances[p0].standby"),
        ({**base, "clusters": [{"name": "pd", "instances": [{"name": "p0", "role": "prefill"},
                                                             {"name": "d0", "role": "decode", "hosts": 2, "tp": 2,
                                                              "group_port": 49999}]}]},
         "clusters.instances[d0].group_port")]
    for cfg, field in cases:
        with pytest.raises(ConfigFileError, match=field.replace("[", r"\[").replace("]", r"\]")):
            manifests(parse(cfg), Options(image="img", kv_port=50000))
    for kw, field in (({"image": ""}, "--image"), ({"image": "i", "name": "Bad_Name"}, "--name"),
                      ({"image": "i", "grpc_port": 8000}, "ports")):
        with pytest.raises(ConfigFileError, match=field):
            Options(**kw)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigFileError, match="--out"):
        write(parse(base), Options(image="i"), str(tmp_path / "full"))
    # a default token is never deployed: the Secret gets a fresh random one
    default = {**base, "transfer": {"layers_per_group": 2}}
    tokens = {by_kind(manifests(parse(default), Options(image="i")))["Secret"][0]["stringData"]["token"]
              for _ in range(2)}
    assert len(tokens) == 2 and all(len(t) >= 32 for t in tokens)


async def healths(where: dict, token: str) -> dict:
    """name -> the Health answer of the worker at where[name]."""
    from jaxserve.worker import rpc
    out = {}
    for name, address in where.items():
        c = rpc.Client(address, token)
        try:
            out[name] = await c.call("Health", {}, timeout=30)
        finally:
            await c.close()
    return out


@pytest.mark.slow
def test_the_pod_commands_form_the_cluster_and_serve(checkpoint_dir, tmp_path):
    """The router's and every worker's command from the manifests, as local processes: each worker "pod" has a
    loopback address of its own as its POD_IP (and, since they share this host, ports of its own), the Service
    name resolves to the router's, the ConfigMap and the Secret are files where the mounts put them. The cluster
    registers and answers like a colocated engine, and every worker advertises its pod's address. d0 is a group
    of two pods (tensor parallel over both), each started with the LWS_* variables its controller would set."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.engine.llm_engine import EngineConfig
    path = checkpoint_dir("llama")
    raw = config(path)
    raw["clusters"][0]["instances"][1].update(devices=[0], tp=2)  # d0: two pods of one CPU device each
    # every port of the test from one draw of consecutive free ports (separate draws may give one port twice)
    port = iter(range(free_ports(n=16), 1 << 16))
    opts = Options(image="img", http_port=next(port), control_port=next(port), grpc_port=next(port),
                   kv_port=next(port))
    files = manifests(parse(raw), opts)
    k = by_kind(files)
    mounts = {CONFIG_DIR: tmp_path / "config", TOKEN_DIR: tmp_path / "token"}
    for d in mounts.values():
        d.mkdir()
    pod_cfg = yaml.safe_load(k["ConfigMap"][0]["data"]["config.yaml"])
    addr, ports = {}, {}  # instance -> its pod's address; its gRPC port
    for c in pod_cfg["clusters"]:
        for n, i in enumerate(c["instances"]):
            addr[i["name"]] = f"127.0.0.{n + 2}"
            # pods on one host share its ports: each its own (they still listen on every address, 0.0.0.0)
            ports[i["name"]] = i["port"] = next(port)
            i["kv_port"] = next(port)
            if i.get("hosts", 1) > 1:
                i["group_port"] = next(port)
                next(port)  # the group's step channel: group_port + 1
    pod_cfg["transfer"]["token_file"] = str(mounts[TOKEN_DIR] / "token")
    (mounts[CONFIG_DIR] / "config.yaml").write_text(yaml.safe_dump(pod_cfg))
    (mounts[TOKEN_DIR] / "token").write_text(k["Secret"][0]["stringData"]["token"])

    def local(cmd: list[str], pod_ip: str | None = None) -> list[str]:
        assert cmd[0] == "jaxserve"
        out = [sys.executable, "-m", "jaxserve.router.cli"]
        for a in cmd[1:]:
            for mount, d in mounts.items():
                a = a.replace(mount, str(d))
            a = a.replace(f"{opts.name}-router:", "127.0.0.1:")  # the Service's name
            out.append(a.replace(POD_IP, pod_ip) if pod_ip else a)
        return out
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    procs = []
    log = open(tmp_path / "pods.log", "w")
    try:
        router = k["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
        procs.append(subprocess.Popen(local(router["command"]), stdout=log, stderr=subprocess.STDOUT, env=env))
        for lws in k["LeaderWorkerSet"]:  # each pod of each group, with the variables the LWS controller sets
            t = lws["spec"]["leaderWorkerTemplate"]
            name = t["workerTemplate"]["metadata"]["labels"]["jaxserve/instance"]
            for index in range(t["size"]):
                pod = t["leaderTemplate"] if index == 0 and "leaderTemplate" in t else t["workerTemplate"]
                c = pod["spec"]["containers"][0]
                ip = addr[name] if index == 0 else f"127.0.1.{len(procs)}"
                lws_env = {"LWS_LEADER_ADDRESS": addr[name], "LWS_GROUP_SIZE": str(t["size"]),
                           "LWS_WORKER_INDEX": str(index)}
                procs.append(subprocess.Popen(local(c["command"], ip), stdout=log, stderr=subprocess.STDOUT,
                                              env={**env, **lws_env}))
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=f"http://127.0.0.1:{opts.http_port}", timeout=60) as http:
            while True:  # the router's readiness probe (one can decode), and every worker registered
                assert all(p.poll() is None for p in procs), open(tmp_path / "pods.log").read()[-3000:]
                try:
                    h = http.get("/health")
                    if h.status_code == 200 and len(h.json()["instances"]) == 3:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, open(tmp_path / "pods.log").read()[-3000:]
                time.sleep(0.2)
            prompt = [5, 7, 9, 11, 13, 2, 3, 4, 8, 10, 12, 14, 15]
            got = tokens(complete(http, prompt)["choices"][0])
        seen = asyncio.run(healths({n: f"{addr[n]}:{ports[n]}" for n in addr},
                                   k["Secret"][0]["stringData"]["token"]))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
    # every worker told the router and its peers its pod's address, not the one it listens on
    assert all(h["address"] == f"{addr[n]}:{ports[n]}" and h["kv_address"][0] == addr[n] for n, h in seen.items()), seen
    eng = EngineConfig(**{k_: v for k_, v in raw["engine"].items() if k_ != "warmup"})
    want = LLM(path, progress=False, engine=eng).generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    assert got == want
