"""Structure of the CRD objects the chart renders (ServiceMonitor, PrometheusRule, ScaledObject)."""

from __future__ import annotations

from typing import Any

# --- CRD structure (kubernetes-validate ships no CRD schemas) -------------------------------
# The fields pdserve renders, typed as the prometheus-operator (monitoring.coreos.com/v1) and
# KEDA (keda.sh/v1alpha1) CRDs declare them; unknown fields are rejected, like --strict does.

_DURATION = {
    "type": "string",
    "pattern": (
        r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?"
        r"(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
    ),
}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _closed(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "additionalProperties": False,
        "required": required or [],
    }


def _crd(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _closed(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": {"type": "object"},
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


_RULE = {
    **_closed(
        {
            "alert": {"type": "string", "minLength": 1},
            "record": {"type": "string", "minLength": 1},
            "expr": {"type": ["string", "integer"], "minLength": 1},
            "for": _DURATION,
            "keep_firing_for": _DURATION,
            "labels": _STR_MAP,
            "annotations": _STR_MAP,
        },
        ["expr"],
    ),
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
}

CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _crd(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        _closed(
            {
                "selector": {
                    "type": "object"
                },  # a LabelSelector: checked against the core schema too
                "namespaceSelector": _closed(
                    {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    }
                ),
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _closed(
                        {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                        }
                    ),
                },
            },
            ["selector"],
        ),
    ),
    "PrometheusRule": _crd(
        "monitoring.coreos.com/v1",
        "PrometheusRule",
        _closed(
            {
                "groups": {
                    "type": "array",
                    "items": _closed(
                        {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _DURATION,
                            "rules": {"type": "array", "items": _RULE},
                        },
                        ["name"],
                    ),
                }
            }
        ),
    ),
    "ScaledObject": _crd(
        "keda.sh/v1alpha1",
        "ScaledObject",
        _closed(
            {
                "scaleTargetRef": _closed(
                    {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1},
                        "envSourceContainerName": {"type": "string"},
                    },
                    ["name"],
                ),
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "advanced": _closed(
                    {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": _closed(
                            {"name": {"type": "string"}, "behavior": {"type": "object"}}
                        ),
                    }
                ),
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": _closed(
                        {
                            "type": {"type": "string", "minLength": 1},
                            "name": {"type": "string"},
                            "metadata": _STR_MAP,
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "authenticationRef": _closed(
                                {"name": {"type": "string"}, "kind": {"type": "string"}}, ["name"]
                            ),
                            "useCachedMetrics": {"type": "boolean"},
                        },
                        ["type", "metadata"],
                    ),
                },
            },
            ["scaleTargetRef", "triggers"],
        ),
    ),
}


def core_stand_ins(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Core objects carrying a CRD's metadata, label selector and HPA behavior, so
    kubernetes-validate checks those parts against the real Kubernetes schemas."""
    meta = doc["metadata"]
    out = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}]
    spec = doc["spec"]
    if "selector" in spec:
        out.append(
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": meta,
                "spec": {"maxUnavailable": 1, "selector": spec["selector"]},
            }
        )
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior is not None:
        out.append(
            {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": meta,
                "spec": {
                    "scaleTargetRef": spec["scaleTargetRef"],
                    "minReplicas": 1,
                    "maxReplicas": spec.get("maxReplicaCount", 1),
                    "behavior": behavior,
                },
            }
        )
    return out
