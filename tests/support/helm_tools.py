"""Offline checks of the Helm chart: render, read its manifests, parse its args, check its PromQL.

Rendering and linting use helm-python-sdk (Helm 4's Go SDK through ctypes; no helm binary,
no cluster).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "pdserve"
FILES_DIR = CHART_DIR / "files"
RELEASE = "demo"
NAMESPACE = "llm"
KUBE_VERSIONS = ("1.29.0", "1.33.0")
ROLES = ("bootstrap", "prefill", "decode")
NODE_ROLES = ("prefill", "decode")
# Kinds whose schemas are CRDs (prometheus-operator, KEDA): kubernetes-validate has none.
CRD_KINDS = ("ServiceMonitor", "PrometheusRule", "ScaledObject")


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _both_nodes(block: dict[str, Any]) -> dict[str, Any]:
    return {role: copy.deepcopy(block) for role in NODE_ROLES}


_GPU = _deep_merge(
    _both_nodes({"gpu": {"enabled": True, "count": 1}, "rdma": {"enabled": True}}),
    {"image": {"tag": "0.1.0-cuda"}},
)
_MONITORING = {
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "dashboards": {"enabled": True},
    }
}
_KEDA = _both_nodes({"autoscaling": {"enabled": True, "keda": True}})

# Values per toggle the issue names, plus the model sources and a combination of them all.
TOGGLES: dict[str, dict[str, Any]] = {
    "default": {},
    "autoscaling": _both_nodes({"autoscaling": {"enabled": True}}),
    "autoscaling-running": _deep_merge(
        _both_nodes({"autoscaling": {"enabled": True}}),
        {"decode": {"autoscaling": {"metric": "runningRequests"}}},
    ),
    "keda": _KEDA,
    "keda-running": _deep_merge(_KEDA, {"decode": {"autoscaling": {"metric": "runningRequests"}}}),
    "monitoring": _MONITORING,
    "gpu": _GPU,
    "existing-secret": {
        "auth": {"existingSecret": "pdserve-token", "existingSecretKey": "cluster"}
    },
    "given-token": {"auth": {"token": "s3cret-token"}},
    "api-keys": {"apiKeys": {"existingSecret": "client-keys"}},
    "model-pvc": {"model": {"source": "pvc", "pvc": {"claimName": "models"}, "path": "llama-3-8b"}},
    "model-hostpath": {
        "model": {
            "source": "hostPath",
            "hostPath": {"path": "/mnt/models/smol.gguf", "type": "File"},
            "mountPath": "/models/smol.gguf",
        }
    },
    "restricted-api": {
        "networkPolicy": {
            "apiFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
            ],
            "metricsFrom": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                    }
                }
            ],
        },
        "bootstrap": {"leaseTimeoutSeconds": 15},
    },
    "extra-args": {
        "prefill": {"extraArgs": ["--schedule-policy", "lpm", "--max-total-tokens", "65536"]},
        "decode": {
            "extraArgs": ["--retraction-policy", "length", "--num-reserved-decode-tokens", "256"]
        },
        "bootstrap": {"extraArgs": ["--max-queued-requests", "512"]},
        "logLevel": "DEBUG",
    },
    "everything": _deep_merge(
        _deep_merge(_deep_merge(_GPU, _MONITORING), _KEDA),
        {
            "model": {"source": "pvc", "pvc": {"claimName": "models"}},
            "auth": {"existingSecret": "t"},
        },
    ),
}


# --- rendering ------------------------------------------------------------------------------


def render(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text, offline, as `helm template demo -n llm` would."""
    import helm_python as helm

    with helm.Chart.load(str(CHART_DIR)) as chart:
        chart.validate_schema(values or {})
        return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def manifests(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every non-empty Kubernetes object the chart renders (NOTES.txt left out)."""
    docs = []
    for path, text in sorted(render(values).items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


@cache
def _toggle_manifests_json(toggle: str) -> str:
    return json.dumps(manifests(TOGGLES[toggle]))


def toggle_manifests(toggle: str) -> list[dict[str, Any]]:
    """The manifests of one named toggle, rendered once per test session."""
    return json.loads(_toggle_manifests_json(toggle))


def lint(values: dict[str, Any] | None, kube_version: str) -> dict[str, Any]:
    import helm_python as helm

    return helm.lint(str(CHART_DIR), values or {}, strict=True, kube_version=f"v{kube_version}")


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def role_name(role: str) -> str:
    return f"{RELEASE}-pdserve-{role}"


def component(doc: dict[str, Any]) -> str:
    """The role an object belongs to, from its app.kubernetes.io/component label."""
    role: str = doc["metadata"]["labels"]["app.kubernetes.io/component"]
    return role


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


# --- pdserve's own argument parsers ---------------------------------------------------------

_ENTRY_MODULES = {
    "prefill": "prefill_node.__main__",
    "decode": "decode_node.__main__",
    "bootstrap": "bootstrap.__main__",
}


def role_parser(role: str) -> argparse.ArgumentParser:
    """The parser `pdserve <role>` runs: the role's own `__main__.build_parser()`."""
    parser: argparse.ArgumentParser = importlib.import_module(_ENTRY_MODULES[role]).build_parser()
    return parser


def role_config(role: str, ns: argparse.Namespace) -> object:
    """Build the role's frozen config from parsed flags: values are checked, not just the names."""
    from common import config

    if role == "prefill":
        return config.PrefillConfig.from_args(ns)
    if role == "decode":
        return config.DecodeConfig.from_args(ns)
    return config.BootstrapConfig.from_args(ns)


_ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand_env_refs(args: list[str], env: dict[str, dict[str, Any]]) -> list[str]:
    """Replace $(VAR) as the kubelet does; every VAR must be in the container's env."""
    stand_ins = {
        "POD_NAME": f"{RELEASE}-pdserve-x-7d9f8c6b5-abcde",
        "POD_IP": "10.1.2.3",
        "POD_NAMESPACE": NAMESPACE,
    }

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        assert name in env, f"$({name}) is used in args but not defined in the container's env"
        return stand_ins.get(name) or str(env[name].get("value", "x"))

    return [_ENV_REF.sub(value, a) for a in args]


# --- PromQL: promtool and metric names ------------------------------------------------------


def promtool() -> str | None:
    return shutil.which("promtool")


def promtool_check_file(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool() or "promtool", "check", "rules", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def promtool_check(exprs: dict[str, str], tmp_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run `promtool check rules` over the expressions as recording rules of one file."""
    rules = [
        {"record": f"pdserve_check:{re.sub(r'[^a-zA-Z0-9_]', '_', key)}", "expr": expr}
        for key, expr in exprs.items()
    ]
    path = tmp_dir / "exprs.rules.yaml"
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "exprs", "rules": rules}]}, sort_keys=False)
    )
    return promtool_check_file(path)


def pdserve_sample_names() -> set[str]:
    """Every series name pdserve can expose, from the shared prometheus-client registry.

    common/metrics.py defines the shared metrics; the gateway (bootstrap/gateway_metrics.py:
    registered nodes, nodes lost) and the decode node (decode_node/stats.py: output tokens)
    register a few more of their own on the same registry.
    """
    from common import metrics

    for module in ("bootstrap.gateway_metrics", "decode_node.stats"):
        importlib.import_module(module)
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in metrics.REGISTRY.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def metric_names(expr: str) -> set[str]:
    """Every metric name an expression selects, from promql-parser's syntax tree."""
    import promql_parser

    found: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                found.add(node.name)
            found.update(m.value for m in node.matchers.matchers if m.name == "__name__")

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def grafana_to_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced by values Prometheus accepts."""
    for var in ("$__rate_interval", "$__interval", "$__range"):
        expr = expr.replace(var, "5m")
    return re.sub(r"\$\{?[A-Za-z_]+\}?", ".*", expr)


def adapter_to_promql(query: str, series: str) -> str:
    """A Prometheus Adapter metricsQuery with its template fields filled in for one pod."""
    return (
        query.replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", 'namespace="llm",pod="demo-pdserve-prefill-0"')
        .replace("<<.GroupBy>>", "namespace,pod")
    )


def dashboard() -> dict[str, Any]:
    return json.loads((FILES_DIR / "grafana-dashboard.json").read_text())


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs(board: dict[str, Any]) -> dict[str, str]:
    """Panel title + refId -> the query, Grafana variables left in."""
    return {
        f"{p['title']}/{t['refId']}": t["expr"] for p in panels(board) for t in p.get("targets", [])
    }


def alert_rules() -> dict[str, Any]:
    return yaml.safe_load((FILES_DIR / "prometheus-rules.yaml").read_text())


def adapter_rules() -> dict[str, Any]:
    return yaml.safe_load((FILES_DIR / "prometheus-adapter-rules.yaml").read_text())
