"""Offline checks of deploy/ (run by deploy/validate.sh inside its pinned venv).

1. helm lint --strict of the chart, for each values case below.
2. Render each case (Helm v4's Go SDK through helm-python-sdk: the engine of `helm
   template`), write the manifests to .cache/deploy-rendered/<case>/, and validate every
   document against the Kubernetes JSON schemas bundled in kubernetes-validate (strict:
   unknown fields are errors), for the oldest and newest Kubernetes the chart targets.
   ServiceMonitor (a CRD, not in those schemas) is checked against SERVICEMONITOR below.
3. A few deployment invariants the schemas cannot see (grace period > shutdown timeout,
   GPU requests == limits, /dev/shm in memory, /health probes, ports and selectors wired).
4. Values the chart must refuse, and a broken manifest the validator must reject.
5. The Grafana dashboard: JSON, a top-level panels list, the template variables, every
   query parsed as PromQL (promql-parser), and only the metric names the plugin exports.
Exit status 1 on any failure; nothing here touches the network.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import helm_python as helm
import jsonschema
import kubernetes_validate
import promql_parser
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy/helm/vllm-kvdisk"
DASHBOARD = ROOT / "deploy/grafana/kvdisk-dashboard.json"
OUT = ROOT / ".cache/deploy-rendered"
KUBE_VERSIONS = ("1.29.0", "1.37.0")  # Chart.yaml kubeVersion >=1.29; newest bundled schemas
RELEASE, NAMESPACE = "kv", "inference"

# name -> (values files, --set style overrides, access mode the PVC must have or None)
CASES: dict[str, tuple[list[str], dict[str, Any], str | None]] = {
    "default": ([], {}, "ReadWriteOnce"),
    "rwx": (["values-rwx.yaml"], {}, "ReadWriteMany"),
    # every optional branch on: ServiceMonitor, trace, existing claims, served name, env
    "all-options": (["values-rwx.yaml"], {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "kvdisk": {"trace": {"enabled": True}, "extraArgs": ["--kv-cache-min-tokens", "1024"]},
        "persistence": {"existingClaim": "shared-kvdisk"},
        "modelCache": {"existingClaim": "model-weights"},
        "model": {"servedModelName": "qwen-7b"},
        "gpu": {"count": 2},
        "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
        "imagePullSecrets": [{"name": "regcred"}],
        "podAnnotations": {"example.com/team": "inference"},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    }, None),
}
# values the chart must refuse at render time
BAD_VALUES = {
    "grace period not above shutdown timeout": {"terminationGracePeriodSeconds": 30},
    "zero disk budget": {"kvdisk": {"spaceMb": 0}},
}

DURATION = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h))+$"}
# The subset of monitoring.coreos.com/v1 ServiceMonitor the chart uses; field names and
# types as in the Prometheus Operator CRD. Unknown fields are errors, as in strict mode.
SERVICEMONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                         "maxLength": 253},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                                   "additionalProperties": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "required": ["port"], "additionalProperties": False,
                        "properties": {"port": {"type": "string"},
                                       "path": {"type": "string", "pattern": "^/"},
                                       "interval": DURATION, "scrapeTimeout": DURATION},
                    },
                },
            },
        },
    },
}

ALLOWED_METRICS = {
    "vllm:kvdisk_lookups_total", "vllm:kvdisk_prompt_tokens_looked_up_total",
    "vllm:kvdisk_tokens_loaded_total", "vllm:kvdisk_saves_total",
    "vllm:kvdisk_save_failures_total", "vllm:kvdisk_bytes_written_total",
    "vllm:kvdisk_bytes_read_total", "vllm:kvdisk_evictions_total",
    "vllm:kvdisk_quarantined_files_total", "vllm:kvdisk_load_seconds_bucket",
    "vllm:kvdisk_save_seconds_bucket", "vllm:kvdisk_disk_bytes", "vllm:kvdisk_disk_files",
    "vllm:kvdisk_disk_budget_bytes", "vllm:kvdisk_pending_writes",
    "vllm:prompt_tokens_cached_by_source_total",
}

failures: list[str] = []


def fail(where: str, message: str) -> None:
    failures.append(f"{where}: {message}")
    print(f"FAIL {where}: {message}")


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
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
        for err in jsonschema.Draft202012Validator(SERVICEMONITOR).iter_errors(doc):
            errors.append(f"ServiceMonitor schema (own subset): {err.message} at "
                          f"/{'/'.join(map(str, err.absolute_path))}")
        return errors
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            errors.append(f"k8s {version} schema: {err.message} at "
                          f"/{'/'.join(map(str, err.absolute_path))}")
        except kubernetes_validate.SchemaNotFoundError as err:
            errors.append(f"no k8s {version} schema: {err.message}")
    return errors


def check_invariants(case: str, docs: list[dict[str, Any]], access_mode: str | None) -> None:
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
        fail(where, f"terminationGracePeriodSeconds {grace} must exceed --shutdown-timeout "
                    f"{shutdown}")
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
    if any(dep["spec"]["template"]["metadata"]["labels"].get(k) != v for k, v in sel.items()):
        fail(where, "selector does not match the pod labels")
    if svc["spec"]["selector"] != sel:
        fail(f"{case}/Service", "selector differs from the Deployment's")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    if ports.get("http", {}).get("port") != 8000:
        fail(f"{case}/Service", "needs port 8000 named http")
    for sm in by_kind.get("ServiceMonitor", []):
        if sm["spec"]["selector"]["matchLabels"].items() - svc["metadata"]["labels"].items():
            fail(f"{case}/ServiceMonitor", "selector does not select the Service")
        for ep in sm["spec"]["endpoints"]:
            if ep["port"] not in ports or ep.get("path") != "/metrics":
                fail(f"{case}/ServiceMonitor", f"endpoint {ep} is not /metrics on a Service port")
    claims = by_kind.get("PersistentVolumeClaim", [])
    if access_mode is not None:
        if len(claims) != 1 or claims[0]["spec"]["accessModes"] != [access_mode]:
            fail(f"{case}/PersistentVolumeClaim", f"expected one claim with {access_mode}")
        elif claims[0]["metadata"]["name"] != cache_claim:
            fail(f"{case}/PersistentVolumeClaim", "the Deployment mounts another claim")


def check_chart() -> None:
    lint_cases = {c: case_values(f, o) for c, (f, o, _) in CASES.items()}
    for case, values in lint_cases.items():
        report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
        problems = [m for m in report["messages"] if m["severity"] >= 2] + [
            {"severity": 3, "path": "", "error": e} for e in report["errors"]]
        for m in problems:
            fail(f"lint {case}", f"{m['path']}: {m['error']}")
        print(f"ok   helm lint --strict ({case}): {len(report['messages'])} message(s), "
              f"{len(problems)} warning/error(s)")

    for case, (files, overrides, access_mode) in CASES.items():
        try:
            manifests = render(case_values(files, overrides))
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
            check_invariants(case, docs, access_mode)
        except (KeyError, IndexError, TypeError, ValueError) as err:
            fail(case, f"manifests lack what the invariant checks read: {err!r}")
        status = "ok  " if len(failures) == before else "FAIL"
        print(f"{status} {case}: {len(docs)} manifests {kinds} checked against k8s "
              f"{', '.join(KUBE_VERSIONS)} (strict) -> {out.relative_to(ROOT)}")

    for what, values in BAD_VALUES.items():
        try:
            render(values)
        except helm.HelmError as err:
            print(f"ok   refused: {what} ({str(err).splitlines()[0][:100]})")
        else:
            fail("chart guard", f"rendered values it must refuse: {what}")

    # The validator itself must reject a broken manifest (guards against a silent pass).
    docs = dict((d["kind"], d) for _, d in documents(render({"serviceMonitor": {"enabled": True}})))
    broken = copy.deepcopy(docs["Deployment"])
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMountz"] = []
    broken_sm = copy.deepcopy(docs["ServiceMonitor"])
    broken_sm["spec"]["endpoints"][0]["interval"] = 15
    caught = [len(validate_doc(broken)), len(validate_doc(broken_sm))]
    if caught[0] != len(KUBE_VERSIONS) or caught[1] < 1:
        fail("self-test", f"the validator missed a broken manifest (errors: {caught})")
    else:
        print("ok   self-test: a broken Deployment and ServiceMonitor are rejected")


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # collapsed rows


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
    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    if variables.get("datasource", {}).get("type") != "datasource" or \
            variables["datasource"].get("query") != "prometheus":
        fail(where, "needs a Prometheus datasource variable named datasource")
    if "model_name" not in variables:
        fail(where, "needs a model_name variable")
    before = len(failures)
    ids, used, exprs = set(), set(), 0
    for panel in panels(dash):
        if panel.get("id") in ids:
            fail(where, f"duplicate panel id {panel.get('id')}")
        ids.add(panel.get("id"))
        if panel.get("type") == "row":
            continue
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            fail(where, f"panel {panel.get('title')!r} does not use ${{datasource}}")
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            exprs += 1
            names = set(re.findall(r"vllm:[a-zA-Z0-9_:]+", expr))
            used |= names
            if not names or names - ALLOWED_METRICS:
                fail(where, f"panel {panel.get('title')!r}: unknown metric(s) "
                            f"{sorted(names - ALLOWED_METRICS) or 'none'} in {expr}")
            # Grafana's variables as Grafana substitutes them, then Prometheus' grammar.
            promql = expr.replace("$model_name", ".*").replace("$__rate_interval", "5m")
            promql = promql.replace("$__range", "6h")
            try:
                if "$" in promql:
                    raise ValueError("unknown template variable")
                promql_parser.parse(promql)
            except ValueError as err:
                fail(where, f"panel {panel.get('title')!r}: PromQL error {err}: {expr}")
    if ALLOWED_METRICS - used:
        fail(where, f"metrics without a panel: {sorted(ALLOWED_METRICS - used)}")
    status = "ok  " if len(failures) == before else "FAIL"
    print(f"{status} dashboard: schemaVersion {dash.get('schemaVersion')}, "
          f"{len(ids)} panels, {exprs} queries over {len(used)} metrics")


def main() -> int:
    print(f"helm SDK {helm.helm_sdk_version()} (helm-python-sdk {helm.__version__}), "
          f"kubernetes-validate {kubernetes_validate.__version__}")
    check_chart()
    check_dashboard()
    if failures:
        print(f"deploy validation: {len(failures)} failure(s)")
        return 1
    print("deploy validation: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
