"""Offline checks of deploy/ (run by deploy/validate.sh inside its pinned venv).

1. The chart's values.schema.json is a valid draft-07 schema and the shipped values files
   pass it; helm lint --strict of the chart for each values case below.
2. Render each case (Helm v4's Go SDK through helm-python-sdk: the engine of `helm
   template`), write the manifests to .cache/deploy-rendered/<case>/, and validate every
   document against the Kubernetes JSON schemas bundled in kubernetes-validate (strict:
   unknown fields are errors), for the oldest and newest Kubernetes the chart targets.
   ServiceMonitor, PodMonitor and PrometheusRule (CRDs, not in those schemas) are checked
   against the hand-written subset schemas in monitoring_schemas.py.
3. Deployment invariants the schemas cannot see (grace period > shutdown timeout, GPU
   requests == limits, /dev/shm in memory, /health probes, ports and selectors wired, the
   volume larger than the budget, scrape timeout <= interval, the dashboard ConfigMap
   carrying the dashboard file byte for byte).
4. Alert rules: every expression parsed as PromQL (promql-parser), only metrics the plugin
   and vLLM export, every alert with severity, summary, description and runbook, and the
   $labels its text uses kept by its expression's aggregation.
5. Values the chart must refuse (by its schema or its template guards), in both render and
   lint, and broken manifests the validator must reject.
6. The Grafana dashboard: JSON, a top-level panels list, the template variables, every
   query parsed as PromQL with only known metrics and only $__rate_interval windows, the
   TTFT panel beside the hit-rate panel.
7. deploy/production-stack-values.yaml: the vllm-stack values layout, the `vllm serve`
   command it gives (VLLM_PLUGINS, --kv-transfer-config through the plugin's own config
   loader, --shutdown-timeout, prefix caching), the cache PVC it mounts; and the README's
   excerpt of it.
Exit status 1 on any failure; nothing here touches the network.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import promql_parser
import yaml
from monitoring_schemas import DURATION_PATTERN
from monitoring_schemas import SCHEMAS as MONITORING_SCHEMAS

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy/helm/vllm-kvdisk"
DASHBOARD = CHART / "dashboards/kvdisk-dashboard.json"
PSTACK_VALUES = ROOT / "deploy/production-stack-values.yaml"
PSTACK_PVC = ROOT / "deploy/production-stack-kvdisk-pvc.yaml"
README = ROOT / "deploy/README.md"
OUT = ROOT / ".cache/deploy-rendered"
KUBE_VERSIONS = ("1.29.0", "1.37.0")  # Chart.yaml kubeVersion >=1.29; newest bundled schemas
RELEASE, NAMESPACE = "kv", "inference"

# name -> (values files, --set style overrides, access mode the PVC must have or None)
CASES: dict[str, tuple[list[str], dict[str, Any], str | None]] = {
    "default": ([], {}, "ReadWriteOnce"),
    "rwx": (["values-rwx.yaml"], {}, "ReadWriteMany"),
    # every optional branch on: ServiceMonitor in another namespace with relabelings, the
    # alerts with extra labels, the dashboard ConfigMap in a folder, trace, existing claims...
    "all-options": (
        ["values-rwx.yaml"],
        {
            "serviceMonitor": {
                "enabled": True,
                "namespace": "monitoring",
                "honorLabels": True,
                "additionalLabels": {"release": "kube-prometheus-stack"},
                "labels": {"team": "inference"},  # the deprecated spelling still works
                "interval": "30s",
                "scrapeTimeout": "25s",
                "relabelings": [
                    {
                        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
                        "targetLabel": "node",
                        "action": "replace",
                    }
                ],
                "metricRelabelings": [
                    {"sourceLabels": ["__name__"], "regex": "vllm:.*", "action": "keep"}
                ],
            },
            "prometheusRule": {
                "enabled": True,
                "namespace": "monitoring",
                "additionalLabels": {"release": "kube-prometheus-stack"},
                "labels": {"team": "inference", "severity": "ignored"},
                "annotations": {
                    "dashboard": "https://grafana.example.com/d/vllm-kvdisk",
                    "summary": "ignored: the chart's own",
                },
                "runbookUrl": "https://runbooks.example.com/vllm-kvdisk",
            },
            "grafana": {
                "dashboards": {
                    "enabled": True,
                    "namespace": "monitoring",
                    "folder": "LLM",
                    "annotations": {"example.com/owner": "inference"},
                }
            },
            "kvdisk": {"trace": {"enabled": True}, "extraArgs": ["--kv-cache-min-tokens", 1024]},
            "persistence": {"existingClaim": "shared-kvdisk"},
            "modelCache": {"existingClaim": "model-weights"},
            "model": {"servedModelName": "qwen-7b"},
            "gpu": {"count": 2},
            "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
            "imagePullSecrets": [{"name": "regcred"}],
            "podAnnotations": {"example.com/team": "inference"},
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        },
        None,
    ),
    # the PodMonitor alternative, alerts grouped and selected differently, some alerts off,
    # a sidecar watching another label
    "podmonitor": (
        [],
        {
            "podMonitor": {
                "enabled": True,
                "additionalLabels": {"release": "prom"},
                "relabelings": [{"targetLabel": "cluster", "replacement": "gpu-1"}],
            },
            "prometheusRule": {
                "enabled": True,
                "groupBy": ["cluster", "namespace", "model_name"],
                "selector": 'job="inference/kv-vllm-kvdisk"',
                "alerts": {
                    "quarantinedFiles": {"enabled": False},
                    "hitRateCollapsed": {"ratio": 0.3, "for": "1h"},
                },
            },
            "grafana": {
                "dashboards": {
                    "enabled": True,
                    "label": "example.com/dashboard",
                    "labelValue": "kvdisk",
                }
            },
        },
        "ReadWriteOnce",
    ),
}
# values the chart must refuse, by its values.schema.json or its template guards
BAD_VALUES = {
    "grace period not above shutdown timeout": {"terminationGracePeriodSeconds": 30},
    "zero disk budget": {"kvdisk": {"spaceMb": 0}},
    "negative disk budget": {"kvdisk": {"spaceMb": -200000}},
    "unknown top-level key (replicas for replicaCount)": {"replicas": 3},
    "misspelt nested key (kvdisk.spaceMB)": {"kvdisk": {"spaceMB": 1000}},
    "wrong type (replicaCount as a string)": {"replicaCount": "3"},
    "budget as a quantity string": {"kvdisk": {"spaceMb": "200Gi"}},
    "relative cache directory": {"kvdisk": {"dir": "kvdisk"}},
    "unknown access mode": {"persistence": {"accessModes": ["ReadWriteAll"]}},
    "scrape interval not a duration": {
        "serviceMonitor": {"enabled": True, "interval": "15 seconds"}
    },
    "relabeling with an unknown action": {
        "serviceMonitor": {
            "enabled": True,
            "relabelings": [{"sourceLabels": ["__name__"], "action": "rename"}],
        }
    },
    "ServiceMonitor and PodMonitor both": {
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True},
    },
    "alert ratio above 1": {"prometheusRule": {"alerts": {"hitRateCollapsed": {"ratio": 1.5}}}},
    "alert window not a duration": {"prometheusRule": {"alerts": {"saveFailures": {"window": 15}}}},
    "empty sidecar label": {"grafana": {"dashboards": {"enabled": True, "label": ""}}},
}

DURATION_RE = re.compile(r"(\d+)(ms|y|w|d|h|m|s)")
DURATION_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def seconds(duration: str) -> float:
    if not re.fullmatch(DURATION_PATTERN, duration):
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(int(n) * DURATION_S[u] for n, u in DURATION_RE.findall(duration))


def mebibytes(quantity: str) -> float:
    units = {
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "Pi": 2**50,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "P": 1e15,
        "": 1,
    }
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity)).groups()
    return float(number) * units[unit] / 2**20


def exported_metrics() -> set[str]:
    """The plugin's metric names (``METRICS`` in vllm_kvdisk/ops/metricdefs.py, a literal read
    without importing the package) and the vLLM metrics the dashboard and alerts may use."""
    tree = ast.parse((ROOT / "vllm_kvdisk/ops/metricdefs.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "METRICS" for t in node.targets
        ):
            metrics = ast.literal_eval(node.value)
            break
    else:
        raise RuntimeError("vllm_kvdisk/ops/metricdefs.py has no METRICS")
    # Prometheus adds _total to counters (metricdefs.exported_name).
    names = {
        f"vllm:kvdisk_{name}" + ("_total" if kind == "counter" else "")
        for name, kind, *_ in metrics
    }
    return names | {"vllm:prompt_tokens_cached_by_source_total", "vllm:time_to_first_token_seconds"}


EXPORTED = exported_metrics()
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|count|sum)$")

failures: list[str] = []
quiet_failures = False  # the self-test's expected failures are counted, not printed


def fail(where: str, message: str) -> None:
    failures.append(f"{where}: {message}")
    if not quiet_failures:
        print(f"FAIL {where}: {message}")


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


def case_values(files: list[str], overrides: dict[str, Any]) -> dict[str, Any]:
    """What `-f FILE... --set ...` passes to helm (the chart's defaults are coalesced by helm)."""
    values: dict[str, Any] = {}
    for name in files:
        values = merge(values, yaml.safe_load((CHART / name).read_text()) or {})
    return merge(values, overrides)


def render(values: dict[str, Any]) -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def documents(manifests: dict[str, str]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, text in sorted(manifests.items()):
        if not path.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for doc in yaml.safe_load_all(text):
            if doc is not None:
                yield path, doc


def validate_doc(doc: dict[str, Any]) -> list[str]:
    """Schema errors of one manifest (empty when valid)."""
    errors = []
    if doc.get("apiVersion", "").startswith("monitoring.coreos.com/"):
        schema = MONITORING_SCHEMAS.get(doc.get("kind"))
        if schema is None:
            return [f"no schema for {doc.get('apiVersion')} {doc.get('kind')}"]
        for err in jsonschema.Draft202012Validator(schema).iter_errors(doc):
            errors.append(
                f"{doc['kind']} schema (monitoring_schemas.py): {err.message} at "
                f"/{'/'.join(map(str, err.absolute_path))}"
            )
        return errors
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            errors.append(
                f"k8s {version} schema: {err.message} at /{'/'.join(map(str, err.absolute_path))}"
            )
        except kubernetes_validate.SchemaNotFoundError as err:
            errors.append(f"no k8s {version} schema: {err.message}")
    return errors


# -- PromQL -------------------------------------------------------------------------------


def walk(node: Any) -> Iterator[Any]:
    yield node
    for attr in ("lhs", "rhs", "expr", "param", "vector_selector"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, (str, int, float)):
            yield from walk(child)
    for child in getattr(node, "args", None) or ():
        yield from walk(child)


def promql_facts(expr: str) -> dict[str, Any]:
    """Parse (ValueError on a syntax error) and collect metric names, range windows (with
    the function applied to them) and the labels that aggregations and matching keep."""
    tree = promql_parser.parse(expr)
    facts: dict[str, Any] = {"metrics": set(), "ranges": [], "by": set()}
    for node in walk(tree):
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            facts["metrics"].add(node.name)
        if isinstance(node, promql_parser.Call):
            for arg in node.args:
                if isinstance(arg, promql_parser.MatrixSelector):
                    facts["ranges"].append((node.func.name, arg.range.total_seconds()))
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            facts["by"] |= set(node.modifier.labels)
    return facts


def unknown_metrics(names: set[str]) -> set[str]:
    return {n for n in names if n not in EXPORTED and HISTOGRAM_SUFFIX.sub("", n) not in EXPORTED}


# -- the chart ------------------------------------------------------------------------------


def check_values_schema() -> None:
    where = "values.schema.json"
    try:
        schema = json.loads((CHART / "values.schema.json").read_text())
        jsonschema.Draft7Validator.check_schema(schema)
    except (OSError, ValueError, jsonschema.SchemaError) as err:
        fail(where, f"not a valid draft-07 schema: {err}")
        return
    validator = jsonschema.Draft7Validator(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    merged = [
        (f"{c} (merged)", merge(defaults, case_values(f, o))) for c, (f, o, _) in CASES.items()
    ]
    for name, values in [("values.yaml", defaults)] + merged:
        for err in validator.iter_errors(values):
            fail(where, f"{name}: {err.message} at /{'/'.join(map(str, err.absolute_path))}")
    print(f"ok   values.schema.json: draft-07, values.yaml and {len(CASES)} cases pass it")


def check_invariants(
    case: str, docs: list[dict[str, Any]], access_mode: str | None, values: dict[str, Any]
) -> None:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    (dep,), (svc,) = by_kind["Deployment"], by_kind["Service"]
    pod = dep["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    args = ctr["args"]
    where = f"{case}/Deployment"

    def arg(flag: str) -> str | None:
        return args[args.index(flag) + 1] if flag in args else None

    shutdown = arg("--shutdown-timeout")
    grace = pod.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
    if shutdown is None or int(grace) <= int(shutdown):
        fail(
            where,
            f"terminationGracePeriodSeconds {grace} must exceed --shutdown-timeout {shutdown}",
        )
    for flag in ("--kv-disk-dir", "--kv-disk-space-mb"):
        if arg(flag) is None:
            fail(where, f"{flag} missing from args")
    mounts = {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    cache_claim = volumes["kvdisk"].get("persistentVolumeClaim", {}).get("claimName")
    if arg("--kv-disk-dir") != mounts.get("kvdisk") or not cache_claim:
        fail(where, "--kv-disk-dir is not the mount point of the cache PVC")
    shm = volumes.get("dshm", {}).get("emptyDir", {})
    if mounts.get("dshm") != "/dev/shm" or shm.get("medium") != "Memory":
        fail(where, "/dev/shm is not an in-memory emptyDir")
    res = ctr["resources"]
    gpus = [k for k in res["limits"] if k.endswith("/gpu")]
    if not gpus or any(res["requests"].get(k) != res["limits"][k] for k in gpus):
        fail(where, f"GPU requests must equal limits: {res}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = ctr.get(probe, {}).get("httpGet", {})
        if get.get("path") != "/health" or get.get("port") != "http":
            fail(where, f"{probe} must GET /health on port http")
    sel = dep["spec"]["selector"]["matchLabels"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    if any(pod_labels.get(k) != v for k, v in sel.items()):
        fail(where, "selector does not match the pod labels")
    if svc["spec"]["selector"] != sel:
        fail(f"{case}/Service", "selector differs from the Deployment's")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    if ports.get("http", {}).get("port") != 8000:
        fail(f"{case}/Service", "needs port 8000 named http")
    container_ports = {p["name"] for p in ctr["ports"]}
    monitors = by_kind.get("ServiceMonitor", []) + by_kind.get("PodMonitor", [])
    if len(monitors) > 1:
        fail(case, "more than one ServiceMonitor/PodMonitor: every series would be scraped twice")
    for mon in monitors:
        kind, spec = mon["kind"], mon["spec"]
        targets = svc["metadata"]["labels"] if kind == "ServiceMonitor" else pod_labels
        if spec["selector"]["matchLabels"].items() - targets.items():
            what = "Service" if kind == "ServiceMonitor" else "pods"
            fail(f"{case}/{kind}", f"selector does not select the {what}")
        if mon["metadata"]["namespace"] != NAMESPACE and spec.get("namespaceSelector", {}).get(
            "matchNames"
        ) != [NAMESPACE]:
            fail(
                f"{case}/{kind}",
                "lives in another namespace without a namespaceSelector for the release namespace",
            )
        names = ports if kind == "ServiceMonitor" else container_ports
        for ep in spec.get("endpoints", []) + spec.get("podMetricsEndpoints", []):
            if ep["port"] not in names or ep.get("path") != "/metrics":
                fail(f"{case}/{kind}", f"endpoint {ep} is not /metrics on a named port")
            if seconds(ep["scrapeTimeout"]) > seconds(ep["interval"]):
                fail(
                    f"{case}/{kind}",
                    f"scrapeTimeout {ep['scrapeTimeout']} exceeds interval "
                    f"{ep['interval']} (Prometheus rejects that)",
                )
    claims = by_kind.get("PersistentVolumeClaim", [])
    if access_mode is not None:
        if len(claims) != 1 or claims[0]["spec"]["accessModes"] != [access_mode]:
            fail(f"{case}/PersistentVolumeClaim", f"expected one claim with {access_mode}")
        elif claims[0]["metadata"]["name"] != cache_claim:
            fail(f"{case}/PersistentVolumeClaim", "the Deployment mounts another claim")
    for claim in claims:
        need = int(arg("--kv-disk-space-mb")) + int(arg("--kv-disk-min-free-mb"))
        size = mebibytes(claim["spec"]["resources"]["requests"]["storage"])
        if size < need:
            fail(
                f"{case}/PersistentVolumeClaim",
                f"{size:.0f} MiB is less than the budget plus "
                f"the free-space watermark ({need} MiB)",
            )
    for cm in by_kind.get("ConfigMap", []):
        check_dashboard_configmap(case, cm, values)
    for rule in by_kind.get("PrometheusRule", []):
        intervals = [
            seconds(ep["interval"])
            for m in monitors
            for ep in m["spec"].get("endpoints", []) + m["spec"].get("podMetricsEndpoints", [])
        ]
        check_rules(case, rule, max(intervals, default=60))


def check_dashboard_configmap(case: str, cm: dict[str, Any], values: dict[str, Any]) -> None:
    where = f"{case}/ConfigMap/{cm['metadata']['name']}"
    conf = merge(
        yaml.safe_load((CHART / "values.yaml").read_text())["grafana"]["dashboards"],
        values.get("grafana", {}).get("dashboards", {}),
    )
    if cm["metadata"]["labels"].get(conf["label"]) != str(conf["labelValue"]):
        fail(where, f"lacks the sidecar label {conf['label']}={conf['labelValue']}")
    if (
        conf.get("folder")
        and cm["metadata"].get("annotations", {}).get(conf["folderAnnotation"]) != conf["folder"]
    ):
        fail(where, f"lacks the folder annotation {conf['folderAnnotation']}")
    data = cm.get("data", {})
    if list(data) != ["kvdisk-dashboard.json"] or data[
        "kvdisk-dashboard.json"
    ] != DASHBOARD.read_text().rstrip("\n"):
        fail(where, f"does not carry {DASHBOARD.relative_to(ROOT)} unchanged")


ALERT_TEMPLATE = re.compile(r"{{(.*?)}}", re.S)
# what the alert texts may template: $value or one of $labels, through functions
ALERT_TEMPLATE_BODY = re.compile(r"\s*\$(value|labels\.[a-zA-Z_]\w*)(\s*\|\s*\w+)*\s*")


def check_rules(
    case: str, rule_doc: dict[str, Any], scrape_interval: float, quiet: bool = False
) -> None:
    where = f"{case}/PrometheusRule"
    seen = set()
    for group in rule_doc["spec"]["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            here = f"{where}/{name}"
            if name in seen:
                fail(here, "duplicate alert name")
            seen.add(name)
            try:
                facts = promql_facts(str(rule["expr"]))
            except ValueError as err:
                fail(here, f"PromQL error {err}: {rule['expr']}")
                continue
            if not facts["metrics"] or unknown_metrics(facts["metrics"]):
                fail(here, f"unknown metric(s) {sorted(unknown_metrics(facts['metrics']))}")
            short = [w for _, w in facts["ranges"] if w < 4 * scrape_interval]
            if short:
                fail(
                    here,
                    f"range window(s) {short} s shorter than 4 scrape intervals "
                    f"({scrape_interval:.0f} s): rate() needs several samples",
                )
            if "alert" not in rule:
                continue
            if not rule.get("labels", {}).get("severity"):
                fail(here, "no severity label")
            annotations = rule.get("annotations", {})
            for key in ("summary", "description", "runbook"):
                if not annotations.get(key):
                    fail(here, f"no {key} annotation")
            for text in annotations.values():
                for body in ALERT_TEMPLATE.findall(text):
                    used = set(re.findall(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)", body))
                    if not ALERT_TEMPLATE_BODY.fullmatch(body):
                        fail(here, f"unexpected alert template {{{{{body}}}}}")
                    if used - facts["by"]:
                        fail(
                            here,
                            f"text uses $labels {sorted(used - facts['by'])} that the "
                            f"expression aggregates away",
                        )
    if not quiet and not any(f.startswith(where) for f in failures):
        print(
            f"ok   {case}: {len(seen)} alert rules parsed as PromQL, over known metrics, "
            f"with severity, summary, description, runbook"
        )


def check_chart() -> None:
    global quiet_failures
    check_values_schema()
    lint_cases = {c: case_values(f, o) for c, (f, o, _) in CASES.items()}
    for case, values in lint_cases.items():
        report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
        problems = [m for m in report["messages"] if m["severity"] >= 2] + [
            {"severity": 3, "path": "", "error": e} for e in report["errors"]
        ]
        for m in problems:
            fail(f"lint {case}", f"{m['path']}: {m['error']}")
        print(
            f"ok   helm lint --strict ({case}): {len(report['messages'])} message(s), "
            f"{len(problems)} warning/error(s)"
        )

    for case, (files, overrides, access_mode) in CASES.items():
        values = case_values(files, overrides)
        try:
            manifests = render(values)
        except helm.HelmError as err:
            fail(f"render {case}", str(err))
            continue
        before = len(failures)
        out = OUT / case
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*.yaml"):
            old.unlink()
        docs = []
        for path, doc in documents(manifests):
            where = f"{case}/{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            for error in validate_doc(doc):
                fail(where, error)
            docs.append(doc)
        for path, text in manifests.items():
            if path.endswith(".yaml") and text.strip():
                (out / Path(path).name).write_text(text)
        kinds = sorted(d["kind"] for d in docs)
        try:
            check_invariants(case, docs, access_mode, values)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
            fail(case, f"manifests lack what the invariant checks read: {err!r}")
        status = "ok  " if len(failures) == before else "FAIL"
        print(
            f"{status} {case}: {len(docs)} manifests {kinds} checked against k8s "
            f"{', '.join(KUBE_VERSIONS)} (strict) -> {out.relative_to(ROOT)}"
        )

    for what, values in BAD_VALUES.items():
        try:
            render(values)
        except helm.HelmError as err:
            by = "schema" if "schema" in str(err) else "template"
            reason = str(err).strip().splitlines()[-1].strip()[:90]
        else:
            fail("chart guard", f"rendered values it must refuse: {what}")
            continue
        if by == "template":
            # Helm lints in "lint mode", where a template's fail() only logs (so that lint
            # goes on with incomplete values): these guards stop install/upgrade/template.
            print(f"ok   refused by template guard (render): {what} ({reason})")
            continue
        report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
        if not report["errors"] and not any(m["severity"] >= 3 for m in report["messages"]):
            fail("chart guard", f"helm lint passes values its schema must refuse: {what}")
            continue
        print(f"ok   refused by schema (render and lint): {what} ({reason})")

    check_reuse_values_upgrade()

    # The validator itself must reject broken manifests (guards against a silent pass).
    docs = dict(
        (d["kind"], d)
        for _, d in documents(
            render({"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}})
        )
    )
    pm_docs = dict((d["kind"], d) for _, d in documents(render({"podMonitor": {"enabled": True}})))
    broken = copy.deepcopy(docs["Deployment"])
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMountz"] = []
    broken_sm = copy.deepcopy(docs["ServiceMonitor"])
    broken_sm["spec"]["endpoints"][0]["interval"] = 15
    broken_pm = copy.deepcopy(pm_docs["PodMonitor"])
    broken_pm["spec"]["podMetricsEndpoints"][0]["relabelling"] = []
    broken_rule = copy.deepcopy(docs["PrometheusRule"])
    broken_rule["spec"]["groups"][0]["rules"][0]["for"] = "30 minutes"
    caught = [
        len(validate_doc(broken)),
        len(validate_doc(broken_sm)),
        len(validate_doc(broken_pm)),
        len(validate_doc(broken_rule)),
    ]
    bad_promql = copy.deepcopy(docs["PrometheusRule"])
    bad_promql["spec"]["groups"][0]["rules"][0]["expr"] = "sum(rate(vllm:kvdisk_saves_total[5m])"
    bad_metric = copy.deepcopy(docs["PrometheusRule"])
    bad_metric["spec"]["groups"][0]["rules"][1]["expr"] = (
        "rate(vllm:kvdisk_save_failure_total[5m]) > 0"
    )
    before, quiet_failures = len(failures), True
    for doc in (bad_promql, bad_metric):
        check_rules("self-test", doc, 15, quiet=True)
    rule_caught, quiet_failures = len(failures) - before, False
    del failures[before:]
    if caught[0] != len(KUBE_VERSIONS) or min(caught[1:]) < 1 or rule_caught < 2:
        fail(
            "self-test",
            f"the validator missed a broken manifest (errors: {caught}, rules: {rule_caught})",
        )
    else:
        print(
            "ok   self-test: a broken Deployment, ServiceMonitor, PodMonitor and "
            "PrometheusRule, bad PromQL and an unknown metric are rejected"
        )


def check_reuse_values_upgrade() -> None:
    """`helm upgrade --reuse-values` from chart 0.1 renders the new templates with the OLD
    chart's defaults (Helm replaces the new values.yaml with the old release's coalesced
    values): the new templates must not fail on the sections 0.1 did not have."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    old = {
        k: v for k, v in defaults.items() if k not in ("podMonitor", "prometheusRule", "grafana")
    }
    old["serviceMonitor"] = {
        k: defaults["serviceMonitor"][k] for k in ("enabled", "interval", "scrapeTimeout", "labels")
    }
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / CHART.name
        shutil.copytree(CHART, chart)
        (chart / "values.yaml").write_text(yaml.safe_dump(old))
        try:
            for values in ({}, {"serviceMonitor": {"enabled": True, "labels": {"release": "x"}}}):
                with helm.Chart.load(str(chart)) as loaded:
                    docs = [
                        d
                        for _, d in documents(
                            loaded.render(
                                values, name=RELEASE, namespace=NAMESPACE, is_upgrade=True
                            )
                        )
                    ]
                for doc in docs:
                    for error in validate_doc(doc):
                        fail("upgrade --reuse-values from 0.1", f"{doc['kind']}: {error}")
        except helm.HelmError as err:
            fail("upgrade --reuse-values from 0.1", str(err).strip()[:300])
            return
    print("ok   upgrade from chart 0.1 with --reuse-values (0.1's defaults): renders and validates")


# -- the dashboard ----------------------------------------------------------------------


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # collapsed rows


RATE_INTERVAL_S, RANGE_S = 1234.0, 4321.0  # what $__rate_interval / $__range stand for here
VARIABLES = ("datasource", "namespace", "model_name", "pod")


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables as Grafana substitutes them (multi-value: a regex)."""
    promql = expr.replace("$__rate_interval", f"{RATE_INTERVAL_S:.0f}s")
    promql = promql.replace("$__range", f"{RANGE_S:.0f}s")
    for name in VARIABLES[1:]:
        promql = promql.replace(f"${name}", ".*")
    if "$" in promql:
        raise ValueError("unknown template variable")
    return promql


def check_dashboard() -> None:
    where = str(DASHBOARD.relative_to(ROOT))
    try:
        dash = json.loads(DASHBOARD.read_text())
    except (OSError, ValueError) as err:
        fail(where, f"not valid JSON: {err}")
        return
    if not isinstance(dash.get("panels"), list) or not dash["panels"]:
        fail(where, "needs a non-empty top-level panels list")
        return
    before = len(failures)
    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    if (
        variables.get("datasource", {}).get("type") != "datasource"
        or variables["datasource"].get("query") != "prometheus"
    ):
        fail(where, "needs a Prometheus datasource variable named datasource")
    for name in VARIABLES[1:]:
        var = variables.get(name)
        if var is None:
            fail(where, f"needs a {name} variable")
            continue
        query = var.get("query", {}).get("query", "")
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        if not m or m.group(2) != name or var.get("datasource", {}).get("uid") != "${datasource}":
            fail(
                where,
                f"variable {name}: expected label_values(<selector>, {name}) on "
                f"${{datasource}}, got {query!r}",
            )
            continue
        try:
            metrics = promql_facts(grafana_to_promql(m.group(1)))["metrics"]
            if unknown_metrics(metrics):
                fail(
                    where, f"variable {name}: unknown metric(s) {sorted(unknown_metrics(metrics))}"
                )
        except ValueError as err:
            fail(where, f"variable {name}: PromQL error {err}: {query}")
    ids, used, exprs = set(), set(), 0
    for panel in panels(dash):
        title = panel.get("title")
        if panel.get("id") in ids:
            fail(where, f"duplicate panel id {panel.get('id')}")
        ids.add(panel.get("id"))
        if panel.get("type") == "row":
            continue
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            fail(where, f"panel {title!r} does not use ${{datasource}}")
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            exprs += 1
            for name in VARIABLES[1:]:
                if f'{name}=~"${name}"' not in expr:
                    fail(where, f"panel {title!r}: query does not filter on ${name}: {expr}")
            try:
                facts = promql_facts(grafana_to_promql(expr))
            except ValueError as err:
                fail(where, f"panel {title!r}: PromQL error {err}: {expr}")
                continue
            used |= {
                HISTOGRAM_SUFFIX.sub("", n) if HISTOGRAM_SUFFIX.sub("", n) in EXPORTED else n
                for n in facts["metrics"]
            }
            if not facts["metrics"] or unknown_metrics(facts["metrics"]):
                fail(
                    where,
                    f"panel {title!r}: unknown metric(s) "
                    f"{sorted(unknown_metrics(facts['metrics'])) or 'none'} in {expr}",
                )
            for func, window in facts["ranges"]:
                whole_range = window == RANGE_S and func == "increase" and panel["type"] == "stat"
                if window != RATE_INTERVAL_S and not whole_range:
                    fail(
                        where,
                        f"panel {title!r}: {func}() over a fixed window; use "
                        f"$__rate_interval (or $__range for a stat's total): {expr}",
                    )
    if EXPORTED - used:
        fail(where, f"metrics without a panel: {sorted(EXPORTED - used)}")
    # TTFT beside the hit rate, so the benefit is visible
    by_title = {p.get("title"): p for p in panels(dash) if p.get("type") == "timeseries"}
    hit = by_title.get("Disk hit rate", {}).get("gridPos", {})
    ttft = [
        p["gridPos"]
        for p in by_title.values()
        if any("vllm:time_to_first_token_seconds_bucket" in t.get("expr", "") for t in p["targets"])
    ]
    if not hit or not any(
        g["y"] == hit["y"] and g["x"] in (hit["x"] + hit["w"], hit["x"] - g["w"]) for g in ttft
    ):
        fail(where, "no time-to-first-token panel beside the Disk hit rate panel")
    status = "ok  " if len(failures) == before else "FAIL"
    print(
        f"{status} dashboard: schemaVersion {dash.get('schemaVersion')}, {len(ids)} panels, "
        f"{exprs} queries over {len(used)} metrics, variables {', '.join(variables)}"
    )


# -- the production-stack values ------------------------------------------------------------

STRINGS = {"type": "array", "items": {"type": "string"}}
# The vllm-stack chart's values for one serving engine, as its helm/values.yaml describes
# them; the keys this project knows of (a typo is an error), with their types.
PSTACK_MODEL_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "repository", "tag", "modelURL"],
    "properties": {
        **{
            k: {"type": "string"}
            for k in (
                "name",
                "repository",
                "tag",
                "modelURL",
                "imagePullSecret",
                "serviceAccountName",
                "priorityClassName",
                "runtimeClassName",
                "chatTemplate",
                "chatTemplateConfigMap",
                "requestMemory",
                "limitMemory",
                "requestGPUType",
                "pvcStorage",
                "storageClass",
                "shmSize",
                "nodeName",
                "tolerationsPolicy",
                "modelRevision",
                "toolCallParser",
            )
        },
        **{
            k: {"type": "object"}
            for k in (
                "annotations",
                "podAnnotations",
                "podLabels",
                "labels",
                "resources",
                "pvcMatchLabels",
                "pvcLabels",
                "pvcAnnotations",
                "initContainer",
                "envFromSecret",
                "affinity",
                "keda",
                "raySpec",
                "serviceAnnotations",
            )
        },
        **{
            k: {"type": "array"}
            for k in (
                "extraVolumes",
                "extraVolumeMounts",
                "env",
                "nodeSelectorTerms",
                "tolerations",
            )
        },
        "enabled": {"type": "boolean"},
        "enableLoRA": {"type": "boolean"},
        "enableTool": {"type": "boolean"},
        "replicaCount": {"type": "integer", "minimum": 0},
        "requestCPU": {"type": ["integer", "number", "string"]},
        "limitCPU": {"type": ["integer", "number", "string"]},
        "requestGPU": {"type": ["integer", "number", "string"]},
        "pvcAccessMode": STRINGS,
        "hf_token": {"type": ["string", "object"]},
        "vllmConfig": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "v0": {"type": ["string", "integer"]},
                "enablePrefixCaching": {"type": "boolean"},
                "enableChunkedPrefill": {"type": "boolean"},
                "maxModelLen": {"type": "integer"},
                "dtype": {"type": "string"},
                "tensorParallelSize": {"type": "integer"},
                "maxNumSeqs": {"type": "integer"},
                "maxLoras": {"type": "integer"},
                "gpuMemoryUtilization": {"type": ["number", "string"]},
                "runner": {"type": "string"},
                "convert": {"type": "string"},
                "prometheusMultiprocDir": {"type": "string"},
                "extraArgs": STRINGS,
            },
        },
        "lmcacheConfig": {"type": "object"},
    },
}
PSTACK_VALUES_SCHEMA = {
    "type": "object",
    "required": ["servingEngineSpec"],
    "properties": {
        "servingEngineSpec": {
            "type": "object",
            "required": ["modelSpec"],
            "properties": {
                "modelSpec": {"type": "array", "minItems": 1, "items": PSTACK_MODEL_SPEC},
                "serviceMonitor": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "enabled": {"type": "boolean"},
                        "additionalLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        },
                        "interval": {"type": "string", "pattern": DURATION_PATTERN},
                        "scrapeTimeout": {"type": "string", "pattern": DURATION_PATTERN},
                        "honorLabels": {"type": "boolean"},
                        "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"},
                    },
                },
            },
        }
    },
}
K8S_DEFAULT_GRACE_S = 30  # the vllm-stack chart sets no terminationGracePeriodSeconds


def pstack_command(spec: dict[str, Any]) -> list[str]:
    """The serving container's command, as the vllm-stack chart's
    templates/deployment-vllm-multi.yaml builds it (the flags it adds itself, then extraArgs)."""
    cmd = ["vllm", "serve", spec["modelURL"], "--host", "0.0.0.0", "--port", "8000"]
    if spec.get("enableLoRA"):
        cmd.append("--enable-lora")
    cfg = spec.get("vllmConfig") or {}
    if "enableChunkedPrefill" in cfg:
        cmd.append(
            "--enable-chunked-prefill"
            if cfg["enableChunkedPrefill"]
            else "--no-enable-chunked-prefill"
        )
    cmd.append(
        "--enable-prefix-caching"
        if cfg.get("enablePrefixCaching")
        else "--no-enable-prefix-caching"
    )
    for key, flag in (
        ("maxModelLen", "--max-model-len"),
        ("dtype", "--dtype"),
        ("tensorParallelSize", "--tensor-parallel-size"),
        ("maxNumSeqs", "--max-num-seqs"),
        ("gpuMemoryUtilization", "--gpu_memory_utilization"),
        ("maxLoras", "--max_loras"),
    ):
        if key in cfg:
            cmd += [flag, str(cfg[key])]
    cmd += [str(a) for a in cfg.get("extraArgs", [])]
    if (spec.get("lmcacheConfig") or {}).get("enabled"):
        cmd += ["--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1"}']
    return cmd


def load_kvdisk_config_module() -> Any:
    """vllm_kvdisk/core/config.py, the plugin's own config loader (standard library only), loaded
    by path so that neither the package nor vLLM is imported."""
    path = ROOT / "vllm_kvdisk/core/config.py"
    spec = importlib.util.spec_from_file_location("kvdisk_config_for_validation", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def check_production_stack() -> None:
    where = str(PSTACK_VALUES.relative_to(ROOT))
    before = len(failures)
    try:
        values = yaml.safe_load(PSTACK_VALUES.read_text())
        pvc = yaml.safe_load(PSTACK_PVC.read_text())
    except (OSError, yaml.YAMLError) as err:
        fail(where, f"unreadable: {err}")
        return
    errors = list(jsonschema.Draft202012Validator(PSTACK_VALUES_SCHEMA).iter_errors(values))
    for err in errors:
        fail(where, f"vllm-stack values: {err.message} at /{'/'.join(map(str, err.absolute_path))}")
    if errors:
        return
    for error in validate_doc(pvc):
        fail(str(PSTACK_PVC.relative_to(ROOT)), error)
    config_module = load_kvdisk_config_module()
    for spec in values["servingEngineSpec"]["modelSpec"]:
        here = f"{where}: modelSpec {spec['name']}"
        cmd = pstack_command(spec)
        env = {e["name"]: e.get("value") for e in spec.get("env", [])}
        # the pod the chart would render, reduced to what this file sets, against k8s schemas
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "x"},
            "spec": {
                "containers": [
                    {
                        "name": "vllm",
                        "image": f"{spec['repository']}:{spec['tag']}",
                        "command": cmd,
                        "env": spec.get("env", []),
                        "volumeMounts": spec.get("extraVolumeMounts", []),
                    }
                ],
                "volumes": spec.get("extraVolumes", []),
            },
        }
        for error in validate_doc(pod):
            fail(here, f"env/extraVolumes/extraVolumeMounts: {error}")

        def flag(name: str, cmd: list[str] = cmd) -> list[str]:
            return [cmd[i + 1] for i, a in enumerate(cmd) if a == name]

        plugins = (env.get("VLLM_PLUGINS") or "").split(",")
        if not {"kvdisk", "kvdisk_replay"} <= set(plugins):
            fail(here, "env VLLM_PLUGINS must name kvdisk and kvdisk_replay")
        if "--enable-prefix-caching" not in cmd:
            fail(
                here,
                "vllmConfig.enablePrefixCaching must be true (the chart passes "
                "--no-enable-prefix-caching otherwise)",
            )
        if "--enable-prompt-tokens-details" not in cmd:
            fail(here, "--enable-prompt-tokens-details missing from vllmConfig.extraArgs")
        timeouts = flag("--shutdown-timeout")
        if len(timeouts) != 1 or not int(timeouts[0]) < K8S_DEFAULT_GRACE_S:
            fail(
                here,
                f"one --shutdown-timeout under the pod's {K8S_DEFAULT_GRACE_S} s grace "
                f"period is needed, got {timeouts}",
            )
        transfers = flag("--kv-transfer-config")
        if len(transfers) != 1:
            fail(
                here,
                f"exactly one --kv-transfer-config needed (lmcacheConfig adds its own), "
                f"got {len(transfers)}",
            )
            continue
        try:
            transfer = json.loads(transfers[0])
            expected = {
                "kv_connector": "kvdisk",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
            }
            if {k: transfer.get(k) for k in expected} != expected:
                raise ValueError(f"needs {expected}")
            extra = transfer["kv_connector_extra_config"]
            config = config_module.load_config(extra)
        except (ValueError, KeyError, TypeError) as err:
            fail(here, f"--kv-transfer-config: {err}")
            continue
        mounts = {m["mountPath"]: m["name"] for m in spec.get("extraVolumeMounts", [])}
        volumes = {v["name"]: v for v in spec.get("extraVolumes", [])}
        claim = (
            volumes.get(mounts.get(config.kv_disk_dir), {})
            .get("persistentVolumeClaim", {})
            .get("claimName")
        )
        if claim is None:
            fail(
                here,
                f"kv_disk_dir {config.kv_disk_dir} is not the mount point of a PVC "
                f"in extraVolumes/extraVolumeMounts",
            )
        elif claim != pvc["metadata"]["name"]:
            fail(here, f"mounts claim {claim}, {PSTACK_PVC.name} creates {pvc['metadata']['name']}")
        else:
            need = config.kv_disk_space_mb + config.kv_disk_min_free_mb
            size = mebibytes(pvc["spec"]["resources"]["requests"]["storage"])
            if size < need:
                fail(
                    here,
                    f"the cache PVC ({size:.0f} MiB) is smaller than the budget plus the "
                    f"free-space watermark ({need} MiB)",
                )
    # the README shows an excerpt: it must not drift from the file
    excerpt = readme_excerpt()
    if excerpt is None:
        fail(
            str(README.relative_to(ROOT)),
            "no ```yaml block starting with '# deploy/production-stack-values.yaml (excerpt)'",
        )
    elif not is_subset(excerpt, values):
        fail(
            str(README.relative_to(ROOT)),
            f"its excerpt of {PSTACK_VALUES.name} differs from the file",
        )
    status = "ok  " if len(failures) == before else "FAIL"
    print(
        f"{status} {where}: vllm-stack values layout, `vllm serve` args and the kvdisk "
        f"config (through vllm_kvdisk/core/config.py), cache PVC {PSTACK_PVC.name} (k8s strict), "
        f"README excerpt"
    )


def readme_excerpt() -> Any:
    for block in re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S):
        if block.startswith("# deploy/production-stack-values.yaml (excerpt)"):
            return yaml.safe_load(block)
    return None


def is_subset(small: Any, big: Any) -> bool:
    if isinstance(small, dict):
        return isinstance(big, dict) and all(
            k in big and is_subset(v, big[k]) for k, v in small.items()
        )
    if isinstance(small, list):
        return (
            isinstance(big, list)
            and len(small) <= len(big)
            and all(is_subset(s, b) for s, b in zip(small, big))
        )
    return small == big


def main() -> int:
    print(
        f"helm SDK {helm.helm_sdk_version()} (helm-python-sdk {helm.__version__}), "
        f"kubernetes-validate {kubernetes_validate.__version__}"
    )
    check_chart()
    check_dashboard()
    check_production_stack()
    if failures:
        print(f"deploy validation: {len(failures)} failure(s)")
        return 1
    print("deploy validation: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
