"""`diloco deploy k8s`: Kubernetes manifests for a federation, the same processes as README's two-region walkthrough.

`render(cfg, options)` is pure: config in, Kubernetes objects out (plain dicts). `deploy_k8s` writes them as YAML,
one file per part, in an order `kubectl apply -f DIR` can follow:

    00-namespace.yaml          the namespace (unless it is "default")
    10-config.yaml             a ConfigMap: the resolved config every pod reads (references to secrets, no secret)
    20-coordinator.yaml        Deployment (1 replica, Recreate) + Service (gRPC, metrics) + PersistentVolumeClaim
    30-island-NAME.yaml        per island: an Indexed Job (one pod per process of the island; with more than one a
                               headless Service and a NetworkPolicy) + PersistentVolumeClaim, or, for an island on
                               a Pathways slice, a PathwaysJob whose main container is the island
    secrets.sh                 `kubectl create secret` for the files `diloco certs` wrote (not applied by -f DIR)

With `--admit NAME` (an island admitted into the live run, `diloco admit`): 10-config.yaml, 30-island-NAME.yaml, and
a secrets.sh that makes its one Secret from the kit `diloco admit --ca-dir` wrote; the output lists the steps in
order (admit, copy ca.crt into the kit, secrets.sh, apply), the admission first: the coordinator refuses an island
it has not admitted, and that refusal (exit 2) fails the Job.

What the pods need and where it comes from:

* The command line of each container is a `diloco` command line (the image's entrypoint is `diloco`), the one the
  walkthrough types, with fixed paths inside the pod: the config at CONFIG_PATH, TLS files under TLS_DIR, the run
  directory on the pod's volume (RUN_DIR: checkpoints survive a pod restart; the same command resumes).
* Secrets and keys are never in a manifest: this module reads no key material. Every pod mounts Secrets by name
  (`Names.coordinator_tls`, `Names.island_secret`), made by secrets.sh from `diloco certs` output. Each island's
  secret is mounted where the config's reference says (`file:kit/secrets/NAME`, relative to the image's WORKDIR)
  or put in the environment variable it names (`env:VAR`), so the config stays the one every machine of the
  walkthrough uses and the run's identity (its config digest) does not change when it moves into a cluster.
* The coordinator's readiness is its gRPC health service. The kubelet's built-in gRPC probe speaks plaintext and
  presents no client certificate, and the coordinator serves mutual TLS only, so the probe is `diloco status`
  run in the pod over TLS as the first island (status exits 1 while the coordinator says NOT_SERVING: restoring
  a checkpoint or stopping). That is why the coordinator pod also mounts that island's client certificate; it
  holds every island's secret anyway. Liveness is the gRPC port accepting connections (it listens before it
  restores, so a long restore is not mistaken for a hang).

Islands as Indexed Jobs (completions = parallelism = islands.processes): pod i runs process i
(`--process-id $(JOB_COMPLETION_INDEX)`); the pod that leads the island (process 0, or the one that took the island
over when process 0 was lost for good) serves JAX's distributed coordinator at its own `<job>-<index>.<headless
service>` (the Job's pods get `hostname` <job>-<index> and `subdomain` the Service: `--island-coordinator`), and the
others find that address in the island's formation (diloco/worker/island_formation.py).
Restarts (ISLAND_RESTART_POLICY_NOTE, written at the top of each island's file, says the same to the operator):
`restartPolicy: Never`, so a failed process fails its pod and the Job makes a new pod for that index (same
hostname, so process 0 is found again), and `podFailurePolicy` can tell failures apart: exit code 2 is diloco's
user error (a config mistake, a divergence: retrying cannot help), so it fails the Job at once; a pod evicted or
preempted (condition DisruptionTarget) is replaced without counting against `backoffLimit`. Inside a pod,
`diloco island` still supervises its worker: a crash is restarted at once, without rescheduling, and reported to
the coordinator so the round does not wait for the lease; its pod fails only when the supervisor gives up.
Kubernetes has no "restart every index of a Job when one fails"; the whole island restarts because its processes
cannot go on without one another (diloco/worker/island_group.py): the survivors' collectives and JAX's distributed
runtime fail when a peer dies, they exit and restart too. A pod not back within islands.regroup_wait_s (a node lost, a
slow reschedule) is not waited for: process 0 forms the island of the pods it has, and the island grows back at a
round's end once the pod is (diloco/worker/island_formation.py). `backoffLimit` counts failed pods:
ISLAND_POD_RESTARTS × the island's processes.
"""

from __future__ import annotations

import argparse
import json
import math
import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from floor.errors import UserError

if TYPE_CHECKING:
    from diloco.config import RunConfig

Obj = dict[str, Any]

WORKDIR = "/app"
"""The image's WORKDIR (Dockerfile) and every container's workingDir: relative paths of the config (a secret's
`file:kit/secrets/NAME`, `configs/links/...`) resolve against it."""
CONFIG_DIR = "/etc/diloco/config"
CONFIG_PATH = f"{CONFIG_DIR}/config.toml"
TLS_DIR = "/etc/diloco/tls"
"""An island's Secret (ca.crt, tls.crt, tls.key, secret), or the coordinator's TLS Secret (ca.crt, tls.crt, tls.key)."""
PROBE_DIR = "/etc/diloco/probe"
"""The first island's Secret in the coordinator pod: the credentials of its readiness probe."""
DATA_DIR = "/var/lib/diloco"
"""Where a pod's PersistentVolumeClaim is mounted; the run directory is a directory in it (not the mount point,
which may hold a filesystem's lost+found)."""
RUN_DIR = f"{DATA_DIR}/run"
USER_ID = 10001
"""The image's non-root user (Dockerfile); the pods run as it and own their volumes through fsGroup."""

ISLAND_COORDINATOR_PORT = 8476
"""Port of JAX's distributed coordinator, served by process 0 of a multi-process island."""
ISLAND_POD_RESTARTS = 3
"""Whole-island failures a Job survives (backoffLimit = this × islands.processes pods)."""
PATHWAYS_MAX_RESTARTS = 3
"""maxRestarts of a Pathways island's PathwaysJob (its JobSet restarts the head and the workers together)."""
USER_ERROR_EXIT = 2
"""diloco's exit code for a user error (floor.errors.UserError): fail the Job rather than retry it."""
ISLAND_CONTAINER = "island"

