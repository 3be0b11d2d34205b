# Multi-stage build of persistent-pod-state: a release binary built with the locked
# dependencies, in a minimal image that runs as a non-root user.
FROM rust:1.95-bookworm AS build
WORKDIR /src
# The manifest names every target (benches, e2e tools), so their sources come along.
COPY Cargo.toml Cargo.lock ./
# The build's settings and its linker, which places the hot functions together (link/).
COPY .cargo ./.cargo
COPY link ./link
COPY src ./src
COPY benches ./benches
COPY bench ./bench
COPY e2e ./e2e
RUN cargo build --release --locked --bin persistent-pod-state
# The hot functions' layout is x86-64's alone (.cargo/config.toml names that target): on arm64
# Cargo links as it does by default, and there is no layout to check.
RUN if [ "$(uname -m)" = x86_64 ]; then bash link/check.sh target/release/persistent-pod-state; fi
# The SBOM of the binary's crates (CycloneDX 1.5, no build-time or dev dependencies), shipped
# beside it.
RUN cargo install --locked cargo-cyclonedx --version 0.5.9 && \
    cargo cyclonedx --format json --describe binaries --no-build-deps --spec-version 1.5

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/persistent-pod-state /usr/local/bin/persistent-pod-state
COPY --from=build /src/persistent-pod-state_bin.cdx.json /usr/share/persistent-pod-state/sbom.cdx.json
USER 65532:65532
# 9443: admission webhooks (HTTPS); 8080: /healthz, /readyz, /metrics.
EXPOSE 9443 8080
ENTRYPOINT ["/usr/local/bin/persistent-pod-state"]
CMD ["serve", "--tls-cert", "/tls/tls.crt", "--tls-key", "/tls/tls.key"]
