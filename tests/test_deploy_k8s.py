"""`diloco deploy k8s`: the manifests, parsed back and checked field by field against what the pods need.

Each test renders through the real command line (diloco.cli.main) into a temporary directory and reads the YAML
back with PyYAML: the container command lines must parse with diloco's own parser, every path a command names
must be mounted, every Secret a pod mounts must be one secrets.sh creates (secrets.sh itself runs against a
stand-in `kubectl` that checks each file it is given exists in a real `diloco certs` kit), and no secret or key
from that kit may appear in any rendered file.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.cli import OVERRIDE, build_parser, main
from diloco.config import config_digest, load_config
from diloco.deploy import k8s
from diloco.harness.procs import wait_until
from tests.conftest import REPO

TWO_REGION = REPO / "configs" / "two-region.toml"
METRICS = ["network.metrics_port=9100"]
Obj = dict[str, Any]


def render(tmp_path: Path, *extra: str, config: Path = TWO_REGION, out: str = "k8s") -> dict[str, list[Obj]]:
    """`diloco deploy k8s CONFIG --out DIR EXTRA...` -> file name -> its objects, parsed back from YAML."""
    target = tmp_path / out
    assert main(["deploy", "k8s", str(config), "--out", str(target), *extra]) == 0
    return {p.name: [o for o in yaml.safe_load_all(p.read_text()) if o] for p in sorted(target.glob("*.yaml"))}


def fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str, expected: str, config: Path = TWO_REGION
) -> None:
    assert main(["deploy", "k8s", str(config), "--out", str(tmp_path / "bad"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error:") and expected in err, err
    assert "\n" not in err and "Traceback" not in err


def objects(files: dict[str, list[Obj]], kind: str) -> list[Obj]:
    return [o for objs in files.values() for o in objs if o["kind"] == kind]


def one(files: dict[str, list[Obj]], kind: str, name: str) -> Obj:
    (found,) = [o for o in objects(files, kind) if o["metadata"]["name"] == name]
    return found


def parse(argv: list[str]) -> Any:
    """A container's command line as `diloco` parses it (main's rule: unknown arguments must be overrides)."""
    args, extra = build_parser().parse_known_args(argv)
    assert all(OVERRIDE.match(a) for a in extra), extra
    return args


def pod_spec(workload: Obj) -> Obj:
    if workload["kind"] == "PathwaysJob":
        return workload["spec"]["controller"]["template"]["spec"]
    return workload["spec"]["template"]["spec"]


def mounted(spec: Obj, container: Obj, path: str) -> tuple[Obj, Obj]:
    """The volume and the mount that hold `path` in `container` (the deepest mount that contains it)."""
    mounts = [m for m in container["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")]
    assert mounts, f"{path} is not on any volume of {container['name']}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return volume, mount


def secret_key_at(spec: Obj, container: Obj, path: str) -> tuple[str, str]:
    """(Secret name, key) whose value the file `path` of `container` holds."""
    volume, mount = mounted(spec, container, path)
    assert "secret" in volume, f"{path} is not from a Secret"
    inside = mount.get("subPath") or path[len(mount["mountPath"]) + 1 :]
    (item,) = [i for i in volume["secret"]["items"] if i["path"] == inside]
    return volume["secret"]["secretName"], item["key"]


def script_files(out: Path) -> dict[str, dict[str, str]]:
    """Secret name -> key -> the file of the kit it is made from, as secrets.sh creates them."""
    made: dict[str, dict[str, str]] = {}
    for line in (out / "secrets.sh").read_text().splitlines():
        if m := re.search(r"then secret (\S+) --from-file=", line):
            made[m.group(1)] = dict(re.findall(r'--from-file=([^=]+)="\$KIT"/([^\s;]+)', line))
    return made


def script_secrets(out: Path) -> dict[str, set[str]]:
    """Secret name -> its keys, as secrets.sh creates them."""
    return {name: set(keys) for name, keys in script_files(out).items()}


def test_two_region_coordinator(tmp_path: Path) -> None:
    files = render(tmp_path, *METRICS)
    cfg = load_config(TWO_REGION, METRICS)
    assert set(files) == {"10-config.yaml", "20-coordinator.yaml", "30-island-us-east.yaml", "30-island-eu-west.yaml"}
    dep = one(files, "Deployment", "two-region-coordinator")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    spec = pod_spec(dep)
    (container,) = spec["containers"]
    args = build_parser().parse_args(container["args"])
    assert (args.command, args.config, args.listen) == ("coordinator", k8s.CONFIG_PATH, "0.0.0.0:50051")
    assert args.metrics_port == cfg.network.metrics_port == 9100
    # The config is the ConfigMap's; the run directory is on the claim, which outlives the pod.
    volume, _ = mounted(spec, container, args.config)
    assert volume["configMap"]["name"] == one(files, "ConfigMap", "two-region-config")["metadata"]["name"]
    volume, _ = mounted(spec, container, str(args.run_dir))
    claim = one(files, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    # TLS from the coordinator's Secret; every island's secret where the config's reference points.
    assert secret_key_at(spec, container, args.tls_cert) == ("two-region-coordinator-tls", "tls.crt")
    assert secret_key_at(spec, container, args.tls_key) == ("two-region-coordinator-tls", "tls.key")
    assert secret_key_at(spec, container, args.tls_ca) == ("two-region-coordinator-tls", "ca.crt")
    for island, ref in zip(cfg.islands.island_names, cfg.network.secrets, strict=True):
        path = f"{container['workingDir']}/{ref.removeprefix('file:')}"
        assert secret_key_at(spec, container, path) == (f"two-region-island-{island}", "secret")
    # Ports: the Service exposes what the container listens on, by name.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9100}
    svc = one(files, "Service", "two-region-coordinator")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "grpc": (50051, "grpc"),
        "metrics": (9100, "metrics"),
    }
    assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    # Probes: readiness is the gRPC health check through `diloco status` over mutual TLS, as the first island.
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[0] == "diloco"
    status = build_parser().parse_args(probe[1:])
    assert status.command == "status" and status.address == "127.0.0.1:50051" and status.name == "us-east"
    for path in (status.tls_ca, status.tls_cert, status.tls_key, status.secret.removeprefix("file:")):
        assert secret_key_at(spec, container, path)[0] == "two-region-island-us-east"
    assert container["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert spec["securityContext"]["runAsNonRoot"] is True


def test_two_region_islands(tmp_path: Path) -> None:
    files = render(tmp_path, *METRICS)
    cfg = load_config(TWO_REGION, METRICS)
    svc = one(files, "Service", "two-region-coordinator")
    for i, island in enumerate(cfg.islands.island_names):
        job = one(files, "Job", f"two-region-island-{island}")
        spec = job["spec"]
        assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 1, 1)
        assert spec["template"]["spec"]["restartPolicy"] == "Never"
        rules = spec["podFailurePolicy"]["rules"]
        assert {
            "action": "FailJob",
            "onExitCodes": {"containerName": "island", "operator": "In", "values": [2]},
        } in rules
        assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
        (container,) = pod_spec(job)["containers"]
        args = build_parser().parse_args(container["args"])
        assert (args.command, args.name, args.config) == ("island", island, k8s.CONFIG_PATH)
        assert args.coordinator == f"{svc['metadata']['name']}.default.svc:{svc['spec']['ports'][0]['port']}"
        assert args.metrics_port == 9100 + 1 + i
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": args.metrics_port}
        spec_ = pod_spec(job)
        for path, key in ((args.tls_ca, "ca.crt"), (args.tls_cert, "tls.crt"), (args.tls_key, "tls.key")):
            assert secret_key_at(spec_, container, path) == (f"two-region-island-{island}", key)
        ref = cfg.network.secrets[i].removeprefix("file:")
        assert secret_key_at(spec_, container, f"{container['workingDir']}/{ref}") == (
            f"two-region-island-{island}",
            "secret",
        )
        volume, _ = mounted(spec_, container, str(args.run_dir))
        assert one(files, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["JAX_PLATFORMS"] == "cpu" and env["XLA_FLAGS"].endswith(f"={cfg.islands.devices}")
        assert set(container["resources"]["requests"]) == {"cpu", "memory"}
        assert "subdomain" not in spec_  # one process: no island coordinator to find
    assert not [s for s in objects(files, "Service") if s["spec"].get("clusterIP") == "None"]


def test_the_config_map_is_the_same_run(tmp_path: Path) -> None:
    """The pods' config has the run's identity (config digest) and references, never a secret."""
    files = render(tmp_path, *METRICS)
    text = one(files, "ConfigMap", "two-region-config")["data"]["config.toml"]
    (tmp_path / "pod.toml").write_text(text)
    pod = load_config(tmp_path / "pod.toml")
    assert config_digest(pod) == config_digest(load_config(TWO_REGION, METRICS))
    assert pod.network.secrets == ("file:kit/secrets/us-east", "file:kit/secrets/eu-west")
    assert pod.network.metrics_host == "0.0.0.0"  # a pod's /metrics must be reachable from outside it


def test_secrets_are_referenced_never_inlined(tmp_path: Path) -> None:
    """A real kit from `diloco certs`: secrets.sh names exactly its files (checked by a stand-in kubectl), every
    Secret a pod mounts is one it creates with the keys the pod reads, and nothing of the kit is in a manifest."""
    kit = tmp_path / "kit"
    assert main(["certs", str(TWO_REGION), "--out", str(kit), "--host", "two-region-coordinator.default.svc"]) == 0
    files = render(tmp_path, *METRICS)
    out = tmp_path / "k8s"
    made = script_secrets(out)
    assert made == {
        "two-region-coordinator-tls": {"ca.crt", "tls.crt", "tls.key"},
        "two-region-island-us-east": {"ca.crt", "tls.crt", "tls.key", "secret"},
        "two-region-island-eu-west": {"ca.crt", "tls.crt", "tls.key", "secret"},
    }
    for workload in [*objects(files, "Deployment"), *objects(files, "Job")]:
        spec = pod_spec(workload)
        for volume in spec["volumes"]:
            if "secret" in volume:
                keys = {item["key"] for item in volume["secret"]["items"]}
                assert keys <= made[volume["secret"]["secretName"]]
        for env in spec["containers"][0]["env"]:
            assert "value" in env  # two-region's secrets are files: no env var carries one
    rendered = "".join(p.read_text() for p in out.iterdir())
    for path in kit.rglob("*"):
        if path.is_file() and path.name != "ca.crt" and not path.name.endswith(".crt"):
            assert path.read_text().strip() not in rendered, path  # keys and secrets
    assert "PRIVATE KEY" not in rendered and "BEGIN" not in rendered
    # secrets.sh against a kubectl that fails unless each --from-file exists and keeps what it would send.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "kubectl"
    fake.write_text(
        '#!/bin/sh\nif [ "$1" = create ]; then\n  for a in "$@"; do case "$a" in --from-file=*)\n'
        '    f="${a#*=}"; f="${f#*=}"; [ -f "$f" ] || { echo "missing $f" >&2; exit 1; };;\n'
        '  esac; done; echo "kind: Secret"\nelse cat >> "$(dirname "$0")/applied"; fi\n'
    )
    fake.chmod(0o755)
    applied = bin_dir / "applied"

    def secrets_sh(*args: str) -> tuple[int, str, int]:
        """(exit code, stderr, Secrets applied) of `sh secrets.sh ARGS`."""
        applied.write_text("")
        done = subprocess.run(
            ["sh", str(out / "secrets.sh"), *args],
            env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.returncode, done.stderr, applied.read_text().count("kind: Secret")

    assert secrets_sh(str(kit)) == (0, "", 3)
    assert secrets_sh(str(kit), "coordinator") == (0, "", 3)
    # An island's cluster, from what README's walkthrough copies to that island's machine, and nothing else.
    own = tmp_path / "kit-us-east"
    (own / "secrets").mkdir(parents=True)
    for name in ("ca.crt", "client-us-east.crt", "client-us-east.key", "secrets/us-east"):
        (own / name).write_bytes((kit / name).read_bytes())
    assert secrets_sh(str(own), "us-east") == (0, "", 1)
    code, err, _ = secrets_sh(str(own), "coordinator")
    assert code != 0 and "server.crt" in err
    code, err, _ = secrets_sh(str(kit), "us-wset")
    assert code == 2 and "unknown part us-wset" in err


def test_env_secret_references_become_secret_env_vars(tmp_path: Path) -> None:
    files = render(tmp_path, 'network.secrets=["env:US_EAST_SECRET", "file:/etc/eu-west/secret"]')
    dep = one(files, "Deployment", "two-region-coordinator")
    (container,) = pod_spec(dep)["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["US_EAST_SECRET"]["valueFrom"] == {
        "secretKeyRef": {"name": "two-region-island-us-east", "key": "secret"}
    }
    assert secret_key_at(pod_spec(dep), container, "/etc/eu-west/secret") == ("two-region-island-eu-west", "secret")


def test_multi_process_island_finds_its_coordinator(tmp_path: Path) -> None:
    files = render(tmp_path, *METRICS, "islands.processes=2")
    for island in ("us-east", "eu-west"):
        job = one(files, "Job", f"two-region-island-{island}")
        spec = job["spec"]
        assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
        assert spec["backoffLimit"] == k8s.ISLAND_POD_RESTARTS * 2
        pod = pod_spec(job)
        (container,) = pod["containers"]
        # The Job names pod i `<job>-<i>` under the subdomain: pod i, when it leads, serves at `<job>-<i>.<service>`.
        headless = one(files, "Service", pod["subdomain"])
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
        assert headless["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]
        jax_port = {p["name"]: p["containerPort"] for p in container["ports"]}["jax"]
        assert headless["spec"]["ports"] == [{"name": "jax", "port": jax_port, "targetPort": "jax"}]
        assert "$(JOB_COMPLETION_INDEX)" in container["args"]
        claim = one(
            files,
            "PersistentVolumeClaim",
            mounted(pod, container, k8s.RUN_DIR)[0]["persistentVolumeClaim"]["claimName"],
        )
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every process of the island writes it
        # JAX's distributed coordinator has no authentication: only the island's own pods may reach its pods.
        policy = one(files, "NetworkPolicy", job["metadata"]["name"])["spec"]
        assert policy["podSelector"]["matchLabels"] == job["spec"]["template"]["metadata"]["labels"]
        assert policy["ingress"] == [
            {"from": [{"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}]},
            {"ports": [{"protocol": "TCP", "port": "metrics"}]},
        ]
        for index in (0, 1):  # what the kubelet runs in pod `index`
            argv = [a.replace("$(JOB_COMPLETION_INDEX)", str(index)) for a in container["args"]]
            args = build_parser().parse_args(argv)
            assert args.island_coordinator == f"{job['metadata']['name']}-{index}.{pod['subdomain']}:{jax_port}"
            assert int(args.process_id) == index and int(args.num_processes) == 2


@pytest.mark.parametrize(
    "accelerator, resource, platform", [("nvidia-gpu", "nvidia.com/gpu", "cuda"), ("tpu", "google.com/tpu", "tpu")]
)
def test_accelerator_requests(tmp_path: Path, accelerator: str, resource: str, platform: str) -> None:
    tpu = ["--tpu-type", "tpu-v5-lite-podslice", "--tpu-topology", "2x2"]
    files = render(
        tmp_path,
        "--accelerator",
        f"eu-west={accelerator}",
        "--image",
        "eu-west=reg/diloco:tpu",
        "--image",
        "reg/diloco:1",
        *tpu,
        "islands.devices=4",
    )
    east, west = (pod_spec(one(files, "Job", f"two-region-island-{i}")) for i in ("us-east", "eu-west"))
    assert resource not in east["containers"][0]["resources"]["requests"]
    assert east["containers"][0]["image"] == "reg/diloco:1" and "nodeSelector" not in east
    (container,) = west["containers"]
    assert container["image"] == "reg/diloco:tpu"
    assert container["resources"]["requests"][resource] == container["resources"]["limits"][resource] == 4
    assert {e["name"]: e.get("value") for e in container["env"]}["JAX_PLATFORMS"] == platform
    if accelerator == "tpu":
        assert west["nodeSelector"] == {
            "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
            "cloud.google.com/gke-tpu-topology": "2x2",
        }
    assert pod_spec(one(files, "Deployment", "two-region-coordinator"))["containers"][0]["image"] == "reg/diloco:1"


def test_multi_host_tpu_island(tmp_path: Path) -> None:
    """A 2x4 slice of 4-chip hosts: two pods, each taking its host's 4 chips on the slice's node pool."""
    files = render(
        tmp_path,
        "--accelerator",
        "tpu",
        "--tpu-type",
        "tpu-v5-lite-podslice",
        "--tpu-topology",
        "2x4",
        "islands.devices=4",
        "islands.processes=2",
    )
    job = one(files, "Job", "two-region-island-us-east")
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    pod = pod_spec(job)
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == 4
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"


def test_pathways_island(tmp_path: Path) -> None:
    """An island on a Pathways slice: a PathwaysJob whose main container is the island, which requests no TPU
    (the PathwaysJob's workers do) and runs with islands.backend = pathways."""
    files = render(
        tmp_path,
        "--accelerator",
        "eu-west=pathways",
        "--pathways-machine-type",
        "ct5lp-hightpu-4t",
        "--tpu-topology",
        "2x2",
        "--pathways-dir",
        "gs://bucket/tmp",
        "islands.devices=4",
    )
    job = one(files, "PathwaysJob", "two-region-island-eu-west")
    assert job["apiVersion"] == "pathways-job.pathways.domain/v1"
    assert job["spec"]["workers"] == [{"type": "ct5lp-hightpu-4t", "topology": "2x2", "numSlices": 1}]
    assert job["spec"]["pathwaysDir"] == "gs://bucket/tmp"
    (container,) = pod_spec(job)["containers"]
    assert job["spec"]["controller"]["mainContainerName"] == container["name"]
    args = parse(container["args"])
    assert args.name == "eu-west" and "islands.backend=pathways" in container["args"]
    assert "google.com/tpu" not in container["resources"]["limits"]
    assert "JAX_PLATFORMS" not in {e["name"] for e in container["env"]}  # the PathwaysJob sets it (proxy)
    assert one(files, "Job", "two-region-island-us-east")  # the other island is unchanged


def test_names_are_dns_labels(tmp_path: Path) -> None:
    files = render(
        tmp_path,
        'islands.names=["US_East", "eu-west"]',
        "--namespace",
        "diloco-prod",
        *METRICS,
        'network.secrets=["file:kit/secrets/US_East", "file:kit/secrets/eu-west"]',
    )
    assert files["00-namespace.yaml"][0]["metadata"]["name"] == "diloco-prod"
    for obj in [o for objs in files.values() for o in objs]:
        name = obj["metadata"]["name"]
        assert k8s.DNS_LABEL.match(name) and len(name) <= 63, name
        if obj["kind"] == "Service":
            assert k8s.DNS_1035_LABEL.match(name), name
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "diloco-prod"
    job = one(files, "Job", "two-region-island-us-east")
    args = build_parser().parse_args(pod_spec(job)["containers"][0]["args"])
    assert args.name == "US_East"  # the island keeps its name; only Kubernetes names are lowered
    assert args.coordinator == "two-region-coordinator.diloco-prod.svc:50051"


def test_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fails(
        capsys,
        tmp_path,
        'islands.names=["a-", "b"]',
        'network.secrets=["env:A", "env:B"]',
        expected="island name 'a-' cannot name Kubernetes objects",
    )
    fails(
        capsys,
        tmp_path,
        'islands.names=["a_b", "a-b"]',
        'network.secrets=["env:A", "env:B"]',
        expected="would share the Kubernetes name 'a-b'",
    )
    fails(capsys, tmp_path, "--prefix", "9lives", expected="--prefix '9lives' cannot name Kubernetes objects")
    fails(capsys, tmp_path, "--namespace", "Prod", expected="--namespace 'Prod' cannot name Kubernetes objects")
    fails(
        capsys,
        tmp_path,
        "--accelerator",
        "tpu",
        "--tpu-type",
        "t",
        "--tpu-topology",
        "2by4",
        expected="--tpu-topology must look like 2x4",
    )
    fails(capsys, tmp_path, "network.secrets=[]", expected="network.secrets is empty")
    fails(capsys, tmp_path, "--accelerator", "eu-west=tpu", "--tpu-topology", "2x2", expected="--tpu-type is required")
    fails(
        capsys,
        tmp_path,
        "--accelerator",
        "tpu",
        "--tpu-type",
        "tpu-v5-lite-podslice",
        "--tpu-topology",
        "2x4",
        expected="--tpu-topology 2x4 has 8 chips but islands.devices × islands.processes is 1",
    )
    fails(capsys, tmp_path, "--accelerator", "us-wset=cpu", expected="'us-wset' is not one of islands.names")
    fails(capsys, tmp_path, "--accelerator", "fpga", expected="must be one of cpu, nvidia-gpu, tpu, pathways")
    fails(
        capsys,
        tmp_path,
        "--accelerator",
        "eu-west=pathways",
        "--pathways-machine-type",
        "ct5lp-hightpu-4t",
        "--tpu-topology",
        "1x1",
        "--pathways-dir",
        "/tmp/x",
        expected="--pathways-dir must be a gs:// location",
    )
    fails(
        capsys,
        tmp_path,
        "--accelerator",
        "eu-west=pathways",
        "--pathways-machine-type",
        "ct5lp-hightpu-4t",
        "--tpu-topology",
        "1x1",
        "--pathways-dir",
        "gs://b",
        "islands.processes=2",
        expected="island eu-west runs on Pathways, which drives the slice from one process",
    )
    fails(capsys, tmp_path, "train.mode=sync", expected="train.mode = 'sync'")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "old.yaml").write_text("kind: Job\n")
    fails(capsys, tmp_path, expected="is not an empty directory")


