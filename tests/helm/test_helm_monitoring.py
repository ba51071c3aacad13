"""Dashboard, alert rules, adapter rules and KEDA queries: valid PromQL over pdserve's own metrics.

Every expression is checked by `promtool check rules` (skipped, with the reason, when
promtool is not installed: Debian's `prometheus` package has it) and by promql-parser,
whose syntax tree gives the metric names, each of which must be a series pdserve exposes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support import helm_tools as ht

pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (test extra)")
pytest.importorskip("promql_parser", reason="promql-parser is not installed (test extra)")

needs_promtool = pytest.mark.skipif(
    ht.promtool() is None,
    reason="promtool not found: install Debian's prometheus package (apt-get install prometheus)",
)


def _recorded() -> set[str]:
    return {r["record"] for g in ht.alert_rules()["groups"] for r in g["rules"] if "record" in r}


def _all_exprs() -> dict[str, str]:
    """Every PromQL expression the chart ships or renders, runnable as is."""
    exprs = {
        f"dashboard {k}": ht.grafana_to_promql(v)
        for k, v in ht.dashboard_exprs(ht.dashboard()).items()
    }
    for group in ht.alert_rules()["groups"]:
        for rule in group["rules"]:
            exprs[f"rule {rule.get('alert') or rule['record']}"] = rule["expr"]
    for rule in ht.adapter_rules()["rules"]:
        series = rule["seriesQuery"].split("{")[0]
        exprs[f"adapter series {rule['name']['as']}"] = rule["seriesQuery"]
        exprs[f"adapter {rule['name']['as']}"] = ht.adapter_to_promql(rule["metricsQuery"], series)
    for toggle in ("keda", "keda-running"):
        for obj in ht.of_kind(ht.toggle_manifests(toggle), "ScaledObject"):
            exprs[f"keda {toggle} {obj['metadata']['name']}"] = obj["spec"]["triggers"][0][
                "metadata"
            ]["query"]
    return exprs


@needs_promtool
def test_the_alert_rules_file_passes_promtool() -> None:
    done = ht.promtool_check_file(ht.FILES_DIR / "prometheus-rules.yaml")
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_every_expression_passes_promtool(tmp_path: Path) -> None:
    exprs = _all_exprs()
    done = ht.promtool_check(exprs, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout


def test_every_expression_names_only_pdserve_metrics() -> None:
    known = ht.pdserve_sample_names() | _recorded()
    unknown = {}
    for key, expr in _all_exprs().items():
        names = ht.metric_names(expr)
        assert names, f"{key} selects no metric"
        if names - known:
            unknown[key] = sorted(names - known)
    assert unknown == {}


def test_dashboard_covers_what_operators_look_at() -> None:
    board = ht.dashboard()
    exprs = "\n".join(ht.dashboard_exprs(board).values())
    for metric in (
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_inter_token_latency_seconds_bucket",
        "pdserve_e2e_request_latency_seconds_bucket",
        "pdserve_kv_transfer_seconds_bucket",
        "pdserve_calc_priority_seconds_bucket",
    ):
        for quantile in ("0.5", "0.99"):
            assert f"histogram_quantile({quantile}, sum by (le" in exprs and metric in exprs
    wanted = {
        "throughput": "pdserve_requests_total",
        "queues per role and queue": "sum by (role, queue) (pdserve_queue_requests",
        "KV pages used per node": "sum by (role, pod) (pdserve_kv_pages_used",
        "KV pages held per node": "sum by (role, pod) (pdserve_kv_pages_held",
        "prefix cache hits": "pdserve_prefix_cache_hit_tokens_total",
        "transfer GB/s": "(pdserve_kv_transfer_bytes_total",
        "transfer failures": "pdserve_kv_transfer_failures_total",
        "retractions": "pdserve_retractions_total",
        "replicas per role": "sum by (node_role) (pdserve_registered_nodes",
        "TTFT by stage": "sum by (stage) (rate(pdserve_request_stage_seconds_sum",
    }
    missing = [topic for topic, text in wanted.items() if text not in exprs]
    assert missing == []
    assert "/ 1e9" in exprs  # bytes/s shown as GB/s
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "namespace"}
    ids = [p["id"] for p in ht.panels(board)]
    assert len(ids) == len(set(ids))


def test_alerts_cover_the_failure_modes() -> None:
    alerts = {r["alert"]: r for g in ht.alert_rules()["groups"] for r in g["rules"] if "alert" in r}
    uses = {name: rule["expr"] for name, rule in alerts.items()}
    assert "pdserve_kv_transfer_failures_total" in uses["PdserveKVTransferFailures"]
    assert "pdserve_kv_pages_held" in uses["PdserveKVPagesHeldWhileIdle"]
    assert "deriv(pdserve_queue_requests" in uses["PdserveQueueGrowing"]
    assert "ttft_over_objective" in uses["PdserveTTFTBudgetBurnFast"]
    assert "ttft_over_objective" in uses["PdserveTTFTBudgetBurnSlow"]
    assert "pdserve_nodes_lost_total" in uses["PdserveNodeLeasesExpiring"]
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_rendered_monitoring_objects_carry_the_files_unchanged() -> None:
    docs = ht.toggle_manifests("monitoring")
    [rule] = ht.of_kind(docs, "PrometheusRule")
    assert rule["spec"] == ht.alert_rules()
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    [board] = ht.of_kind(docs, "ConfigMap")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert yaml.safe_load(board["data"]["pdserve.json"]) == ht.dashboard()
    [monitor] = ht.of_kind(docs, "ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [ht.NAMESPACE]}


def test_each_hpa_scales_on_a_metric_the_adapter_rules_serve() -> None:
    served = {r["name"]["as"]: r for r in ht.adapter_rules()["rules"]}
    expected = {
        ("autoscaling", "prefill"): ("pdserve_prefill_waiting_requests", "8"),
        ("autoscaling", "decode"): ("pdserve_decode_kv_usage_ratio", "0.75"),
        ("autoscaling-running", "decode"): ("pdserve_decode_running_requests", "64"),
    }
    for (toggle, role), (metric, target) in expected.items():
        docs = ht.toggle_manifests(toggle)
        hpa = ht.named(docs, "HorizontalPodAutoscaler", ht.role_name(role))
        [spec] = hpa["spec"]["metrics"]
        assert spec["pods"]["metric"]["name"] == metric and metric in served
        assert spec["pods"]["target"] == {"type": "AverageValue", "averageValue": target}
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": ht.role_name(role),
        }
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
        assert "replicas" not in ht.named(docs, "Deployment", ht.role_name(role))["spec"]
        [adapter] = ht.of_kind(docs, "ConfigMap")
        assert yaml.safe_load(adapter["data"]["config.yaml"]) == ht.adapter_rules()
    # The prefill signal is the waiting queue of prefill pods; decode's, running work or KV use.
    assert 'queue="waiting"' in served["pdserve_prefill_waiting_requests"]["metricsQuery"]
    assert 'queue="running"' in served["pdserve_decode_running_requests"]["metricsQuery"]
    assert "pdserve_kv_pages_total" in served["pdserve_decode_kv_usage_ratio"]["metricsQuery"]


def test_keda_scaled_objects_query_this_releases_pods_of_their_role() -> None:
    docs = ht.toggle_manifests("keda")
    assert ht.of_kind(docs, "HorizontalPodAutoscaler") == []
    for role in ht.NODE_ROLES:
        obj = ht.named(docs, "ScaledObject", ht.role_name(role))
        [trigger] = obj["spec"]["triggers"]
        query = trigger["metadata"]["query"]
        assert trigger["type"] == "prometheus"
        assert f'namespace="{ht.NAMESPACE}"' in query and f'role="{role}"' in query
        assert f'pod=~"{ht.role_name(role)}-[a-z0-9]+-[a-z0-9]+"' in query
        assert obj["spec"]["scaleTargetRef"]["name"] == ht.role_name(role)
        assert "replicas" not in ht.named(docs, "Deployment", ht.role_name(role))["spec"]
    prefill = ht.named(docs, "ScaledObject", ht.role_name("prefill"))["spec"]["triggers"][0]
    assert (
        prefill["metricType"] == "AverageValue"
        and 'queue="waiting"' in prefill["metadata"]["query"]
    )
    decode = ht.named(docs, "ScaledObject", ht.role_name("decode"))["spec"]["triggers"][0]
    assert decode["metricType"] == "Value" and decode["metadata"]["threshold"] == "0.75"
