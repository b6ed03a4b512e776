#!/usr/bin/env bash
# Checks what of deploy/ can be checked on a machine with no Docker engine,
# no Kubernetes cluster and no Slurm: the systemd units verify (with the
# built binary in place of /opt/fedmesh/bin/fedmesh), the compose file and
# the manifests parse as YAML with the fields their tools require, the
# Grafana dashboard is JSON with panels, the Dockerfile is multi-stage and
# ends as a non-root user, and the shell scripts parse.
# Usage: tests/deploy/check_deploy.sh FEDMESH_BINARY
set -euo pipefail
ROOT=$(cd -- "$(dirname -- "$0")/../.." && pwd -P)
FEDMESH=${1:?usage: check_deploy.sh FEDMESH_BINARY}
PY=/usr/bin/python3; [[ -x $PY ]] || PY=python3
fail() { printf 'check_deploy: %s\n' "$*" >&2; exit 1; }
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT

# systemd: every unit verifies without a warning.
command -v systemd-analyze >/dev/null || fail "systemd-analyze is missing (Debian package systemd; deploy/setup.sh installs it)"
for unit in "$ROOT"/deploy/systemd/*.service; do
  name=$(basename "$unit")
  sed "s#/opt/fedmesh/bin/fedmesh#$FEDMESH#" "$unit" > "$WORK/$name"
  instance=${name/@.service/@site-a.service}
  out=$(cd "$WORK" && systemd-analyze verify "$WORK/$instance" 2>&1) || fail "$name does not verify: $out"
  [[ -z $out ]] || fail "$name: systemd-analyze verify printed: $out"
  # (LimitNOFILE: one descriptor per connection; the default soft 1024 is a stranger's to exhaust.)
  for key in NoNewPrivileges=yes ProtectSystem=strict User=fedmesh Restart=on-failure LimitNOFILE=; do
    grep -q "^$key" "$unit" || fail "$name lacks $key"
  done
  echo "ok: $name verifies"
done

# YAML and JSON.
"$PY" - "$ROOT" <<'PYEOF'
import json, sys, yaml
root = sys.argv[1]
def fail(message):
    sys.exit("check_deploy: " + message)

compose = yaml.safe_load(open(root + "/deploy/docker/compose.yaml"))
services = compose.get("services") or fail("compose.yaml has no services")
for required in ("aggregator", "site-a", "site-b", "site-c"):
    if required not in services: fail("compose.yaml lacks service " + required)
for name, service in services.items():
    for key in ("command", "volumes", "image"):
        if key not in service: fail("compose.yaml: service %s lacks %s" % (name, key))
    if service["command"][0] not in ("aggregator", "node"): fail("compose.yaml: %s runs %s" % (name, service["command"]))
print("ok: compose.yaml: %d services" % len(services))

docs = [d for d in yaml.safe_load_all(open(root + "/deploy/kubernetes/fedmesh.yaml")) if d]
kinds = {}
for d in docs:
    for key in ("apiVersion", "kind", "metadata"):
        if key not in d: fail("fedmesh.yaml: a document lacks " + key)
    if "name" not in d["metadata"]: fail("fedmesh.yaml: a %s has no metadata.name" % d["kind"])
    kinds.setdefault(d["kind"], []).append(d)
    if d["kind"] == "StatefulSet":
        spec = d["spec"]
        for key in ("selector", "serviceName", "template", "volumeClaimTemplates"):
            if key not in spec: fail("StatefulSet %s lacks spec.%s" % (d["metadata"]["name"], key))
        labels = spec["template"]["metadata"]["labels"]
        for k, v in spec["selector"]["matchLabels"].items():
            if labels.get(k) != v: fail("StatefulSet %s: the selector does not match the pod labels" % d["metadata"]["name"])
        for c in spec["template"]["spec"]["containers"]:
            for key in ("image", "readinessProbe", "livenessProbe", "resources"):
                if key not in c: fail("container %s lacks %s" % (c["name"], key))
            if not c["securityContext"].get("allowPrivilegeEscalation") is False: fail("container %s may escalate" % c["name"])
            for probe in ("readinessProbe", "livenessProbe"):
                # /metrics needs the access token on an exposed aggregator: probes use the open /healthz.
                if c[probe]["httpGet"]["path"] != "/healthz": fail("container %s: %s is not /healthz" % (c["name"], probe))
        if not spec["template"]["spec"]["securityContext"].get("runAsNonRoot"): fail("%s may run as root" % d["metadata"]["name"])
for kind in ("Namespace", "Service", "StatefulSet"):
    if kind not in kinds: fail("fedmesh.yaml has no " + kind)
gpu = [c for s in kinds["StatefulSet"] for c in s["spec"]["template"]["spec"]["containers"]
       if "nvidia.com/gpu" in c["resources"].get("requests", {})]
if not gpu: fail("fedmesh.yaml: no site asks for a GPU")
print("ok: fedmesh.yaml: " + ", ".join("%d %s" % (len(v), k) for k, v in sorted(kinds.items())))

scrape = yaml.safe_load(open(root + "/deploy/kubernetes/prometheus-scrape.yaml"))
if not scrape.get("scrape_configs"): fail("prometheus-scrape.yaml has no scrape_configs")
dashboard = json.load(open(root + "/deploy/kubernetes/grafana-dashboard.json"))
exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
for metric in ("fedmesh_round", "fedmesh_global_accuracy", "fedmesh_updates_rejected_total"):
    if not any(metric in e for e in exprs): fail("the dashboard does not chart " + metric)
print("ok: prometheus-scrape.yaml, grafana-dashboard.json (%d panels)" % len(dashboard["panels"]))
PYEOF

# The dashboard's metrics are ones the aggregator serves.
for metric in fedmesh_round fedmesh_global_accuracy fedmesh_updates_rejected_total fedmesh_bytes_received_total \
              fedmesh_round_duration_seconds fedmesh_update_staleness fedmesh_connected_sites; do
  grep -q "\"$metric\"" "$ROOT/aggregator/operator_view.cpp" || fail "the dashboard charts $metric, which the aggregator does not serve"
done

# The probes' /healthz is served by every role, without the access token.
grep -q 'pages\["/healthz"\] = {"text/plain", .*, true}' "$ROOT/base/http_endpoint.cpp" \
  || fail "base/http_endpoint.cpp does not serve /healthz open to probes"

# Dockerfiles (CPU and CUDA): two stages, Debian 12, a non-root user last.
for DF in "$ROOT"/deploy/docker/Dockerfile "$ROOT"/deploy/docker/Dockerfile.cuda; do
  name=$(basename "$DF")
  [[ $(grep -c '^FROM ' "$DF") -ge 2 ]] || fail "$name is not multi-stage"
  grep -q '^FROM debian:12' "$DF" || fail "$name does not start from Debian 12"
  [[ $(grep '^USER ' "$DF" | tail -1) == "USER fedmesh" ]] || fail "$name does not end as the fedmesh user"
  echo "ok: $name (multi-stage, non-root)"
done
DF=$ROOT/deploy/docker/Dockerfile.cuda
grep -q -- '-Dcuda=enabled' "$DF" || fail "Dockerfile.cuda does not build the CUDA backend"
grep -q "grep -v '/libcuda" "$DF" || fail "Dockerfile.cuda would copy the build machine's driver library into the image"

# Shell scripts parse.
for script in "$ROOT"/deploy/slurm/*.sbatch; do
  bash -n "$script" || fail "$script does not parse"
  grep -q '^#SBATCH --gres=gpu' "$script" || fail "$script asks for no GPU"
done
echo "ok: slurm script parses"
echo "not run here (no engine, cluster or scheduler on this machine): docker build, docker compose up, kubectl apply, sbatch"