def test_dockerfile_matches_the_manifests() -> None:
    """No docker here: check that the Dockerfile copies what exists, installs with the constraints, runs as the
    user and in the directory the manifests assume, with `diloco` as its entrypoint."""
    lines = [ln.strip() for ln in (REPO / "Dockerfile").read_text().splitlines() if ln.strip() and ln[0] != "#"]
    (base,) = [ln.split()[1] for ln in lines if ln.startswith("FROM ")]
    assert re.fullmatch(r"python:3\.(1[1-9])-slim", base), base
    copied = [src for ln in lines if ln.startswith("COPY ") for src in ln.split()[1:-1]]
    assert copied and all((REPO / src).exists() for src in copied), copied
    for package in (
        "diloco",
        "floor",
        "islands",
        "outer_optimizer",
        "pytrees",
        "transport",
        "pyproject.toml",
        "constraints.txt",
    ):
        assert package in copied
    install = next(ln for ln in lines if "pip install" in ln)
    assert "-c /src/constraints.txt" in install
    assert [ln.split()[1] for ln in lines if ln.startswith("WORKDIR ")] == [k8s.WORKDIR]
    assert [ln.split()[1] for ln in lines if ln.startswith("USER ")] == [f"{k8s.USER_ID}:{k8s.USER_ID}"]
    assert str(k8s.USER_ID) in next(ln for ln in lines if "useradd" in ln)
    assert 'ENTRYPOINT ["diloco"]' in lines
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in ignore  # an allow-list: .venv, runs, kits stay out of the build context
    assert {"**/*.key", "**/secrets"} <= set(ignore)
    allowed = {ln[1:] for ln in ignore if ln.startswith("!")}
    assert set(copied) - {"pyproject.toml", "README.md", "constraints.txt"} <= allowed


