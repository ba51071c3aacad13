"""The chart renders offline for every toggle, lints clean in strict mode, every manifest is valid.

Core kinds are checked by kubernetes-validate --strict for Kubernetes 1.29 and 1.33. The CRD
kinds (ServiceMonitor, PrometheusRule, ScaledObject) have no schema there: their structure is
checked against helm_crds.CRD_SCHEMAS, and their metadata, label selector and HPA behavior
against the core schemas through stand-in objects.
"""

from __future__ import annotations

import pytest

from tests.support import helm_crds
from tests.support import helm_tools as ht

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (test extra)")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
jsonschema = pytest.importorskip("jsonschema")


@pytest.mark.parametrize("toggle", ht.TOGGLES)
@pytest.mark.parametrize("kube_version", ht.KUBE_VERSIONS)
def test_strict_lint_is_clean(toggle: str, kube_version: str) -> None:
    report = ht.lint(ht.TOGGLES[toggle], kube_version)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("toggle", ht.TOGGLES)
@pytest.mark.parametrize("kube_version", ht.KUBE_VERSIONS)
def test_every_core_manifest_is_valid(toggle: str, kube_version: str) -> None:
    docs = ht.toggle_manifests(toggle)
    core = [d for d in docs if d["kind"] not in ht.CRD_KINDS]
    assert core, "nothing rendered"
    for doc in core:
        try:
            kv.validate(doc, kube_version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(
                f"{doc['kind']} {doc['metadata']['name']} at {list(exc.path)}: {exc.message}"
            )


@pytest.mark.parametrize("toggle", ht.TOGGLES)
def test_every_crd_manifest_has_the_crd_structure(toggle: str) -> None:
    for doc in (d for d in ht.toggle_manifests(toggle) if d["kind"] in ht.CRD_KINDS):
        jsonschema.validate(doc, helm_crds.CRD_SCHEMAS[doc["kind"]])
        for stand_in in helm_crds.core_stand_ins(doc):
            for kube_version in ht.KUBE_VERSIONS:
                kv.validate(stand_in, kube_version, strict=True)


def test_default_install_renders_the_expected_objects() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in ht.toggle_manifests("default"))
    expected = sorted(
        [("ServiceAccount", "demo-pdserve"), ("Secret", "demo-pdserve-auth")]
        + [("Deployment", ht.role_name(r)) for r in ht.ROLES]
        + [("Service", ht.role_name(r)) for r in ht.ROLES]
        + [("Service", ht.role_name("bootstrap") + "-registry")]
        + [("NetworkPolicy", ht.role_name(r)) for r in ht.ROLES]
        + [("PodDisruptionBudget", ht.role_name(r)) for r in ht.ROLES]
    )
    assert kinds == expected


@pytest.mark.parametrize(
    ("toggle", "kinds"),
    [
        ("autoscaling", {"HorizontalPodAutoscaler": 2, "ConfigMap": 1}),
        ("keda", {"ScaledObject": 2}),
        ("monitoring", {"ServiceMonitor": 1, "PrometheusRule": 1, "ConfigMap": 1}),
    ],
)
def test_toggles_add_their_objects(toggle: str, kinds: dict[str, int]) -> None:
    docs = ht.toggle_manifests(toggle)
    optional = (
        "HorizontalPodAutoscaler",
        "ScaledObject",
        "ServiceMonitor",
        "PrometheusRule",
        "ConfigMap",
    )
    counts = {k: len(ht.of_kind(docs, k)) for k in optional}
    assert counts == {k: kinds.get(k, 0) for k in optional}


def test_every_object_lives_in_the_release_namespace_with_release_labels() -> None:
    for doc in ht.toggle_manifests("everything"):
        meta = doc["metadata"]
        assert meta["namespace"] == ht.NAMESPACE, meta["name"]
        assert meta["labels"]["app.kubernetes.io/instance"] == ht.RELEASE
        assert meta["labels"]["app.kubernetes.io/name"] == "pdserve"


@pytest.mark.parametrize(
    "bad",
    [
        {"prefill": {"autoscaling": {"enabled": "yes"}}},
        {"decode": {"autoscaling": {"metric": "gpuUtilization"}}},
        {"prefill": {"autoscalling": {}}},
        {"bootstrap": {"replicas": -1}},
        {"model": {"source": "huggingface"}},
        {"transfer": {"ucx": {"portRangeStart": 70000}}},
        {"decode": {"autoscaling": {"kvUsageTarget": 1.5}}},
    ],
)
def test_schema_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(helm.HelmError):
        ht.render(bad)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": {"source": "pvc"}}, "model.pvc.claimName is required"),
        ({"model": {"source": "hostPath"}}, "model.hostPath.path is required"),
    ],
)
def test_a_mounted_model_needs_its_volume(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        ht.render(values)