ACCELERATORS = ("cpu", "nvidia-gpu", "tpu", "pathways")
"""What an island pod runs on: CPU only, NVIDIA GPUs of its node, TPU chips of its node (a TPU slice node pool), or
a TPU slice that Pathways manages (islands.backend = "pathways": the pod itself requests no accelerator)."""
JAX_PLATFORM = {"cpu": "cpu", "nvidia-gpu": "cuda", "tpu": "tpu"}
"""JAX_PLATFORMS per accelerator: a pod whose accelerator is missing fails at start instead of training on its CPU.
A Pathways island gets JAX_PLATFORMS=proxy and JAX_BACKEND_TARGET from its PathwaysJob."""
SERVICE_TYPES = ("ClusterIP", "LoadBalancer", "NodePort")

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
"""RFC 1123 label (Kubernetes object names, hostnames), at most 63 characters."""
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
"""RFC 1035 label (Service names): a label that starts with a letter."""
MAX_LABEL = 63

ISLAND_RESTART_POLICY_NOTE = f"""\
Restarts: restartPolicy Never + podFailurePolicy. A failed island process fails its pod and the Job starts a new
pod for that index (same hostname, so process 0 is found again at <job>-0.<service>). Exit code 2 is a diloco user
error (config, divergence): retrying cannot fix it, so it fails the Job at once. An evicted or preempted pod
(DisruptionTarget) is replaced without counting against backoffLimit. In a pod, `diloco island` restarts a crashed
worker itself (no rescheduling) and tells the coordinator at once; the pod fails only when it gives up. One dead
process restarts the whole island: the others cannot go on without it (JAX's distributed runtime and the
collectives fail), so they exit and restart too; a pod not back within islands.regroup_wait_s is not waited for (the
island goes on with the others and grows back at a round's end when it is). backoffLimit counts failed pods:
{ISLAND_POD_RESTARTS} x islands.processes. A pod stopped by SIGTERM (a drained node) leaves the run cleanly with exit
code 0, which completes its index: re-create the Job to bring it back (it resumes from its volume)."""


class DeployError(UserError, ValueError):
    """A deployment that cannot be rendered as asked; one line naming the option, key or name at fault."""


@dataclass(frozen=True)
class Placement:
    """Where one island runs: its accelerator and its container image."""

    accelerator: str
    image: str


@dataclass(frozen=True)
class K8sOptions:
    """What `diloco deploy k8s` takes beside the config (each field is one of its flags)."""

    namespace: str = "default"
    prefix: str = ""
    """Start of every object's name ("" = run.name)."""
    image: str = "diloco:latest"
    """The coordinator's image, and every island's unless `placements` says otherwise."""
    placements: dict[str, Placement] = field(default_factory=dict)
    """Island name -> accelerator and image; an island not listed runs on CPU with `image`."""
    port: int = 50051
    """The coordinator's gRPC port (container and Service)."""
    coordinator_address: str = ""
    """HOST:PORT the islands dial ("" = the coordinator Service's in-cluster name); the server certificate of
    `diloco certs --host` must name HOST."""
    service_type: str = "ClusterIP"
    cpu: str = "2"
    """CPU request of each island process."""
    memory: str = "8Gi"
    """Memory request and limit of each island process."""
    coordinator_cpu: str = "1"
    coordinator_memory: str = "4Gi"
    storage: str = "10Gi"
    """Size of each run-directory volume."""
    storage_class: str = ""
    """storageClassName of the volumes ("" = the cluster's default)."""
    tpu_type: str = ""
    """For TPU islands: the node label cloud.google.com/gke-tpu-accelerator (e.g. tpu-v5-lite-podslice)."""
    tpu_topology: str = ""
    """For TPU and Pathways islands: the slice topology (e.g. 2x4): cloud.google.com/gke-tpu-topology."""
    pathways_machine_type: str = ""
    """For Pathways islands: the PathwaysJob's worker machine type (e.g. ct5lp-hightpu-4t)."""
    pathways_dir: str = ""
    """For Pathways islands: the PathwaysJob's pathwaysDir, a gs:// location Pathways keeps temporary state in."""


# -- names -------------------------------------------------------------------------------------------------------


def check_label(label: str, what: str, pattern: re.Pattern[str] = DNS_LABEL, given: str | None = None) -> str:
    """`label` when it is a DNS label, else one line naming `what` and the value the user gave (`given`)."""
    if len(label) > MAX_LABEL or not pattern.match(label):
        starts = "start with a lower-case letter, " if pattern is DNS_1035_LABEL else "start and "
        raise DeployError(
            f"{what} {given or label!r} cannot name Kubernetes objects: a DNS label must {starts}end "
            f"with a lower-case letter or digit, hold only those and '-', and have at most {MAX_LABEL} "
            "characters"
        )
    return label


def dns_label(text: str, what: str, pattern: re.Pattern[str] = DNS_LABEL) -> str:
    """`text` as a Kubernetes name part: lower case, "_" as "-"; one line naming `what` when even that is no
    DNS label (a leading or trailing "-", more than 63 characters, for a Service name a leading digit)."""
    return check_label(text.lower().replace("_", "-"), what, pattern, given=text)


@dataclass(frozen=True)
class Names:
    """Every object name of one deployment, checked once (`names`)."""

    prefix: str
    islands: dict[str, str]
    """Island name -> its DNS label (island names may hold '_' and capitals; labels may not)."""

    @property
    def config(self) -> str:
        return f"{self.prefix}-config"

    @property
    def coordinator(self) -> str:
        """The coordinator's Deployment and Service."""
        return f"{self.prefix}-coordinator"

    @property
    def coordinator_tls(self) -> str:
        return f"{self.prefix}-coordinator-tls"

    def island(self, name: str) -> str:
        """The island's Job (or PathwaysJob) and its headless Service."""
        return f"{self.prefix}-island-{self.islands[name]}"

    def island_secret(self, name: str) -> str:
        """The island's Secret: ca.crt, tls.crt, tls.key (its client certificate) and secret."""
        return self.island(name)

    def volume_claim(self, owner: str) -> str:
        return f"{owner}-run"