def lay_out_pod(
    root: Path, pod: Obj, container: Obj, config_maps: dict[str, Obj], kit: Path, secrets: dict[str, dict[str, str]]
) -> None:
    """What the kubelet would mount for `container`, under `root`: ConfigMap keys, Secret items (from the kit files
    secrets.sh makes them of), subPath files, volume claims as empty directories."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        volume, target = volumes[mount["name"]], root / mount["mountPath"].lstrip("/")
        if "persistentVolumeClaim" in volume:
            target.mkdir(parents=True, exist_ok=True)
            continue
        if "configMap" in volume:
            items = config_maps[volume["configMap"]["name"]]["data"]
        else:
            source = secrets[volume["secret"]["secretName"]]
            items = {i["path"]: (kit / source[i["key"]]).read_text() for i in volume["secret"]["items"]}
        if "subPath" in mount:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(items[mount["subPath"]])
            continue
        target.mkdir(parents=True, exist_ok=True)
        for name, text in items.items():
            (target / name).write_text(text)
            (target / name).chmod(0o600)


def in_root(root: Path, argv: list[str]) -> list[str]:
    """A container's command line with its absolute paths (and file: references) moved under `root`."""

    def move(arg: str) -> str:
        kind, sep, rest = arg.partition(":")
        if sep and kind == "file" and rest.startswith("/"):
            return f"file:{root}{rest}"
        return f"{root}{arg}" if arg.startswith("/") else arg

    return [move(a) for a in argv]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_rendered_coordinator_serves_and_its_probe_passes(tmp_path: Path) -> None:
    """The coordinator pod without a cluster: its files laid out as the kubelet would mount them (from a real
    `diloco certs` kit, through secrets.sh's mapping), its rendered command line run, and its rendered readiness
    probe run until the coordinator says SERVING: the args, mounts, Secret items, config and probe agree."""
    from tests.conftest import child_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kit = tmp_path / "kit"
    assert main(["certs", str(TWO_REGION), "--out", str(kit)]) == 0
    files = render(tmp_path, "--port", str(port))
    dep = one(files, "Deployment", "two-region-coordinator")
    pod = pod_spec(dep)
    (container,) = pod["containers"]
    root = tmp_path / "pod"
    maps = {o["metadata"]["name"]: o for o in objects(files, "ConfigMap")}
    lay_out_pod(root, pod, container, maps, kit, script_files(tmp_path / "k8s"))
    cwd = root / container["workingDir"].lstrip("/")
    env = {**child_env(), **{e["name"]: e["value"] for e in container["env"]}}
    argv = [sys.executable, "-m", "diloco.cli", *in_root(root, container["args"])]
    probe = [sys.executable, "-m", "diloco.cli", *in_root(root, container["readinessProbe"]["exec"]["command"][1:])]
    with open(tmp_path / "coordinator.log", "wb") as log:
        coordinator = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:

        def ready() -> subprocess.CompletedProcess[str] | None:
            done = subprocess.run(probe, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
            return done if done.returncode == 0 else None

        def running() -> None:
            assert coordinator.poll() is None, (tmp_path / "coordinator.log").read_text()[-2000:]

        done = wait_until(ready, "the readiness probe to pass", 300, poll_s=1.0, check=running)
        status = json.loads(done.stdout)
        assert status["health"] == "SERVING" and status["run_id"] == "two-region"
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=60)


