"""How the rendered objects fit together: selectors, ports, network policy, probes, secret, PDBs."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from tests.support import helm_tools as ht

pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (test extra)")


def _pod_labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Deployment name -> the labels of its pods."""
    return {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in ht.of_kind(docs, "Deployment")
    }


@pytest.mark.parametrize("toggle", ht.TOGGLES)
def test_each_service_selects_its_roles_pods_and_no_other(toggle: str) -> None:
    docs = ht.toggle_manifests(toggle)
    pods = _pod_labels(docs)
    for service in ht.of_kind(docs, "Service"):
        role = ht.component(service)
        selected = [
            name for name, labels in pods.items() if ht.selects(service["spec"]["selector"], labels)
        ]
        assert selected == [ht.role_name(role)], service["metadata"]["name"]
        deployment = ht.named(docs, "Deployment", ht.role_name(role))
        named_ports = {p["name"] for c in ht.containers(deployment) for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named_ports, (service["metadata"]["name"], port)
    # bootstrap twice: the API Service and the headless registry one (every replica).
    assert sorted(ht.component(s) for s in ht.of_kind(docs, "Service")) == sorted(
        [*ht.ROLES, "bootstrap"]
    )


@pytest.mark.parametrize("toggle", ht.TOGGLES)
def test_each_selector_picks_exactly_its_own_deployment(toggle: str) -> None:
    docs = ht.toggle_manifests(toggle)
    pods = _pod_labels(docs)
    for deployment in ht.of_kind(docs, "Deployment"):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert [n for n, labels in pods.items() if ht.selects(selector, labels)] == [
            deployment["metadata"]["name"]
        ]
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for doc in ht.of_kind(docs, kind):
            selector = doc["spec"].get("selector") or doc["spec"]["podSelector"]
            matched = [
                n for n, labels in pods.items() if ht.selects(selector["matchLabels"], labels)
            ]
            assert matched == [doc["metadata"]["name"]], (kind, doc["metadata"]["name"])
    for monitor in ht.of_kind(docs, "ServiceMonitor"):
        services = ht.of_kind(docs, "Service")
        selected = [
            s
            for s in services
            if ht.selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        scraped = [s for s in selected if "http" in {p["name"] for p in s["spec"]["ports"]}]
        assert len(scraped) == len(ht.ROLES)  # every role's /metrics, once


def _ingress_rules(docs: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    return ht.named(docs, "NetworkPolicy", ht.role_name(role))["spec"]["ingress"]


def _covers(rule: dict[str, Any], port: int) -> bool:
    if "ports" not in rule:
        return True
    return any(p["port"] <= port <= p.get("endPort", p["port"]) for p in rule["ports"])


def _release_only(rule: dict[str, Any]) -> bool:
    release = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": ht.RELEASE}
    peers = rule.get("from") or []
    return bool(peers) and all(p == {"podSelector": {"matchLabels": release}} for p in peers)


@pytest.mark.parametrize("toggle", ["default", "restricted-api"])
def test_only_this_releases_pods_reach_the_internal_ports(toggle: str) -> None:
    docs = ht.toggle_manifests(toggle)
    values = ht.TOGGLES[toggle]
    internal: dict[str, list[int]] = {"bootstrap": [8998, 8999]}
    for role in ht.NODE_ROLES:
        container = ht.containers(ht.named(docs, "Deployment", ht.role_name(role)))[0]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        low, high = map(int, ht.env_of(container)["UCX_TCP_PORT_RANGE"]["value"].split("-"))
        internal[role] = [named["request"], named["control"], *range(low, high + 1)]
    for role, ports in internal.items():
        rules = _ingress_rules(docs, role)
        for port in ports:
            covering = [r for r in rules if _covers(r, port)]
            assert covering, f"{role} port {port} is blocked for everyone"
            assert all(_release_only(r) for r in covering), (
                f"{role} port {port} is open beyond the release"
            )
    # The API and the nodes' /health + /metrics stay reachable (from the configured peers).
    api_rule = next(
        r for r in _ingress_rules(docs, "bootstrap") if _covers(r, 8000) and not _release_only(r)
    )
    assert api_rule.get("from") == values.get("networkPolicy", {}).get("apiFrom")
    for role in ht.NODE_ROLES:
        http = 30000 if role == "prefill" else 30001
        assert any(_covers(r, http) and not _release_only(r) for r in _ingress_rules(docs, role))


def test_network_policies_can_be_turned_off() -> None:
    assert ht.of_kind(ht.manifests({"networkPolicy": {"enabled": False}}), "NetworkPolicy") == []


def test_node_pods_publish_their_ucx_port_range_and_set_it() -> None:
    docs = ht.manifests({"transfer": {"ucx": {"portRangeStart": 31000, "portRangeEnd": 31031}}})
    for role in ht.NODE_ROLES:
        container = ht.containers(ht.named(docs, "Deployment", ht.role_name(role)))[0]
        assert ht.env_of(container)["UCX_TCP_PORT_RANGE"]["value"] == "31000-31031"
        internal = next(r for r in _ingress_rules(docs, role) if _release_only(r))
        assert {"port": 31000, "endPort": 31031, "protocol": "TCP"} in internal["ports"]


def test_probes_ready_means_registered_and_able_to_serve() -> None:
    docs = ht.toggle_manifests("default")
    for role in ht.ROLES:
        [container] = ht.containers(ht.named(docs, "Deployment", ht.role_name(role)))
        # The gateway is ready once it can serve: a healthy prefill and decode node known.
        path = "/ready" if role == "bootstrap" else "/health"
        assert container["readinessProbe"]["httpGet"] == {"path": path, "port": "http"}
        assert "startupProbe" in container and "livenessProbe" in container
        # A node that loses its registration turns unready, but is not restarted for it.
        assert container["livenessProbe"]["httpGet"]["path"] != "/health" or role == "bootstrap"
    node = ht.containers(ht.named(docs, "Deployment", ht.role_name("prefill")))[0]
    startup = node["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 600  # model load time


def test_every_rollout_adds_before_it_removes_and_the_gateway_has_two_replicas() -> None:
    docs = ht.toggle_manifests("default")
    for role in (*ht.NODE_ROLES, "bootstrap"):
        strategy = ht.named(docs, "Deployment", ht.role_name(role))["spec"]["strategy"]
        assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert ht.named(docs, "Deployment", ht.role_name("bootstrap"))["spec"]["replicas"] == 2
    # Nodes find every replica by the headless registry Service, not-ready pods included.
    registry = ht.named(docs, "Service", ht.role_name("bootstrap") + "-registry")["spec"]
    assert registry["clusterIP"] == "None" and registry["publishNotReadyAddresses"] is True
    assert [p["port"] for p in registry["ports"]] == [8998]


def test_disruption_budgets_cover_every_role() -> None:
    docs = ht.toggle_manifests("default")
    budgets = {ht.component(p): p["spec"] for p in ht.of_kind(docs, "PodDisruptionBudget")}
    assert set(budgets) == {*ht.NODE_ROLES, "bootstrap"}
    assert all(b["maxUnavailable"] == 1 for b in budgets.values())


def test_the_cluster_token_secret_is_generated_given_or_external() -> None:
    [generated] = ht.of_kind(ht.toggle_manifests("default"), "Secret")
    token = base64.b64decode(generated["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    [given] = ht.of_kind(ht.toggle_manifests("given-token"), "Secret")
    assert base64.b64decode(given["data"]["token"]).decode() == "s3cret-token"
    assert ht.of_kind(ht.toggle_manifests("existing-secret"), "Secret") == []


def test_pods_run_unprivileged_without_an_api_token() -> None:
    for deployment in ht.of_kind(ht.toggle_manifests("default"), "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["serviceAccountName"] == "demo-pdserve"
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