def names(cfg: RunConfig, options: K8sOptions, admitted: str = "") -> Names:
    """The deployment's names, refused in one line when one cannot be a DNS label (or two islands would share one);
    `admitted`: an island admitted into the live run, named beside the configured ones."""
    prefix = dns_label(
        options.prefix or cfg.run.name, "--prefix" if options.prefix else "run.name (or --prefix)", DNS_1035_LABEL
    )
    labels: dict[str, str] = {}
    for island in (*cfg.islands.island_names, *([admitted] if admitted else [])):
        label = dns_label(island, "island name")
        twin = next((other for other, taken in labels.items() if taken == label), None)
        if twin is not None:
            raise DeployError(f"islands {twin!r} and {island!r} would share the Kubernetes name {label!r}")
        labels[island] = label
    out = Names(prefix, labels)
    hostname_room = MAX_LABEL - len(f"-{cfg.islands.processes - 1}")  # pod hostnames are <job>-<index>
    for island in labels:
        if len(out.island(island)) > hostname_room:
            raise DeployError(
                f"the island name {out.island(island)!r} is too long for its pods' hostnames "
                f"(at most {hostname_room} characters): choose a shorter --prefix"
            )
    check_label(options.namespace, "--namespace")  # not rewritten: the user types it in every kubectl command
    return out


# -- the config, its secrets and the ports ------------------------------------------------------------------------


def pod_config(cfg: RunConfig) -> str:
    """The config.toml every pod reads: the resolved config as a run directory records it (secret references, no
    secret; config_digest unchanged), plus what holds in every pod: an island's /metrics listens on all of the
    pod's addresses, not only its loopback, so that Prometheus can scrape it."""
    from diloco.config import dump_toml, to_dict

    data = to_dict(cfg)
    data["network"]["metrics_host"] = "0.0.0.0"
    data["run"]["tensorboard"] = cfg.run.tensorboard
    return dump_toml(data)


@dataclass(frozen=True)
class SecretRef:
    """Where a process finds one island's secret: a file path in the pod, or an environment variable."""

    path: str = ""
    env: str = ""


def secret_refs(cfg: RunConfig) -> dict[str, SecretRef]:
    """Island name -> where its secret goes in a pod, from network.secrets; refused in one line when the config has
    none (the coordinator would refuse to listen beyond loopback) or a reference cannot be honoured in a pod."""
    from transport.auth import is_secret_reference

    refs = cfg.network.secrets
    if not refs:
        raise DeployError(
            "network.secrets is empty: pods authenticate islands with one secret each; run `diloco "
            'certs` and set network.secrets = ["file:kit/secrets/NAME", ...] (configs/two-region.toml)'
        )
    out: dict[str, SecretRef] = {}
    for i, (island, ref) in enumerate(zip(cfg.islands.island_names, refs, strict=True)):
        if not is_secret_reference(ref):
            raise DeployError(
                f"network.secrets[{i}] is a literal secret: pods read secrets from Kubernetes Secrets, "
                "so write env:VAR or file:PATH"
            )
        kind, _, where = ref.partition(":")
        if kind == "env":
            out[island] = SecretRef(env=where)
            continue
        if where.startswith("~") or not where:
            raise DeployError(
                f"network.secrets[{i}] = {ref!r}: a pod has no home directory to expand; write a path "
                f"relative to the image's {WORKDIR} (file:kit/secrets/{island}) or an absolute one"
            )
        path = posixpath.normpath(posixpath.join(WORKDIR, where))  # an absolute `where` stays itself
        out[island] = SecretRef(path=path)
    paths = [r.path for r in out.values() if r.path]
    if len(set(paths)) != len(paths):
        raise DeployError("network.secrets: two islands' secrets are the same file")
    return out


def metrics_ports(cfg: RunConfig) -> dict[str | None, int]:
    """/metrics port of the coordinator (key None) and of each island (diloco.ops.metrics.metrics_port: the config's
    rule, so the ports are the ones `launch` would use); 0: none."""
    from diloco.ops.metrics import metrics_port

    return {island: metrics_port(cfg, island) for island in (None, *cfg.islands.island_names)}


def tpu_chips(topology: str) -> int:
    """Chips of a slice topology such as "2x4" or "2x2x2"."""
    parts = topology.split("x")
    if not topology or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise DeployError(f"--tpu-topology must look like 2x4 or 2x2x2 (got {topology!r})")
    return math.prod(int(p) for p in parts)


# -- objects -----------------------------------------------------------------------------------------------------


def _meta(name: str, options: K8sOptions, labels: dict[str, str]) -> Obj:
    return {"name": name, "namespace": options.namespace, "labels": labels}


def _labels(n: Names, component: str, island: str | None = None) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "diloco",
        "app.kubernetes.io/instance": n.prefix,
        "app.kubernetes.io/component": component,
    }
    if island is not None:
        labels["diloco/island"] = n.islands[island]
    return labels


def _claim(name: str, labels: dict[str, str], options: K8sOptions, shared: bool) -> Obj:
    """A run-directory volume; `shared` (ReadWriteMany) when several pods of an island write it at once."""
    spec: Obj = {
        "accessModes": ["ReadWriteMany" if shared else "ReadWriteOnce"],
        "resources": {"requests": {"storage": options.storage}},
    }
    if options.storage_class:
        spec["storageClassName"] = options.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(name, options, labels), "spec": spec}


def _secret_volume(volume: str, secret: str, keys: Sequence[str]) -> Obj:
    """A Secret as a volume; group-readable (0440) because the pod's user reads it through fsGroup."""
    return {
        "name": volume,
        "secret": {"secretName": secret, "defaultMode": 0o440, "items": [{"key": k, "path": k} for k in keys]},
    }


def _secret_mount(volume: str, ref: SecretRef) -> list[Obj]:
    """Mount the key `secret` of an island Secret volume at the file its reference names (subPath: the one file,
    nothing else of its directory is hidden)."""
    return [{"name": volume, "mountPath": ref.path, "subPath": "secret", "readOnly": True}] if ref.path else []


def _secret_env(secret: str, ref: SecretRef) -> list[Obj]:
    return [{"name": ref.env, "valueFrom": {"secretKeyRef": {"name": secret, "key": "secret"}}}] if ref.env else []


