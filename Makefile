# The two commands: `make run` (the main job) and `make test` (every test, e2e included).
.PHONY: run test lint unit bench image e2e manifests

run:
	bash e2e/local.sh

test: lint unit bench image e2e

lint:
	cargo fmt --all -- --check
	cargo clippy --locked --all-targets --features e2e -- -D warnings

unit:
	cargo test --locked

bench:
	cargo bench --locked --bench admission

image:
	bash e2e/check-image.sh

e2e:
	bash e2e/run.sh

manifests:
	cargo run --locked -q -- crd > manifests/base/crd.yaml
