"""What the cluster tests share: the cluster's secrets, the official client, metrics."""

from __future__ import annotations

from typing import Any

from tests.support.cluster import metric

TOKEN = "test-cluster-token"  # the cluster's secret: registry and every zmq socket
API_KEY = "test-client-key"  # what clients send; never the cluster token
SYSTEM = "You are a terse assistant for a lighthouse keeper. Answer in one short sentence. " * 6


def client(c: dict[str, Any]) -> Any:
    """The official openai client on the cluster's gateway."""
    import openai

    return openai.OpenAI(base_url=c["api"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def metric_or_0(http_url: str, name: str, **labels: str) -> float:
    """A metric's value, 0 while nothing was observed (a labelled series is exported from
    its first increment on)."""
    try:
        return metric(http_url, name, **labels)
    except KeyError:
        return 0.0