def _pod_security() -> Obj:
    return {"runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID, "fsGroup": USER_ID}


def _container_security() -> Obj:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _common_volumes(n: Names, owner: str) -> list[Obj]:
    """The config (ConfigMap) and the run-directory volume of `owner` (its Deployment or Job)."""
    return [
        {"name": "config", "configMap": {"name": n.config}},
        {"name": "run", "persistentVolumeClaim": {"claimName": n.volume_claim(owner)}},
    ]


def _common_mounts() -> list[Obj]:
    return [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}, {"name": "run", "mountPath": DATA_DIR}]


def config_map(cfg: RunConfig, n: Names, options: K8sOptions) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(n.config, options, _labels(n, "config")),
        "data": {"config.toml": pod_config(cfg)},
    }


def coordinator_args(options: K8sOptions, metrics: int) -> list[str]:
    """`diloco coordinator` in its pod (README's step 2, with the pod's paths)."""
    args = [
        "coordinator",
        CONFIG_PATH,
        "--run-dir",
        RUN_DIR,
        "--listen",
        f"0.0.0.0:{options.port}",
        "--tls-cert",
        f"{TLS_DIR}/tls.crt",
        "--tls-key",
        f"{TLS_DIR}/tls.key",
        "--tls-ca",
        f"{TLS_DIR}/ca.crt",
        "--log-format",
        "json",
    ]
    if metrics:
        args += ["--metrics-port", str(metrics)]
    return args


def probe_args(options: K8sOptions, island: str) -> list[str]:
    """`diloco status` against the coordinator in its own pod, as `island` over mutual TLS: exit 0 when it serves."""
    return [
        "status",
        f"127.0.0.1:{options.port}",
        "--json",
        "--log-level",
        "error",
        "--name",
        island,
        "--secret",
        f"file:{PROBE_DIR}/secret",
        "--tls-ca",
        f"{PROBE_DIR}/ca.crt",
        "--tls-cert",
        f"{PROBE_DIR}/tls.crt",
        "--tls-key",
        f"{PROBE_DIR}/tls.key",
    ]


def coordinator_objects(cfg: RunConfig, n: Names, options: K8sOptions) -> list[Obj]:
    """Deployment (one replica, Recreate: one coordinator owns the run directory), Service, volume claim."""
    labels = _labels(n, "coordinator")
    refs = secret_refs(cfg)
    metrics = metrics_ports(cfg)[None]
    first = cfg.islands.island_names[0]
    volumes = [
        *_common_volumes(n, n.coordinator),
        _secret_volume("tls", n.coordinator_tls, ["ca.crt", "tls.crt", "tls.key"]),
    ]
    mounts = [*_common_mounts(), {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}]
    env: list[Obj] = [{"name": "JAX_PLATFORMS", "value": "cpu"}]  # the coordinator's outer step and eval run on CPU
    for island, ref in refs.items():
        volume = f"island-{n.islands[island]}"
        keys = ["ca.crt", "tls.crt", "tls.key", "secret"] if island == first else ["secret"]
        volumes.append(_secret_volume(volume, n.island_secret(island), keys))
        mounts += _secret_mount(volume, ref)
        env += _secret_env(n.island_secret(island), ref)
        if island == first:
            mounts.append({"name": volume, "mountPath": PROBE_DIR, "readOnly": True})
    ports = [{"name": "grpc", "containerPort": options.port}]
    if metrics:
        ports.append({"name": "metrics", "containerPort": metrics})
    container = {
        "name": "coordinator",
        "image": options.image,
        "workingDir": WORKDIR,
        "args": coordinator_args(options, metrics),
        "env": env,
        "ports": ports,
        "resources": {
            "requests": {"cpu": options.coordinator_cpu, "memory": options.coordinator_memory},
            "limits": {"memory": options.coordinator_memory},
        },
        "readinessProbe": {
            "exec": {"command": ["diloco", *probe_args(options, first)]},
            "periodSeconds": 30,
            "timeoutSeconds": 10,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "tcpSocket": {"port": "grpc"},
            "periodSeconds": 20,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "volumeMounts": mounts,
        "securityContext": _container_security(),
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(n.coordinator, options, labels),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "securityContext": _pod_security(),
                    "terminationGracePeriodSeconds": 60,  # SIGTERM: it checkpoints its last committed round
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }
    service_ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in ports]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(n.coordinator, options, labels),
        "spec": {"type": options.service_type, "selector": labels, "ports": service_ports},
    }
    return [_claim(n.volume_claim(n.coordinator), labels, options, shared=False), service, deployment]


def coordinator_address(n: Names, options: K8sOptions) -> str:
    """What the islands dial: --coordinator-address, or the coordinator Service's name in the cluster."""
    return options.coordinator_address or f"{n.coordinator}.{options.namespace}.svc:{options.port}"


def island_args(cfg: RunConfig, island: str, n: Names, options: K8sOptions, accelerator: str) -> list[str]:
    """`diloco island` in its pod (README's step 3, with the pod's paths); with several processes, this pod's
    process index comes from the Job ($(JOB_COMPLETION_INDEX), expanded by the kubelet)."""
    args = [
        "island",
        CONFIG_PATH,
        "--name",
        island,
        "--coordinator",
        coordinator_address(n, options),
        "--run-dir",
        RUN_DIR,
        "--tls-ca",
        f"{TLS_DIR}/ca.crt",
        "--tls-cert",
        f"{TLS_DIR}/tls.crt",
        "--tls-key",
        f"{TLS_DIR}/tls.key",
        "--log-format",
        "json",
    ]
    metrics = metrics_ports(cfg).get(island, 0)  # an admitted island serves none (diloco island's rule)
    if metrics:
        args += ["--metrics-port", str(metrics)]
    if island not in cfg.islands.island_names:  # admitted: its secret is no config reference, but its Secret's key
        args += ["--secret", f"file:{TLS_DIR}/secret"]
    processes = cfg.islands.processes
    if processes > 1:
        args += [
            "--process-id",
            "$(JOB_COMPLETION_INDEX)",
            "--num-processes",
            str(processes),
            "--island-coordinator",  # its own name: whichever pod leads serves jax.distributed there
            f"{n.island(island)}-$(JOB_COMPLETION_INDEX).{n.island(island)}:{ISLAND_COORDINATOR_PORT}",
        ]
    if accelerator == "pathways":
        args.append("islands.backend=pathways")  # a per-process key (not in the shared config.toml)
    return args


