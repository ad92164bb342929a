"""`jaxserve deploy kubernetes`: a kustomize base that runs a cluster config on Kubernetes.

From the YAML `jaxserve serve` reads, `manifests(cfg, opts)` makes:
  <name>-config   ConfigMap: the config as the pods run it (`pod_config`): every instance `launch: false`,
                  listening on all addresses at fixed ports and advertising its pod's IP; the router and the
                  server on all addresses; the cluster token read from the Secret; no shared-memory KV between
                  pods; no CPU pinning (the pod's resources bound it)
  <name>-token    Secret: the cluster token (the config's own, or a fresh random one in place of the default)
  <name>-router   Deployment (one replica: `jaxserve serve`) and Service (the OpenAI port and the control port
                  workers register at)
  <name>-<inst>   one LeaderWorkerSet per instance (`leaderworkerset.x-k8s.io/v1`): a group of `instance.hosts`
                  pods, `RecreateGroupOnPodRestart` (one pod lost: the group is recreated), each running `jaxserve
                  worker --instance INST --router <name>-router:PORT --advertise $(POD_IP)`; a pod finds its
                  place in a multi-host group from the LWS_* variables the controller sets (worker/group.py: the
                  leader, index 0, serves the coordinator on `group_port`, default 8476). The leader's pod has a
                  startup probe while it loads and compiles, then readiness and liveness on its gRPC port; the
                  other pods (they serve nothing) none. Every pod requests its cores and its host's devices
  <name>          with `--kind disaggregatedset`, instead of the LeaderWorkerSets: one DisaggregatedSet
                  (`disaggregatedset.x-k8s.io/v1`) whose roles are the instances (2 to 10), each role the
                  LeaderWorkerSet spec above, so that all of them roll out together
  kustomization.yaml listing them (and the namespace, if given).
Workers reach the router by its Service name, and each other by the pod IPs they register with. Plain Python
(PyYAML); no cluster is needed to write them. What it refuses, naming the field: standby instances (scale the
LeaderWorkerSet instead), TLS (its certificates are not mounted yet), names Kubernetes does not accept.
"""

from __future__ import annotations

import copy
import os
import re
import secrets
from dataclasses import dataclass

import yaml

from jaxserve.config import DEFAULT_TOKENS, Config, ConfigFileError, parse
from jaxserve.worker.group import DEFAULT_PORT as GROUP_PORT

CONFIG_DIR = "/etc/jaxserve"  # the ConfigMap's mount: config.yaml
TOKEN_DIR = "/etc/jaxserve-token"  # the Secret's mount: token
POD_IP = "$(POD_IP)"  # the downward-API variable the worker advertises
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LWS_API = "leaderworkerset.x-k8s.io/v1"
DS_API = "disaggregatedset.x-k8s.io/v1"
KINDS = ("leaderworkerset", "disaggregatedset")


@dataclass(frozen=True)
class Options:
    image: str
    name: str = "jaxserve"  # prefix of every object's name
    namespace: str | None = None
    http_port: int = 8000  # the OpenAI-compatible API
    control_port: int = 9000  # the router's control port (worker registration, heartbeats)
    grpc_port: int = 50051  # each worker's gRPC port
    kv_port: int = 50052  # each worker's KV data port
    memory: str = "8Gi"  # memory request of each worker pod
    gpu_resource: str | None = None  # e.g. nvidia.com/gpu: requested per worker, one per instance device
    token: str | None = None  # the cluster token (None: the config's, or a random one for a default token)
    kind: str = "leaderworkerset"  # one LeaderWorkerSet per instance, or one DisaggregatedSet of them all

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigFileError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.image:
            raise ConfigFileError("--image: the container image to run is required")
        if not NAME.match(self.name) or len(self.name) > 40:
            raise ConfigFileError(f"--name: {self.name!r} is not a Kubernetes name (lowercase letters, digits and "
                                  "'-', at most 40 characters)")
        ports = [self.http_port, self.control_port, self.grpc_port, self.kv_port]
        if len(set(ports)) != 4 or not all(0 < p < 65536 for p in ports):
            raise ConfigFileError(f"ports: the four ports must be distinct and in 1..65535, got {ports}")


