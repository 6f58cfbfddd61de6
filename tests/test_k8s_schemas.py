"""`diloco deploy k8s` against Kubernetes' own API schemas: every document rendered from every config in configs/
(one process per island, and two), plus the option variants that add kinds or fields, validated against the
OpenAPI schemas of every Kubernetes minor version still in support, in strict mode (an unknown field is an error,
as `kubectl apply` reports it).

The schemas are the ones the kubernetes-validate wheel bundles (read from the installed package: no network). A
custom resource has no built-in schema: the PathwaysJob's pod template is checked as the core/v1 PodTemplate its
controller makes pods of; its own fields are test_deploy_k8s.py's test_pathways_island's to check.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from diloco.cli import build_parser
from diloco.config import load_config
from diloco.deploy import k8s
from tests.conftest import REPO

Obj = dict[str, Any]

OLDEST_SUPPORTED = 31
"""The oldest Kubernetes 1.x still in support (managed clouds' extended support runs from 1.31 as of December
2026); the newest checked is the newest whose schemas kubernetes-validate ships."""
NEWEST_SHIPPED = int(kubernetes_validate.latest_version().split(".")[1])
VERSIONS = [f"1.{minor}" for minor in range(OLDEST_SUPPORTED, NEWEST_SHIPPED + 1)]

CONFIGS = sorted((REPO / "configs").glob("*.toml"))  # run configs; configs/links/ holds link profiles
MULTI_PROCESS = ["islands.processes=2", "network.metrics_port=9100"]  # adds headless Services, NetworkPolicies
TWO_REGION = REPO / "configs" / "two-region.toml"
VARIANTS: list[tuple[Path, list[str], list[str]]] = [
    (
        TWO_REGION,
        ["islands.devices=4", "islands.processes=2"],
        [
            "--accelerator",
            "tpu",
            "--tpu-type",
            "tpu-v5-lite-podslice",
            "--tpu-topology",
            "2x4",
            "--namespace",
            "prod",
            "--service-type",
            "LoadBalancer",
            "--storage-class",
            "fast",
        ],
    ),
    (
        TWO_REGION,
        ["islands.devices=4"],
        [
            "--accelerator",
            "us-east=nvidia-gpu",
            "--accelerator",
            "eu-west=pathways",
            "--pathways-machine-type",
            "ct5lp-hightpu-4t",
            "--tpu-topology",
            "2x2",
            "--pathways-dir",
            "gs://bucket/tmp",
        ],
    ),
]
"""(config, overrides, options) beyond the plain renders: a namespace, a LoadBalancer, TPU and GPU requests, node
selectors, a storage class, and a PathwaysJob."""
CUSTOM_RESOURCES = {("pathways-job.pathways.domain/v1", "PathwaysJob")}
RENDERED_KINDS = {
    "Namespace",
    "ConfigMap",
    "PersistentVolumeClaim",
    "Service",
    "Deployment",
    "Job",
    "NetworkPolicy",
    "PathwaysJob",
}


def with_secrets(config: Path) -> list[str]:
    """An override giving each island a secret reference where the config has none (deploy k8s needs them)."""
    cfg = load_config(config, [])
    if cfg.network.secrets:
        return []
    return ["network.secrets=" + json.dumps([f"file:kit/secrets/{island}" for island in cfg.islands.island_names])]


def rendered(config: Path, overrides: list[str], argv: list[str]) -> Iterator[tuple[str, Obj]]:
    """(where, document) of `diloco deploy k8s CONFIG ARGV OVERRIDES`, rendered in this process and read back from
    the YAML its files hold."""
    cfg = load_config(config, overrides)
    options = k8s.options_from(build_parser().parse_args(["deploy", "k8s", str(config), "--out", "-", *argv]), cfg)
    given = " ".join([config.name, *argv, *(o for o in overrides if not o.startswith("network.secrets="))])
    for name, objects in k8s.render(cfg, options).items():
        for doc in yaml.safe_load_all(k8s.to_yaml(objects)):
            yield f"{given}: {name} {doc['kind']}/{doc['metadata']['name']}", doc


def as_built_in(doc: Obj) -> Obj:
    """`doc`, or for a custom resource the pod template it holds as a core/v1 PodTemplate."""
    if (doc["apiVersion"], doc["kind"]) not in CUSTOM_RESOURCES:
        return doc
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": doc["metadata"],
        "template": doc["spec"]["controller"]["template"],
    }


@pytest.fixture(scope="module")
def documents() -> list[tuple[str, Obj]]:
    docs: list[tuple[str, Obj]] = []
    for config in CONFIGS:
        secrets = with_secrets(config)
        for extra in ([], MULTI_PROCESS):
            docs += rendered(config, [*secrets, *extra], [])
    for config, overrides, argv in VARIANTS:
        docs += rendered(config, overrides, argv)
    return docs


@pytest.fixture(scope="module")
def cached_schemas() -> Iterator[None]:
    """kubernetes_validate.validate reads and parses a version's shared definitions file on every call; reading
    each file once keeps the checks of every document against every version quick."""
    with pytest.MonkeyPatch.context() as patch:
        read = functools.lru_cache(maxsize=None)(kubernetes_validate.utils.schema_contents)
        patch.setattr(kubernetes_validate.utils, "schema_contents", read)
        yield


@pytest.mark.slow
def test_the_variants_render_every_kind(documents: list[tuple[str, Obj]]) -> None:
    """Every kind deploy k8s makes is among the documents checked: a kind no variant renders goes unchecked."""
    assert {doc["kind"] for _, doc in documents} == RENDERED_KINDS


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.slow
def test_manifests_match_the_api_schemas(documents: list[tuple[str, Obj]], cached_schemas: None, version: str) -> None:
    errors = []
    for where, doc in documents:
        try:
            checked = kubernetes_validate.validate(as_built_in(doc), version, strict=True)
            assert checked == version, f"kubernetes-validate checked {where} against {checked}, not {version}"
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{where}: {'.'.join(map(str, e.path)) or '(document)'}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{where}: {e.message}")
    assert not errors, f"{len(errors)} documents fail Kubernetes {version}'s schemas:\n" + "\n".join(errors)
