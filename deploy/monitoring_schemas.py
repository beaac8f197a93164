"""JSON schemas for the Prometheus Operator objects the chart renders (monitoring.coreos.com/v1).

Hand-written, and a subset: ServiceMonitor, PodMonitor and PrometheusRule with the fields
the chart can emit, each with the name, type, enum and pattern of the Prometheus Operator's
CRD (the Go API types in pkg/apis/monitoring/v1; cross-read against the type declarations
of @kubernetes-models/prometheus-operator 6.0.0 on npm). Unknown fields are errors, as
with `kubectl apply --validate=strict`; a field the chart starts to emit must be added
here. No PyPI or npm package ships the CRDs' own openAPIV3Schema (see deploy/README.md).
"""

from __future__ import annotations

from typing import Any

# pkg/apis/monitoring/v1 Duration / NonEmptyDuration
DURATION_PATTERN = (
    "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
DURATION = {"type": "string", "pattern": DURATION_PATTERN}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
LABEL_NAME = {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}
DNS_NAME = {
    "type": "string",
    "maxLength": 253,
    "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}


def strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }
    if required:
        schema["required"] = list(required)
    return schema


METADATA = strict(
    {
        "name": DNS_NAME,
        "namespace": {"type": "string"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
    ("name",),
)
# RelabelConfig
RELABEL_CONFIG = strict(
    {
        "action": {
            "enum": [
                "replace",
                "Replace",
                "keep",
                "Keep",
                "drop",
                "Drop",
                "hashmod",
                "HashMod",
                "labelmap",
                "LabelMap",
                "labeldrop",
                "LabelDrop",
                "labelkeep",
                "LabelKeep",
                "lowercase",
                "Lowercase",
                "uppercase",
                "Uppercase",
                "keepequal",
                "KeepEqual",
                "dropequal",
                "DropEqual",
            ]
        },
        "modulus": {"type": "integer", "minimum": 0},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
        "separator": {"type": "string"},
        "sourceLabels": {"type": "array", "items": LABEL_NAME},
        "targetLabel": {"type": "string"},
    }
)
LABEL_SELECTOR = strict(
    {
        "matchLabels": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": {"type": "string"},
        },
        "matchExpressions": {
            "type": "array",
            "items": strict(
                {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                ("key", "operator"),
            ),
        },
    }
)
NAMESPACE_SELECTOR = strict(
    {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}
)
# Endpoint (ServiceMonitor) and PodMetricsEndpoint (PodMonitor): the fields both share
SCRAPE_ENDPOINT = {
    "port": {"type": "string"},
    "path": {"type": "string", "pattern": "^/"},
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
    "interval": DURATION,
    "scrapeTimeout": DURATION,
    "honorLabels": {"type": "boolean"},
    "honorTimestamps": {"type": "boolean"},
    "relabelings": {"type": "array", "items": RELABEL_CONFIG},
    "metricRelabelings": {"type": "array", "items": RELABEL_CONFIG},
}


def _object(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return strict(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


SERVICEMONITOR = _object(
    "ServiceMonitor",
    strict(
        {
            "selector": LABEL_SELECTOR,
            "namespaceSelector": NAMESPACE_SELECTOR,
            "jobLabel": {"type": "string"},
            "endpoints": {"type": "array", "minItems": 1, "items": strict(SCRAPE_ENDPOINT)},
        },
        ("selector", "endpoints"),
    ),
)

PODMONITOR = _object(
    "PodMonitor",
    strict(
        {
            "selector": LABEL_SELECTOR,
            "namespaceSelector": NAMESPACE_SELECTOR,
            "jobLabel": {"type": "string"},
            "podMetricsEndpoints": {
                "type": "array",
                "minItems": 1,
                "items": strict(SCRAPE_ENDPOINT),
            },
        },
        ("selector",),
    ),
)

# Rule: an alerting rule (alert) or a recording rule (record), never both
RULE = {
    **strict(
        {
            "alert": {"type": "string", "minLength": 1},
            "record": {"type": "string", "minLength": 1},
            "expr": {"type": ["string", "integer"], "minLength": 1},
            "for": DURATION,
            "keep_firing_for": {**DURATION, "minLength": 1},
            "labels": STRING_MAP,
            "annotations": STRING_MAP,
        },
        ("expr",),
    ),
    "oneOf": [
        {"required": ["alert"], "not": {"required": ["record"]}},
        {
            "required": ["record"],
            "not": {
                "anyOf": [
                    {"required": ["alert"]},
                    {"required": ["for"]},
                    {"required": ["annotations"]},
                ]
            },
        },
    ],
}
PROMETHEUSRULE = _object(
    "PrometheusRule",
    strict(
        {
            "groups": {
                "type": "array",
                "items": strict(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "interval": DURATION,
                        "labels": STRING_MAP,
                        "limit": {"type": "integer", "minimum": 0},
                        "rules": {"type": "array", "items": RULE},
                    },
                    ("name",),
                ),
            },
        }
    ),
)

SCHEMAS = {
    "ServiceMonitor": SERVICEMONITOR,
    "PodMonitor": PODMONITOR,
    "PrometheusRule": PROMETHEUSRULE,
}
