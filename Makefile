# The two commands: `make run` (the main job) and `make test` (every test, e2e included).
.PHONY: run test lint deny unit bench image e2e manifests bench-full

# Pinned: the dependency policy check (installed by `make deny` when missing).
CARGO_DENY_VERSION := 0.20.2

run:
	bash e2e/local.sh

test: lint deny unit bench image e2e

lint:
	cargo fmt --all -- --check
	cargo clippy --locked --all-targets --features e2e,bench -- -D warnings

deny:
	@cargo deny --version 2>/dev/null | grep -qx "cargo-deny $(CARGO_DENY_VERSION)" || \
		cargo install --locked cargo-deny --version $(CARGO_DENY_VERSION)
	cargo deny check licenses bans sources

unit:
	cargo test --locked

# The benchmarks in their short mode: every figure is produced (nothing is asserted about time).
bench:
	bash bench/run.sh --short

# The full benchmark (minutes; see BENCHMARKS.md).
bench-full:
	bash bench/run.sh

image:
	bash e2e/check-image.sh

e2e:
	bash e2e/run.sh

manifests:
	cargo run --locked -q -- crd > manifests/base/crd.yaml
