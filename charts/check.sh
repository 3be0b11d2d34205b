#!/usr/bin/env bash
# The chart's checks (`make chart`) and the kustomize base generated from it (`make manifests`).
#
#   charts/check.sh          helm lint --strict and helm template of the chart with every example
#                            values file (charts/persistent-pod-state/ci/), on the newest and the
#                            oldest supported Kubernetes; invalid values refused by the schema
#                            with the field's path, or by the chart's templates with their
#                            message; manifests/base and the cert-manager overlay's
#                            certificates equal to their rendering.
#   charts/check.sh --write  renders them from the chart (after files/crd.yaml).
#
# helm is built at its pinned version by e2e/build-helm.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHART="$ROOT/charts/persistent-pod-state"
HELM="${HELM:-$(bash "$ROOT/e2e/build-helm.sh" | tail -n 1)}"
say() { printf '[%s] chart: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
fail() { say "$*"; exit 1; }

# The files of manifests/base rendered from the chart (namespace.yaml and kustomization.yaml are
# kustomize's own).
BASE=(crd rbac flowschema deployment pdb service networkpolicy webhooks)

# render_base DIR: manifests/base's generated files into DIR.
render_base() {
  local t
  for t in "${BASE[@]}"; do
    {
      echo "# Generated from charts/persistent-pod-state (values: ci/kustomize-base-values.yaml) by"
      echo "# \`make manifests\`: edit the chart, not this file."
      "$HELM" template persistent-pod-state "$CHART" --namespace persistent-pod-state \
        --kube-version 1.37.0 -f "$CHART/ci/kustomize-base-values.yaml" \
        --show-only "templates/$t.yaml" | grep -v '^# Source: '
    } >"$1/$t.yaml"
  done
}

# The cert-manager overlay's certificates (its root, CA Issuer and serving Certificate): the
# chart's own in cert-manager mode, so the two never drift apart.
CERT_MANAGER="manifests/overlays/cert-manager/certificates.yaml"

# render_cert_manager FILE: the overlay's certificates into FILE.
render_cert_manager() {
  {
    echo "# Generated from charts/persistent-pod-state (values: ci/kustomize-base-values.yaml,"
    echo "# certificates.mode=cert-manager) by \`make manifests\`: edit the chart, not this file."
    "$HELM" template persistent-pod-state "$CHART" --namespace persistent-pod-state \
      --kube-version 1.37.0 -f "$CHART/ci/kustomize-base-values.yaml" \
      --set certificates.mode=cert-manager \
      --show-only templates/certificates.yaml | grep -v '^# Source: '
  } >"$1"
}

if [[ ${1:-} == --write ]]; then
  render_base "$ROOT/manifests/base"
  render_cert_manager "$ROOT/$CERT_MANAGER"
  say "manifests/base and $CERT_MANAGER rendered from the chart"
  exit 0
fi

say "helm $("$HELM" version --template '{{.Version}}'): lint and template with every example values file"
for values in "$CHART"/ci/*-values.yaml; do
  name=${values#"$CHART"/}
  "$HELM" lint --strict "$CHART" -f "$values" >/dev/null || {
    "$HELM" lint --strict "$CHART" -f "$values"
    fail "helm lint $name"
  }
  for kube in 1.37.0 1.20.0; do
    # The pre-1.28 registration is what an older cluster gets with matchConditions "auto".
    out=$("$HELM" template t "$CHART" -n ops --kube-version "$kube" -f "$values") || fail "helm template $name (Kubernetes $kube)"
    if [[ $kube == 1.20.0 && $name != *kustomize-base* ]] && grep -q 'matchConditions:' <<<"$out" &&
      ! grep -q 'matchConditions: true' "$values"; then
      fail "$name on Kubernetes $kube renders matchConditions"
    fi
    # The CRD's selectable field: where the cluster knows it ("auto"), and nowhere else.
    if grep -q 'kind: CustomResourceDefinition' <<<"$out" && ! grep -q 'selectableFields:' "$values"; then
      if [[ $kube == 1.37.0 ]] && ! grep -q 'selectableFields:' <<<"$out"; then
        fail "$name on Kubernetes $kube renders the CRD without selectableFields"
      fi
      if [[ $kube == 1.20.0 ]] && grep -q 'selectableFields:' <<<"$out"; then
        fail "$name on Kubernetes $kube renders the CRD with selectableFields"
      fi
    fi
    # The PodDisruptionBudget: only with more than one replica, in the version the cluster serves
    # (policy/v1 from 1.21; 1.20 has only policy/v1beta1).
    pdb=$(grep -x -B1 'kind: PodDisruptionBudget' <<<"$out" | head -n 1 || true)
    if grep -qx 'replicaCount: 1' "$values"; then
      [[ -z $pdb ]] || fail "$name on Kubernetes $kube renders a PodDisruptionBudget for one replica"
    else
      want="apiVersion: policy/v1"
      [[ $kube == 1.20.0 ]] && want="apiVersion: policy/v1beta1"
      [[ $pdb == "$want" ]] || fail "$name on Kubernetes $kube renders the PodDisruptionBudget as '$pdb', not '$want'"
    fi
  done
  say "ok: $name"
done

# The Lease's FlowSchema, in the newest version each Kubernetes serves (v1beta1 until 1.22,
# v1beta2 until 1.25, v1beta3 until 1.28, v1 since 1.29), and none without leader election.
for pair in 1.20.0=v1beta1 1.22.0=v1beta1 1.23.0=v1beta2 1.25.0=v1beta2 1.26.0=v1beta3 1.28.0=v1beta3 1.29.0=v1 1.37.0=v1; do
  kube=${pair%=*}
  out=$("$HELM" template t "$CHART" -n ops --kube-version "$kube" --show-only templates/flowschema.yaml) ||
    fail "helm template of the FlowSchema (Kubernetes $kube)"
  grep -qx "apiVersion: flowcontrol.apiserver.k8s.io/${pair#*=}" <<<"$out" ||
    fail "the FlowSchema on Kubernetes $kube is not in ${pair#*=}: $out"
done
for off in "leaderElection.flowSchema=false" "leaderElection.enabled=false,replicaCount=1"; do
  out=$("$HELM" template t "$CHART" --set "$off") || fail "helm template with $off"
  ! grep -q 'kind: FlowSchema' <<<"$out" || fail "a FlowSchema rendered with $off"
done
say "ok: the Lease's FlowSchema in the version each Kubernetes serves"

# Invalid values are refused by the schema, naming the field.
refused() {
  local want=$1
  shift
  local out
  if out=$("$HELM" template t "$CHART" "$@" 2>&1); then
    fail "accepted: $*"
  fi
  grep -qF "at '$want'" <<<"$out" || fail "refused without naming $want: $out"
}
refused /webhook/failurePolicy --set webhook.failurePolicy=Sometimes
refused /webhook/timeoutSeconds --set webhook.timeoutSeconds=60
refused /customWorkloads/0/group --set 'customWorkloads[0].group=Not_A_Group' --set 'customWorkloads[0].kind=Ring'
refused /customWorkloads/0 --set 'customWorkloads[0].kind=Ring'
refused /certificates/mode --set certificates.mode=letsencrypt
refused /nodeLostAfter --set nodeLostAfter=soon
refused /nodeLocalVolumeKeys/0 --set 'nodeLocalVolumeKeys[0]=Not/A/Key'
refused '' --set replicas=3
refused /podDisruptionBudget/minAvailable --set podDisruptionBudget.minAvailable=half
say "ok: invalid values refused with the field's path"

# Values the schema cannot judge alone are refused by the templates (`fail`), saying why.
refused_with() {
  local want=$1
  shift
  local out
  if out=$("$HELM" template t "$CHART" "$@" 2>&1); then
    fail "accepted: $*"
  fi
  grep -qF "$want" <<<"$out" || fail "refused without saying '$want': $out"
}
refused_with 'leaderElection.enabled=false needs replicaCount=1 (it is 2)' --set leaderElection.enabled=false
refused_with 'retryPeriodSeconds (10) < renewDeadlineSeconds (10) < leaseDurationSeconds (15)' \
  --set leaderElection.retryPeriodSeconds=10
refused_with 'retryPeriodSeconds (2) < renewDeadlineSeconds (15) < leaseDurationSeconds (15)' \
  --set leaderElection.renewDeadlineSeconds=15
refused_with 'podDisruptionBudget.minAvailable=2 with replicaCount=2 lets no replica be evicted' \
  --set podDisruptionBudget.minAvailable=2
refused_with 'podDisruptionBudget.minAvailable=51% with replicaCount=2 lets no replica be evicted' \
  --set podDisruptionBudget.minAvailable=51%
refused_with 'prometheusRule.enabled needs serviceMonitor.enabled' --set prometheusRule.enabled=true
refused_with 'prometheusRule.certificateExpiryDays=14 is not below certificates.certManager.renewBefore=240h' \
  -f "$CHART/ci/cert-manager-issuer-values.yaml" --set prometheusRule.enabled=true --set serviceMonitor.enabled=true
refused_with 'prometheusRule.certificateExpiryDays=400 is not below certificates.selfSigned.validityDays=365' \
  --set prometheusRule.enabled=true --set serviceMonitor.enabled=true --set prometheusRule.certificateExpiryDays=400
refused_with 'terminationGracePeriodSeconds (20) must cover shutdownDelaySeconds (3) + drainSeconds (20)' \
  --set terminationGracePeriodSeconds=20
refused_with 'certificates.mode=external needs certificates.external.caBundle' --set certificates.mode=external \
  --set certificates.external.secretName=mine
say "ok: inconsistent values refused by the templates"

# ... and their consistent counterparts accepted.
out=$("$HELM" template t "$CHART" --set prometheusRule.enabled=true --set prometheusRule.jobLabel=pods) ||
  fail "prometheusRule.jobLabel without serviceMonitor refused"
grep -qF 'pps_leader{job="pods", namespace="default"}' <<<"$out" || fail "prometheusRule.jobLabel not in the alerts"
"$HELM" template t "$CHART" -f "$CHART/ci/cert-manager-issuer-values.yaml" --set prometheusRule.enabled=true \
  --set serviceMonitor.enabled=true --set prometheusRule.certificateExpiryDays=9 >/dev/null ||
  fail "certificateExpiryDays below renewBefore refused"
out=$("$HELM" template t "$CHART" --set webhook.validatePersistentPodStates=false) ||
  fail "webhook.validatePersistentPodStates=false refused"
! grep -q 'kind: ValidatingWebhookConfiguration' <<<"$out" ||
  fail "webhook.validatePersistentPodStates=false renders the ValidatingWebhookConfiguration"
out=$("$HELM" template t "$CHART" -f "$CHART/ci/single-replica-values.yaml") ||
  fail "single-replica-values refused"
grep -qF 'type: Recreate' <<<"$out" || fail "without leader election the Deployment is not updated by Recreate"
out=$("$HELM" template a-release-name-of-thirty-five-chars "$CHART") || fail "a long release name refused"
long=$(grep -oE '[a-z0-9.-]*-unregister' <<<"$out" | awk 'length($0) > 63' | head -n 1)
[[ -z $long ]] || fail "the uninstall hook's name $long is over 63 characters (a label value)"
grep -q -- '-unregister$' <<<"$out" || fail "no uninstall hook rendered"
# webhook.url's host is named by the serving certificate (an IP as an IP address).
out=$("$HELM" template t "$CHART" --set certificates.mode=cert-manager --set webhook.url=https://10.0.0.1:9443/ \
  --show-only templates/certificates.yaml) || fail "webhook.url with cert-manager refused"
grep -A1 -x '  ipAddresses:' <<<"$out" | grep -qx '    - 10.0.0.1' || fail "webhook.url's IP not in the Certificate"
out=$("$HELM" template t "$CHART" --set certificates.mode=cert-manager --set webhook.url=https://pps.example.com:8443 \
  --show-only templates/certificates.yaml) || fail "webhook.url with cert-manager refused"
grep -qx '    - pps.example.com' <<<"$out" || fail "webhook.url's host not in the Certificate"
say "ok: their consistent counterparts accepted"

# A release that adopted the kustomize manifests' objects keeps their selectors (a Deployment's
# cannot change: docs/install.md); by default the chart's name the release too.
selectors() { awk '/^  (selector|podSelector):$/ {on=1; print; next} on && /^    / {print; next} {on=0}'; }
for t in deployment service pdb networkpolicy; do
  render() { "$HELM" template persistent-pod-state "$CHART" -n persistent-pod-state --kube-version 1.37.0 \
    --set crd.conversionService=true --show-only "templates/$t.yaml" "$@" | selectors; }
  adopted=$(render --set instanceInSelectors=false) || fail "instanceInSelectors=false refused"
  [[ -n $adopted && $adopted == "$(selectors <"$ROOT/manifests/base/$t.yaml")" ]] ||
    fail "with instanceInSelectors=false the $t's selectors are not the kustomize base's: $adopted"
  grep -q 'app.kubernetes.io/instance: persistent-pod-state' <<<"$(render)" ||
    fail "the $t's selectors do not name the release"
done
say "ok: selectors with and without the release's name"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
render_base "$tmp"
for t in "${BASE[@]}"; do
  diff -u "$ROOT/manifests/base/$t.yaml" "$tmp/$t.yaml" >&2 ||
    fail "manifests/base/$t.yaml is not the chart's rendering: run \`make manifests\`"
done
render_cert_manager "$tmp/certificates.yaml"
diff -u "$ROOT/$CERT_MANAGER" "$tmp/certificates.yaml" >&2 ||
  fail "$CERT_MANAGER is not the chart's rendering: run \`make manifests\`"
say "ok: manifests/base and $CERT_MANAGER are the chart's rendering"