def island_resources(cfg: RunConfig, accelerator: str, options: K8sOptions) -> Obj:
    """Requests (and limits) of one island process: CPU and memory, plus its node's GPUs or TPU chips (extended
    resources go in limits; a request, when given, must equal the limit)."""
    requests: Obj = {"cpu": options.cpu, "memory": options.memory}
    limits: Obj = {"memory": options.memory}
    extended = {"nvidia-gpu": "nvidia.com/gpu", "tpu": "google.com/tpu"}.get(accelerator)
    if extended is not None:
        requests[extended] = limits[extended] = cfg.islands.devices
    return {"requests": requests, "limits": limits}


def _check_tpu(cfg: RunConfig, island: str, accelerator: str, options: K8sOptions) -> None:
    """A TPU island needs its slice named, and the slice's chips must be the island's devices: one pod per host,
    each taking every chip of its host (islands.devices), islands.processes hosts."""
    slice_type = (
        ("--tpu-type", options.tpu_type)
        if accelerator == "tpu"
        else ("--pathways-machine-type", options.pathways_machine_type)
    )
    for flag, value in (slice_type, ("--tpu-topology", options.tpu_topology)):
        if not value:
            raise DeployError(f"island {island} runs on {accelerator}: {flag} is required")
    if accelerator == "pathways" and not options.pathways_dir.startswith("gs://"):
        raise DeployError(
            f"island {island} runs on Pathways: --pathways-dir must be a gs:// location (got {options.pathways_dir!r})"
        )
    chips = tpu_chips(options.tpu_topology)
    devices = cfg.islands.devices * (cfg.islands.processes if accelerator == "tpu" else 1)
    if devices != chips:
        what = "islands.devices × islands.processes" if accelerator == "tpu" else "islands.devices"
        raise DeployError(
            f"--tpu-topology {options.tpu_topology} has {chips} chips but {what} is {devices}: an "
            "island's mesh is its whole slice"
        )


def island_pod(cfg: RunConfig, island: str, n: Names, options: K8sOptions, placement: Placement) -> Obj:
    """The pod template of one island process (for a Job, or for a PathwaysJob's controller)."""
    labels = _labels(n, "island", island)
    ref = secret_refs(cfg).get(island, SecretRef())  # an admitted island reads its secret where its Secret is mounted
    secret = n.island_secret(island)
    volumes = [
        *_common_volumes(n, n.island(island)),
        _secret_volume("island", secret, ["ca.crt", "tls.crt", "tls.key", "secret"]),
    ]
    mounts = [
        *_common_mounts(),
        {"name": "island", "mountPath": TLS_DIR, "readOnly": True},
        *_secret_mount("island", ref),
    ]
    env = _secret_env(secret, ref)
    platform = JAX_PLATFORM.get(placement.accelerator)
    if platform is not None:
        env.append({"name": "JAX_PLATFORMS", "value": platform})
    if placement.accelerator == "cpu":
        from diloco.harness.procs import devices_env

        env += [{"name": k, "value": v} for k, v in devices_env(cfg.islands.devices, xla_flags="").items()]
    ports = []
    metrics = metrics_ports(cfg).get(island, 0)
    if metrics:
        ports.append({"name": "metrics", "containerPort": metrics})
    if cfg.islands.processes > 1:
        ports.append({"name": "jax", "containerPort": ISLAND_COORDINATOR_PORT})
    container = {
        "name": ISLAND_CONTAINER,
        "image": placement.image,
        "workingDir": WORKDIR,
        "args": island_args(cfg, island, n, options, placement.accelerator),
        "env": env,
        "ports": ports,
        "resources": island_resources(cfg, placement.accelerator, options),
        "volumeMounts": mounts,
        "securityContext": _container_security(),
    }
    spec: Obj = {
        "restartPolicy": "Never",
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": volumes,
    }
    if cfg.islands.processes > 1:
        spec["subdomain"] = n.island(island)  # with the Job's hostname <job>-<index>: <job>-0.<service> is process 0
    if placement.accelerator == "tpu":
        spec["nodeSelector"] = {
            "cloud.google.com/gke-tpu-accelerator": options.tpu_type,
            "cloud.google.com/gke-tpu-topology": options.tpu_topology,
        }
    return {"metadata": {"labels": labels}, "spec": spec}


def island_objects(cfg: RunConfig, island: str, n: Names, options: K8sOptions) -> list[Obj]:
    """One island: its volume claim, its headless Service (several processes) and its Job (or PathwaysJob)."""
    placement = options.placements.get(island, Placement("cpu", options.image))
    if placement.accelerator in ("tpu", "pathways"):
        _check_tpu(cfg, island, placement.accelerator, options)
    processes = cfg.islands.processes
    if placement.accelerator == "pathways" and processes != 1:
        raise DeployError(
            f"island {island} runs on Pathways, which drives the slice from one process: islands.processes must be 1"
        )
    labels = _labels(n, "island", island)
    pod = island_pod(cfg, island, n, options, placement)
    out = [_claim(n.volume_claim(n.island(island)), labels, options, shared=processes > 1)]
    if processes > 1:
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _meta(n.island(island), options, labels),
                "spec": {
                    "clusterIP": "None",
                    "selector": labels,
                    # process 0's name resolves before its pod is ready: the others dial it at start
                    "publishNotReadyAddresses": True,
                    "ports": [{"name": "jax", "port": ISLAND_COORDINATOR_PORT, "targetPort": "jax"}],
                },
            }
        )
    if processes > 1:
        out.append(island_network_policy(cfg, island, n, options))
    if placement.accelerator == "pathways":
        out.append(pathways_job(island, n, options, pod))
        return out
    job_spec = {
        "completionMode": "Indexed",
        "completions": processes,
        "parallelism": processes,
        "backoffLimit": ISLAND_POD_RESTARTS * processes,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": ISLAND_CONTAINER, "operator": "In", "values": [USER_ERROR_EXIT]},
                },
                # the API of Kubernetes 1.34 and older requires status (1.35 makes it optional)
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "template": pod,
    }
    out.append(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": _meta(n.island(island), options, labels),
            "spec": job_spec,
        }
    )
    return out