def check(cfg: Config, opts: Options) -> None:
    """Refuse (ConfigFileError naming the field) what the manifests cannot run."""
    ports = {opts.http_port, opts.control_port, opts.grpc_port, opts.kv_port}
    for inst in cfg.instances():
        group = inst.group_port or GROUP_PORT
        if inst.hosts > 1 and {group, group + 1} & ports:
            raise ConfigFileError(f"clusters.instances[{inst.name}].group_port: {group} and {group + 1} (the "
                                  f"group's coordinator and channel) must differ from the pods' ports {sorted(ports)}")
        if not NAME.match(inst.name) or len(inst.name) > 20:
            raise ConfigFileError(f"clusters.instances[{inst.name}].name: not usable in a Kubernetes name "
                                  "(lowercase letters, digits and '-', at most 20 characters)")
        if inst.standby:
            raise ConfigFileError(f"clusters.instances[{inst.name}].standby: the local launcher starts standby "
                                  "instances; on Kubernetes scale a LeaderWorkerSet instead")
    if opts.kind == "disaggregatedset" and not 2 <= len(cfg.instances()) <= 10:
        raise ConfigFileError(f"clusters.instances: a DisaggregatedSet has 2 to 10 roles (one per instance), the "
                              f"config has {len(cfg.instances())} instances; use --kind leaderworkerset")
    if cfg.transfer.tls is not None:
        raise ConfigFileError("transfer.tls: `deploy kubernetes` does not mount certificates yet; deploy without "
                              "it (the cluster token still guards every call) or add the Secret by hand")


def pod_config(cfg: Config, opts: Options) -> dict:
    """The config the pods run (see the module docstring)."""
    d = cfg.model_dump(mode="json", exclude_none=True)
    d["router"].update(host="0.0.0.0", port=opts.control_port)
    d["server"].update(host="0.0.0.0", port=opts.http_port)
    t = d["transfer"]
    t.pop("token", None)
    t.update(token_file=f"{TOKEN_DIR}/token", shared_memory=False)
    for c in d["clusters"]:
        for i in c["instances"]:
            i.update(launch=False, host="0.0.0.0", port=opts.grpc_port, kv_port=opts.kv_port, cpus=[])
            if i.get("hosts", 1) > 1:
                i["group_port"] = i.get("group_port") or GROUP_PORT
            i.pop("kv_advertise", None)
    return d


def worker_command(cfg_path: str, instance: str, router: str, advertise: str) -> list[str]:
    return ["jaxserve", "worker", "--config", cfg_path, "--instance", instance, "--router", router,
            "--advertise", advertise]


def router_command(cfg_path: str) -> list[str]:
    return ["jaxserve", "serve", "--config", cfg_path]


def _meta(name: str, opts: Options, component: str) -> dict:
    return {"name": name, "labels": {"app.kubernetes.io/name": "jaxserve", "app.kubernetes.io/instance": opts.name,
                                     "app.kubernetes.io/component": component}}


def _volumes(opts: Options) -> tuple[list, list]:
    volumes = [{"name": "config", "configMap": {"name": f"{opts.name}-config"}},
               {"name": "token", "secret": {"secretName": f"{opts.name}-token"}}]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True}]
    return volumes, mounts


def _router(opts: Options) -> list[dict]:
    name = f"{opts.name}-router"
    labels = {"app.kubernetes.io/instance": opts.name, "app.kubernetes.io/component": "router"}
    volumes, mounts = _volumes(opts)
    container = {
        "name": "router", "image": opts.image, "command": router_command(f"{CONFIG_DIR}/config.yaml"),
        "ports": [{"name": "http", "containerPort": opts.http_port},
                  {"name": "control", "containerPort": opts.control_port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "initialDelaySeconds": 30, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
        "volumeMounts": mounts}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, opts, "router"),
                  "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels},
                                        "spec": {"containers": [container], "volumes": volumes}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, opts, "router"),
               "spec": {"selector": labels, "ports": [
                   {"name": "http", "port": opts.http_port, "targetPort": "http"},
                   {"name": "control", "port": opts.control_port, "targetPort": "control"}]}}
    return [deployment, service]