def test_an_admitted_island_gets_its_manifests_and_its_secret_by_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`deploy k8s --admit NAME`: the island's volume claim and Job, as a configured island's, reading its secret and
    client certificate from its own Secret, which secrets.sh makes from the very files `diloco admit --ca-dir`
    writes (with ca.crt copied in); no secret in any manifest; the steps to run, admission first."""
    from diloco.ops.roster_ops import write_island_kit

    kit = tmp_path / "kit"
    host = "two-region-coordinator.default.svc"
    assert main(["certs", str(TWO_REGION), "--out", str(kit), "--host", host, "--keep-ca-key"]) == 0
    capsys.readouterr()
    files = render(tmp_path, "--admit", "sa-east", "--image", "sa-east=diloco:cuda", *METRICS)
    steps = json.loads(capsys.readouterr().out)["next"]
    assert steps[0].startswith(f"diloco admit {TWO_REGION} sa-east --coordinator {host}:50051 --out kit-sa-east")
    assert steps[-1] == f"kubectl apply -f {tmp_path / 'k8s'}"
    assert list(files) == ["10-config.yaml", "30-island-sa-east.yaml"] and not objects(files, "Secret")
    assert files["10-config.yaml"] == render(tmp_path, *METRICS, out="whole")["10-config.yaml"]  # the run's own
    assert {o["kind"] for o in files["30-island-sa-east.yaml"]} == {"PersistentVolumeClaim", "Job"}
    job = one(files, "Job", "two-region-island-sa-east")
    spec = pod_spec(job)
    (container,) = spec["containers"]
    args = parse(container["args"])
    assert (args.command, args.name, args.config, container["image"]) == ("island", "sa-east", k8s.CONFIG_PATH, "diloco:cuda")  # fmt: skip
    assert args.coordinator == f"{host}:50051" and args.metrics_port is None  # an admitted island serves no metrics
    secret = "two-region-island-sa-east"
    assert args.secret == f"file:{k8s.TLS_DIR}/secret"
    for path, key in ((args.secret[5:], "secret"), (args.tls_ca, "ca.crt"), (args.tls_cert, "tls.crt"), (args.tls_key, "tls.key")):  # fmt: skip
        assert secret_key_at(spec, container, path) == (secret, key)
    assert all("value" in e for e in container["env"])  # nothing comes from another Secret
    # secrets.sh names the files of a real admission kit, and nothing of it is in the manifests
    own = tmp_path / "kit-sa-east"
    write_island_kit(own, "sa-east", kit)
    (own / "ca.crt").write_bytes((kit / "ca.crt").read_bytes())
    made = script_files(tmp_path / "k8s")
    assert list(made) == [secret] and set(made[secret]) == {"ca.crt", "tls.crt", "tls.key", "secret"}
    assert all((own / path).is_file() for path in made[secret].values()), made
    rendered = (tmp_path / "k8s" / "30-island-sa-east.yaml").read_text()
    assert (own / "sa-east.secret").read_text().strip() not in rendered and "PRIVATE KEY" not in rendered
    assert rendered.count("diloco admit") == 1  # the header says to admit it first
    for name, expected in (
        ("us-east", "island 'us-east' is configured (islands.names)"),
        ("diloco-operator", "'diloco-operator' is the name of operator certificates"),
        ("no spaces", "an island name is 1 to 64 characters"),
    ):
        fails(capsys, tmp_path, "--admit", name, expected=expected)
