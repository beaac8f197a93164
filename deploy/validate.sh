#!/usr/bin/env bash
# Offline validation of the deployment files (CI: `bash deploy/validate.sh`).
#   - values.schema.json (draft-07) and helm lint --strict + render of deploy/helm/vllm-kvdisk
#     for the default values, values-rwx.yaml, an all-options and a PodMonitor case (Helm
#     v4.2.3's engine via helm-python-sdk);
#   - every rendered manifest against the Kubernetes 1.29 and 1.37 JSON schemas
#     (kubernetes-validate, strict); ServiceMonitor, PodMonitor and PrometheusRule against
#     the subset schemas in deploy/monitoring_schemas.py;
#   - deployment invariants, the alert rules (PromQL, metrics, annotations), values the chart
#     must refuse (schema and template guards), an upgrade with --reuse-values from 0.1, a
#     validator self-test;
#   - the Grafana dashboard (helm/vllm-kvdisk/dashboards/kvdisk-dashboard.json): JSON,
#     panels, variables, PromQL, metric names, $__rate_interval windows;
#   - deploy/production-stack-values.yaml and its PVC (vllm-stack layout, `vllm serve` args,
#     the kvdisk config through the plugin's own loader) and the README's excerpt of it;
#   - deploy/Dockerfile with hadolint (the image itself is not built: no docker engine).
# The pinned tools (deploy/requirements-validate.txt) are installed once from PyPI into
# .cache/deploy-venv; the checks themselves run without network (in an empty network
# namespace where `unshare -n` is allowed). Exit status non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.cache/deploy-venv
REQ=deploy/requirements-validate.txt
STAMP="$VENV/.requirements-$(sha256sum "$REQ" | cut -c1-16)"

if [ ! -f "$STAMP" ]; then
    echo "deploy/validate.sh: installing pinned tools into $VENV"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
        --only-binary=:all: -r "$REQ"
    touch "$STAMP"
fi

# Prove the checks need no network: run them in a fresh network namespace when we may.
offline=()
if unshare -n true 2>/dev/null; then
    offline=(unshare -n)
fi
"${offline[@]}" "$VENV/bin/python" deploy/validate_manifests.py
"${offline[@]}" "$VENV/bin/hadolint" --no-color deploy/Dockerfile
for src in $(awk '$1 == "COPY" { for (i = 2; i < NF; i++) print $i }' deploy/Dockerfile); do
    [ -e "$src" ] || { echo "FAIL deploy/Dockerfile: COPY source $src does not exist"; exit 1; }
done
echo "ok   deploy/Dockerfile: hadolint $("$VENV/bin/hadolint" --version | awk '{print $NF}') clean, COPY sources present"

# Cross-check with a real helm CLI when the machine has one (not required).
if command -v helm >/dev/null 2>&1; then
    chart=deploy/helm/vllm-kvdisk
    all=(--set serviceMonitor.enabled=true --set prometheusRule.enabled=true
         --set grafana.dashboards.enabled=true)
    helm lint --strict "$chart" >/dev/null
    helm lint --strict "$chart" -f "$chart/values-rwx.yaml" "${all[@]}" >/dev/null
    helm template kv "$chart" >/dev/null
    helm template kv "$chart" -f "$chart/values-rwx.yaml" "${all[@]}" >/dev/null
    helm template kv "$chart" --set podMonitor.enabled=true >/dev/null
    # the schema must stop these in the CLI too
    for bad in replicas=3 kvdisk.spaceMb=-1 serviceMonitor.interval=15; do
        if helm template kv "$chart" --set "$bad" >/dev/null 2>&1; then
            echo "FAIL helm CLI: helm template accepted --set $bad"; exit 1
        fi
    done
    echo "ok   helm CLI $(helm version --short) lint/template agree, schema refuses bad values"
fi
echo "deploy/validate.sh: OK"