def _worker(cfg: Config, inst, opts: Options) -> dict:
    volumes, mounts = _volumes(opts)
    resources = {"requests": {"cpu": str(max(1, len(inst.cpus))), "memory": opts.memory}}
    if opts.gpu_resource:
        resources["limits"] = {opts.gpu_resource: str(len(inst.devices))}
    follower = {  # every pod of the group runs the same command; the LWS_* variables say which it is
        "name": "worker", "image": opts.image,
        "command": worker_command(f"{CONFIG_DIR}/config.yaml", inst.name,
                                  f"{opts.name}-router:{opts.control_port}", POD_IP),
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "resources": resources, "volumeMounts": mounts}
    ports = [{"name": "grpc", "containerPort": opts.grpc_port}, {"name": "kv", "containerPort": opts.kv_port}]
    if inst.hosts > 1:
        group = inst.group_port or GROUP_PORT
        ports += [{"name": "coordinator", "containerPort": group}, {"name": "group", "containerPort": group + 1}]
    leader = {
        **follower, "ports": ports,
        # the gRPC port opens once the weights are loaded and the programs compiled (up to 30 minutes)
        "startupProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 10, "failureThreshold": 3}}
    labels = {"app.kubernetes.io/instance": opts.name, "app.kubernetes.io/component": "worker",
              "jaxserve/instance": inst.name, "jaxserve/role": inst.role}
    template = {"size": inst.hosts, "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": {"metadata": {"labels": labels},
                                   "spec": {"containers": [leader if inst.hosts == 1 else follower],
                                            "volumes": volumes}}}
    if inst.hosts > 1:
        template["leaderTemplate"] = {"metadata": {"labels": labels},
                                      "spec": {"containers": [leader], "volumes": volumes}}
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": _meta(f"{opts.name}-{inst.name}", opts,
                                                                               "worker"),
            "spec": {"replicas": 1, "startupPolicy": "LeaderCreated", "leaderWorkerTemplate": template}}


def manifests(cfg: Config, opts: Options) -> dict[str, list[dict]]:
    """file name -> the objects it holds (kustomization.yaml last)."""
    check(cfg, opts)
    token = opts.token or (cfg.transfer.token if cfg.transfer.token not in DEFAULT_TOKENS
                           else secrets.token_urlsafe(32))
    config = pod_config(cfg, opts)
    parse(_with_token(config, token), "the pods' config")  # what the pods will load must load
    files = {
        "config.yaml": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{opts.name}-config", opts,
                                                                                      "config"),
                         "data": {"config.yaml": yaml.safe_dump(config, sort_keys=False)}}],
        "token.yaml": [{"apiVersion": "v1", "kind": "Secret", "metadata": _meta(f"{opts.name}-token", opts, "token"),
                        "type": "Opaque", "stringData": {"token": token}}],
        "router.yaml": _router(opts)}
    if opts.kind == "disaggregatedset":  # the instances as the roles of one object, rolled out together
        roles = [{"name": inst.name, "spec": _worker(cfg, inst, opts)["spec"]} for inst in cfg.instances()]
        files["disaggregatedset.yaml"] = [{"apiVersion": DS_API, "kind": "DisaggregatedSet",
                                           "metadata": _meta(opts.name, opts, "workers"), "spec": {"roles": roles}}]
    else:
        for inst in cfg.instances():
            files[f"worker-{inst.name}.yaml"] = [_worker(cfg, inst, opts)]
    kust = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": list(files)}
    if opts.namespace:
        kust["namespace"] = opts.namespace
    files["kustomization.yaml"] = [kust]
    return files


def _with_token(config: dict, token: str) -> dict:
    """The pods' config with the token inline instead of its file (to check it here, where the file is not)."""
    c = copy.deepcopy(config)
    c["transfer"].pop("token_file")
    c["transfer"]["token"] = token
    return c


def write(cfg: Config, opts: Options, out: str) -> list[str]:
    """Write the manifests into directory `out` (new or empty) -> the paths written."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigFileError(f"--out: {out} exists and is not an empty directory")
    os.makedirs(out, exist_ok=True)
    paths = []
    for fname, objs in manifests(cfg, opts).items():
        path = os.path.join(out, fname)
        with open(path, "w") as f:
            yaml.safe_dump_all(objs, f, sort_keys=False)
        if fname == "token.yaml":
            os.chmod(path, 0o600)
        paths.append(path)
    return paths