def island_network_policy(cfg: RunConfig, island: str, n: Names, options: K8sOptions) -> Obj:
    """Who may reach a multi-process island's pods: the island's own pods (JAX's distributed coordinator on process
    0 has no authentication, and the processes' collectives connect to one another on ports of their own), and
    anyone on the metrics port. Enforced where the cluster's network plugin enforces NetworkPolicies."""
    labels = _labels(n, "island", island)
    ingress: list[Obj] = [{"from": [{"podSelector": {"matchLabels": labels}}]}]
    if metrics_ports(cfg).get(island, 0):
        ingress.append({"ports": [{"protocol": "TCP", "port": "metrics"}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(n.island(island), options, labels),
        "spec": {"podSelector": {"matchLabels": labels}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def pathways_job(island: str, n: Names, options: K8sOptions, pod: Obj) -> Obj:
    """A PathwaysJob (google/pathways-job, api/v1: PathwaysJobSpec) whose main container is the island: its
    controller starts the Pathways resource manager and proxy beside it, sets JAX_PLATFORMS=proxy and
    JAX_BACKEND_TARGET in the main container, and runs the TPU workers (a JobSet restarted up to maxRestarts)."""
    return {
        "apiVersion": "pathways-job.pathways.domain/v1",
        "kind": "PathwaysJob",
        "metadata": _meta(n.island(island), options, pod["metadata"]["labels"]),
        "spec": {
            "maxRestarts": PATHWAYS_MAX_RESTARTS,
            "pathwaysDir": options.pathways_dir,
            "workers": [{"type": options.pathways_machine_type, "topology": options.tpu_topology, "numSlices": 1}],
            "controller": {"deploymentMode": "default", "mainContainerName": ISLAND_CONTAINER, "template": pod},
        },
    }


def render(cfg: RunConfig, options: K8sOptions) -> dict[str, list[Obj]]:
    """File name -> the Kubernetes objects in it, for the whole federation of `cfg`."""
    from diloco.config import require_federated

    require_federated(cfg, "deploy k8s")
    if options.service_type not in SERVICE_TYPES:
        raise DeployError(f"--service-type must be one of {', '.join(SERVICE_TYPES)} (got {options.service_type!r})")
    if not 0 < options.port <= 65535:
        raise DeployError(f"--port must be a port number, 1 to 65535 (got {options.port})")
    n = names(cfg, options)
    files: dict[str, list[Obj]] = {}
    if options.namespace != "default":
        files["00-namespace.yaml"] = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": options.namespace}}
        ]
    files["10-config.yaml"] = [config_map(cfg, n, options)]
    files["20-coordinator.yaml"] = coordinator_objects(cfg, n, options)
    for island in cfg.islands.island_names:
        files[f"30-island-{n.islands[island]}.yaml"] = island_objects(cfg, island, n, options)
    return files


def render_admitted(cfg: RunConfig, options: K8sOptions, island: str) -> dict[str, list[Obj]]:
    """File name -> objects of one island admitted into the live run (`diloco admit`): the run's ConfigMap and the
    island's volume claim and Job, the same as a configured island's, reading its secret from its own Secret (made
    from the admission's kit); the coordinator and the other islands are left as they run."""
    from diloco.config import require_federated
    from transport.auth import is_island_name, reserved_name_refusal

    require_federated(cfg, "deploy k8s")
    if not is_island_name(island):
        raise DeployError(f"--admit {island[:64]!r}: an island name is 1 to 64 characters of [A-Za-z0-9_-]")
    if reserved := reserved_name_refusal(island):
        raise DeployError(f"--admit: {reserved}")
    if island in cfg.islands.island_names:
        raise DeployError(
            f"--admit {island}: island {island!r} is configured (islands.names): its manifest is part of the "
            "federation's (render without --admit)"
        )
    n = names(cfg, options, admitted=island)
    # the config its pods read, the federation's own (applying it again changes nothing): one directory suffices
    # in another cluster too
    return {
        "10-config.yaml": [config_map(cfg, n, options)],
        f"30-island-{n.islands[island]}.yaml": island_objects(cfg, island, n, options),
    }


# -- secrets.sh ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScriptParts:
    """The parts a Secrets script makes, as its user names them: `names` (what may follow KIT_DIR), `usage` and
    `what` (how its usage line and its refusal of another part show them), `kit` (what KIT_DIR is)."""

    names: Sequence[str]
    usage: str
    what: str
    kit: str


def _script_head(comments: Sequence[str], parts: ScriptParts, options: K8sOptions) -> list[str]:
    """The start of a Secrets script: `comments`, KIT from its first argument, the parts asked for (each one of
    `parts`), `want` and `secret`, and the namespace."""
    ns = shlex.quote(options.namespace)
    lines = [
        "#!/bin/sh",
        *(f"# {line}" for line in comments),
        "set -eu",
        f'KIT="${{1:?usage: sh secrets.sh KIT_DIR [{parts.usage}]... (KIT_DIR: {parts.kit})}}"',
        "shift",
        'for part in "$@"; do',
        f'    case "$part" in {"|".join(map(shlex.quote, parts.names))}) ;;',
        f'        *) echo "secrets.sh: unknown part $part ({parts.what})" >&2; exit 2 ;;',
        "    esac",
        "done",
        'PARTS=" $* "',
        "",
        "# want PART...: whether one of these parts was asked for (none asked for: every part).",
        "want() {",
        '    [ "$PARTS" = "  " ] && return 0',
        '    for part in "$@"; do case "$PARTS" in *" $part "*) return 0 ;; esac; done',
        "    return 1",
        "}",
        "",
        "# secret NAME --from-file=KEY=FILE...: create or update one Secret. Not `create | apply`: a pipeline",
        "# fails only when its last command does, so a missing file would go unnoticed; `set -e` stops here.",
        "secret() {",
        "    name=$1",
        "    shift",
        f'    manifest=$(kubectl create secret generic "$name" --namespace {ns} "$@" --dry-run=client -o yaml)',
        "    printf '%s\\n' \"$manifest\" | kubectl apply --server-side -f -",
        "}",
        "",
    ]
    if options.namespace != "default":
        lines.append(f"kubectl create namespace {ns} --dry-run=client -o yaml | kubectl apply --server-side -f -")
    return lines


def _create(parts: Sequence[str], name: str, files: dict[str, str]) -> str:
    """The script's line that makes Secret `name` from kit files (key -> path in KIT) when one of `parts` is asked."""
    sources = " ".join(f'--from-file={key}="$KIT"/{shlex.quote(path)}' for key, path in files.items())
    return f"if want {' '.join(map(shlex.quote, parts))}; then secret {name} {sources}; fi"


def secrets_script(cfg: RunConfig, options: K8sOptions) -> str:
    """A shell script that makes the deployment's Secrets from `diloco certs` output (its --out, the script's first
    argument; the parts to make may follow: `coordinator`, island names). It names files; the secrets travel from
    them to the API server through a pipe, never through a manifest. `apply --server-side` makes it idempotent
    without copying the secret into a last-applied annotation."""
    n = names(cfg, options)
    host = coordinator_address(n, options).rpartition(":")[0]
    islands = cfg.islands.island_names
    example = islands[0]
    usage = [
        "Kubernetes Secrets for the manifests beside this script, from the files `diloco certs` wrote:",
        f"  diloco certs CONFIG --out kit --host {host}",
        "  sh secrets.sh kit                     every Secret (one cluster runs everything)",
        "  sh secrets.sh kit coordinator         the coordinator's cluster: its TLS and every island's Secret",
        f"  sh secrets.sh kit-{example} {example}     island {example}'s cluster: its own Secret only",
        f"      (kit-{example} holds what README's walkthrough copies to that island: ca.crt, "
        f"client-{example}.crt/.key, secrets/{example})",
    ]
    parts = ScriptParts(
        ["coordinator", *islands], "coordinator|ISLAND", "coordinator or an island name", "the --out of diloco certs"
    )
    lines = _script_head(usage, parts, options)
    tls = {"ca.crt": "ca.crt", "tls.crt": "server.crt", "tls.key": "server.key"}
    lines.append(_create(["coordinator"], n.coordinator_tls, tls))
    for island in islands:
        files = {
            "ca.crt": "ca.crt",
            "tls.crt": f"client-{island}.crt",
            "tls.key": f"client-{island}.key",
            "secret": f"secrets/{island}",
        }
        lines.append(_create(["coordinator", island], n.island_secret(island), files))
    return "\n".join(lines) + "\n"


def admitted_secrets_script(n: Names, options: K8sOptions, island: str, config_name: str) -> str:
    """secrets.sh of an admitted island's manifests: its one Secret, from the kit `diloco admit --ca-dir` wrote (its
    secret, its client certificate) with the federation's ca.crt copied in. Files are named, never inlined."""
    usage = [
        f"The Secret of island {island}, admitted into the live run, from the files `diloco admit` wrote:",
        *(f"  {command}" for command in admit_commands(n, options, island, config_name, "secrets.sh")[:3]),
    ]
    parts = ScriptParts([island], island, island, "the --out of diloco admit, with ca.crt copied in")
    lines = _script_head(usage, parts, options)
    files = {
        "ca.crt": "ca.crt",
        "tls.crt": f"client-{island}.crt",
        "tls.key": f"client-{island}.key",
        "secret": f"{island}.secret",
    }
    lines.append(_create([island], n.island_secret(island), files))
    return "\n".join(lines) + "\n"


def admit_commands(n: Names, options: K8sOptions, island: str, config_name: str, script: str) -> list[str]:
    """What an operator runs to bring an admitted island up in the cluster, in order: admit it (the coordinator must
    know it before its pod dials), make its Secret from the kit, apply its manifests. `diloco admit` needs the
    operator's credential and the CA key kept by `diloco certs --keep-ca-key` (here in kit/)."""
    address = coordinator_address(n, options)
    kit = shlex.quote(f"kit-{island}")
    return [
        f"diloco admit {shlex.quote(config_name)} {island} --coordinator {address} --out {kit} --ca-dir kit",
        f"cp kit/ca.crt {kit}/",
        f"sh {script} {kit}",
        f"kubectl apply -f {shlex.quote(str(Path(script).parent))}",
    ]


# -- the command -------------------------------------------------------------------------------------------------


def per_island(values: Sequence[str], islands: Sequence[str], flag: str, default: str) -> dict[str, str]:
    """`--flag VALUE` (every island; the last one counts) and `--flag NAME=VALUE` (island NAME, whatever the order)
    -> island name -> value."""
    out = dict.fromkeys(islands, default)
    named: dict[str, str] = {}
    for value in values:
        island, sep, rest = value.partition("=")
        if not sep:
            out = dict.fromkeys(islands, value)
        elif island in out:
            named[island] = rest
        else:
            raise DeployError(f"{flag} {value}: {island!r} is not one of islands.names ({', '.join(islands)})")
    return {**out, **named}


def options_from(args: argparse.Namespace, cfg: RunConfig) -> K8sOptions:
    islands = (args.admit,) if args.admit else cfg.islands.island_names
    default_accelerator = "pathways" if cfg.islands.backend == "pathways" else "cpu"
    accelerators = per_island(args.accelerator, islands, "--accelerator", default_accelerator)
    for island, accelerator in accelerators.items():
        if accelerator not in ACCELERATORS:
            raise DeployError(
                f"--accelerator for island {island} must be one of {', '.join(ACCELERATORS)} (got {accelerator!r})"
            )
    default_image = next((v for v in reversed(args.image) if "=" not in v), K8sOptions.image)
    images = per_island(args.image, islands, "--image", default_image)
    placements = {island: Placement(accelerators[island], images[island]) for island in islands}
    keys = (
        "namespace",
        "prefix",
        "port",
        "coordinator_address",
        "service_type",
        "cpu",
        "memory",
        "coordinator_cpu",
        "coordinator_memory",
        "storage",
        "storage_class",
        "tpu_type",
        "tpu_topology",
        "pathways_machine_type",
        "pathways_dir",
    )
    return K8sOptions(image=default_image, placements=placements, **{k: getattr(args, k) for k in keys})


def add_deploy_parser(sub: Any) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """`diloco deploy k8s CONFIG --out DIR ...` (argparse only: nothing is rendered or imported to build it); returns
    the `deploy` parser and its `k8s` subcommand's (the one that takes the common options)."""
    deploy = sub.add_parser("deploy", help="manifests to run a federation elsewhere (Kubernetes)")
    kinds = deploy.add_subparsers(dest="target", required=True)
    k8s = kinds.add_parser(
        "k8s",
        help="Kubernetes manifests: coordinator Deployment, island Jobs, secrets.sh",
        epilog="Trailing section.key=value arguments override the config.",
    )
    k8s.set_defaults(accepts_overrides=True)
    d = K8sOptions()
    k8s.add_argument("config", help="TOML run config (the one `diloco certs` made the secrets of)")
    k8s.add_argument("--out", type=Path, required=True, help="directory to write the manifests to (new or empty)")
    k8s.add_argument(
        "--admit",
        default="",
        metavar="NAME",
        help="only the manifests of island NAME, admitted into the live run (`diloco admit`), and the secrets.sh "
        "of its Secret; the output says what to run, in order",
    )
    k8s.add_argument("--namespace", default=d.namespace, help="Kubernetes namespace of every object")
    k8s.add_argument("--prefix", default=d.prefix, help="start of every object's name (default: run.name)")
    k8s.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="[ISLAND=]IMAGE",
        help=f"container image (built from the Dockerfile; default {d.image}); ISLAND=IMAGE for one "
        "island (a CUDA or TPU build of JAX)",
    )
    k8s.add_argument(
        "--accelerator",
        action="append",
        default=[],
        metavar="[ISLAND=]KIND",
        help=f"what islands run on: {', '.join(ACCELERATORS)} (default cpu, or pathways with "
        "islands.backend = 'pathways'); ISLAND=KIND for one island",
    )
    k8s.add_argument("--port", type=int, default=d.port, help="the coordinator's gRPC port")
    k8s.add_argument(
        "--coordinator-address",
        default=d.coordinator_address,
        metavar="HOST:PORT",
        help="what islands dial (default: the coordinator Service's in-cluster name); "
        "`diloco certs --host` must name HOST",
    )
    k8s.add_argument(
        "--service-type",
        default=d.service_type,
        choices=SERVICE_TYPES,
        help="the coordinator Service's type (LoadBalancer: islands in other clusters)",
    )
    k8s.add_argument("--cpu", default=d.cpu, help="CPU request of each island process")
    k8s.add_argument("--memory", default=d.memory, help="memory of each island process")
    k8s.add_argument("--coordinator-cpu", default=d.coordinator_cpu, help="CPU request of the coordinator")
    k8s.add_argument("--coordinator-memory", default=d.coordinator_memory, help="memory of the coordinator")
    k8s.add_argument("--storage", default=d.storage, help="size of each run-directory volume")
    k8s.add_argument("--storage-class", default=d.storage_class, help="storageClassName of the volumes")
    k8s.add_argument(
        "--tpu-type",
        default=d.tpu_type,
        metavar="ACCELERATOR",
        help="TPU islands: cloud.google.com/gke-tpu-accelerator (e.g. tpu-v5-lite-podslice)",
    )
    k8s.add_argument(
        "--tpu-topology",
        default=d.tpu_topology,
        metavar="AxB",
        help="TPU and Pathways islands: the slice topology (e.g. 2x4)",
    )
    k8s.add_argument(
        "--pathways-machine-type",
        default=d.pathways_machine_type,
        metavar="TYPE",
        help="Pathways islands: the TPU workers' machine type (e.g. ct5lp-hightpu-4t)",
    )
    k8s.add_argument(
        "--pathways-dir",
        default=d.pathways_dir,
        metavar="gs://...",
        help="Pathways islands: the PathwaysJob's pathwaysDir (a gs:// location)",
    )
    return deploy, k8s


HEADER = "# Rendered by `diloco deploy k8s` from {config}; apply with `kubectl apply -f {out}` after secrets.sh.\n"


def to_yaml(objects: Sequence[Obj]) -> str:
    """Block-style YAML in the objects' own key order, every value written out (no &anchors for the label maps
    that several objects share: a reader should not have to resolve them)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(objects, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=120)


def deploy_k8s(cfg: RunConfig, options: K8sOptions, out: Path, config_name: str, admit: str = "") -> dict[str, Any]:
    """Write the manifests and secrets.sh into `out` (refused when it holds anything: stale manifests of another
    render would be applied too); return what the user runs next. `admit`: only the manifests of that island,
    admitted into the live run, and the secrets.sh of its Secret."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DeployError(
            f"--out {out} is not an empty directory: render into a new one (kubectl apply -f DIR "
            "would apply stale manifests too)"
        )
    if admit:
        files = render_admitted(cfg, options, admit)
        n = names(cfg, options, admitted=admit)
        script = admitted_secrets_script(n, options, admit, config_name)
    else:
        files = render(cfg, options)
        script = secrets_script(cfg, options)
    out.mkdir(parents=True, exist_ok=True)
    header = HEADER.format(config=config_name, out=out)
    for name, objects in files.items():
        note = ""
        if name.startswith("30-island-"):
            note = "".join(f"# {line}\n" if line else "#\n" for line in ISLAND_RESTART_POLICY_NOTE.splitlines())
        if admit:  # its pod's first call is refused (exit 2, failing the Job) unless the coordinator admitted it
            note = (
                f"# Island {admit} joins the live run once admitted: run `diloco admit` before applying this.\n" + note
            )
        (out / name).write_text(header + note + to_yaml(objects))
    (out / "secrets.sh").write_text(script)
    (out / "secrets.sh").chmod(0o700)
    if admit:
        steps = admit_commands(n, options, admit, config_name, str(out / "secrets.sh"))
        return {"out": str(out), "files": [*files, "secrets.sh"], "next": steps}
    host = coordinator_address(names(cfg, options), options).rpartition(":")[0]
    return {
        "out": str(out),
        "files": [*files, "secrets.sh"],
        "next": [
            f"diloco certs {config_name} --out kit --host {host}",
            f"sh {out / 'secrets.sh'} kit",
            f"kubectl apply -f {out}",
        ],
    }


def run_deploy(args: argparse.Namespace) -> int:
    """The `deploy` command: load the config (with overrides), render, write, print what to run next (JSON)."""
    from diloco.config import load_config

    cfg = load_config(args.config, args.overrides)
    result = deploy_k8s(cfg, options_from(args, cfg), args.out, args.config, args.admit)
    print(json.dumps(result, indent=2))
    return 0
