# The two commands: `make run` (the main job) and `make test` (every test, e2e included).
.PHONY: run test lint deny unit chart bench image e2e e2e-v1.20 e2e-arm64 soak control-plane control-plane-v1.20 manifests bench-full

# Pinned: the dependency policy check (installed by `make deny` when missing).
CARGO_DENY_VERSION := 0.20.2

run:
	bash e2e/local.sh

# Every stage in order, then how long each took (printed also when one fails). The stages in
# BESIDE_E2E run beside the e2e stage, which mostly waits on the control plane's timers, at the
# lowest CPU priority (and the idle I/O class, where the disk's scheduler has one), each in a
# session of its own; their output is printed once the e2e stage is done, and either failing
# fails `make test`. They are stopped when the e2e stage fails or `make test` is interrupted.
# (The image check builds in a target directory of its own, so the e2e suite's release binary
# is never replaced under it.)
STAGES := lint deny unit chart control-plane bench e2e e2e-v1.20
BESIDE_E2E := image control-plane-v1.20
test:
	@times=$$(mktemp); beside_log=$$(mktemp); beside_pid=$$(mktemp); \
	stop_beside() { pid=$$(cat "$$beside_pid" 2>/dev/null); [ -n "$$pid" ] && kill -s TERM -- "-$$pid" 2>/dev/null; : >"$$beside_pid"; }; \
	trap 'stop_beside; echo; echo "make test: seconds per stage"; cat "$$times"; rm -f "$$times" "$$beside_log" "$$beside_pid"' EXIT; \
	trap 'exit 130' INT TERM; \
	low="nice -n 19"; ionice -c 3 true 2>/dev/null && low="$$low ionice -c 3"; \
	for stage in $(STAGES); do \
		if [ "$$stage" = e2e ]; then \
			( for s in $(BESIDE_E2E); do \
				start=$$(date +%s); \
				setsid $$low $(MAKE) --no-print-directory $$s >>"$$beside_log" 2>&1 & echo $$! >"$$beside_pid"; \
				wait $$! || { echo "$$s (beside e2e) FAILED after $$(( $$(date +%s) - start ))" >>"$$times"; exit 1; }; \
				echo "$$s $$(( $$(date +%s) - start )) (beside e2e)" >>"$$times"; \
			done; : >"$$beside_pid" ) & beside=$$!; \
		fi; \
		start=$$(date +%s); \
		passed=true; \
		$(MAKE) --no-print-directory $$stage || passed=false; \
		if $$passed; then echo "$$stage $$(( $$(date +%s) - start ))" >>"$$times"; \
		else echo "$$stage FAILED after $$(( $$(date +%s) - start ))" >>"$$times"; fi; \
		if [ "$$stage" = e2e ]; then \
			$$passed || stop_beside; \
			start=$$(date +%s); wait $$beside || passed=false; \
			echo; echo "make test: the output of the stages beside e2e ($(BESIDE_E2E)):"; cat "$$beside_log"; \
			echo "waiting for them after e2e $$(( $$(date +%s) - start ))" >>"$$times"; \
		fi; \
		$$passed || exit 1; \
	done

lint:
	cargo fmt --all -- --check
	cargo clippy --locked --all-targets --features e2e,bench -- -D warnings

deny:
	@cargo deny --version 2>/dev/null | grep -qx "cargo-deny $(CARGO_DENY_VERSION)" || \
		cargo install --locked cargo-deny --version $(CARGO_DENY_VERSION)
	cargo deny check licenses bans sources

# The unit tests, the benchmark harness's own included (feature `bench`).
unit:
	cargo test --locked --features bench

# The Helm chart: lint and template with every example values file, the schema's refusals, and
# manifests/base and the cert-manager overlay's certificates equal to the chart's rendering (helm
# built at its pinned version).
chart:
	bash charts/check.sh

# The benchmarks in their short mode: every figure is produced (nothing is asserted about time).
bench:
	bash bench/run.sh --short

# The full benchmark (minutes; see BENCHMARKS.md).
bench-full:
	bash bench/run.sh

# The image's build as the Dockerfile makes it, in a target directory of its own (target/image).
image:
	bash e2e/check-image.sh

# The e2e suite on the current control plane (the exact Kubernetes pinned in e2e/control-plane/).
e2e:
	bash e2e/run.sh

# The chaos soak for 30 minutes (the e2e suite runs it for 120 s); SOAK_SEED=N replays a
# schedule, SOAK_SECONDS=N sets the length.
soak:
	SOAK_SECONDS=$${SOAK_SECONDS:-1800} bash e2e/run.sh soak::

# The oldest supported version, v1.20 (Debian's source package): the pre-1.28 registration and
# a smoke subset (the seeds' story, restore after rolling updates, HA takeover, the chart's
# FlowSchema for the Lease in the version 1.20 serves, the pre-1.28 overlays accepted).
E2E_SMOKE := placement::echoserver_from_the_seeds placement::rolling_updates ha::the_other_replica_takes_over ha::lease_requests_go_in_the_leader_election_priority_level manifests::kustomize_overlays api::pps_uniqueness_is_read_live
e2e-v1.20:
	PPS_KUBERNETES=v1.20 bash e2e/run.sh $(E2E_SMOKE)

# linux/arm64 (not in `make test`: it needs Rust's standard library for aarch64, which rustup
# fetches from the Rust project's own server, not a package registry): the image's build
# cross-compiled, the krew plugin of both builds, and the e2e tests below with the arm64 build as
# the webhook replicas, under QEMU's user-mode emulation, on the current control plane: the
# seeds' story, restore after rolling updates, an IP kept through the CNI, conversion, and
# validation. (Not the failover tests: they assert issue 22.4's seconds, which an emulated
# process is not held to.)
E2E_ARM64 := placement::echoserver_from_the_seeds placement::rolling_updates ip::a_pod_re_created_on_another_node api::both_versions_round_trip api::invalid_pps_are_rejected
e2e-arm64: image
	bash e2e/arm64.sh build "$${CARGO_TARGET_DIR:-target}/image/release/persistent-pod-state"
	bash e2e/arm64.sh e2e $(E2E_ARM64)

# Build (or find cached) each control plane and print where it is.
control-plane:
	bash e2e/build-control-plane.sh
control-plane-v1.20:
	bash e2e/build-control-plane.sh v1.20

# The CRD from the Rust types into the chart, then manifests/base and the cert-manager overlay's
# certificates rendered from the chart.
manifests:
	cargo run --locked -q -- crd > charts/persistent-pod-state/files/crd.yaml
	bash charts/check.sh --write
