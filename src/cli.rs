//! Command line: `serve`, `crd`, `certs`. Every flag has an environment variable fallback.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Keeps StatefulSet pods on their node, zone and IP across re-creation (PersistentPodState).
#[derive(Debug, Parser)]
#[command(name = "persistent-pod-state", version, about)]
pub struct Cli {
    /// Log line format.
    #[arg(long, env = "PPS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Plain, global = true)]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log line formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Plain,
    /// One JSON object per line.
    Json,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the admission webhook server and the controller in one process.
    Serve(ServeArgs),
    /// Print the PersistentPodState CustomResourceDefinition as YAML.
    Crd,
    /// Write a self-signed CA (ca.crt) and a serving certificate (tls.crt, tls.key).
    Certs(CertsArgs),
}

/// Flags of `serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// HTTPS address of the admission webhooks.
    #[arg(long, env = "PPS_LISTEN", default_value = "0.0.0.0:9443")]
    pub listen: SocketAddr,
    /// PEM serving certificate (re-read when it changes).
    #[arg(long, env = "PPS_TLS_CERT", default_value = "certs/tls.crt")]
    pub tls_cert: PathBuf,
    /// PEM private key of the serving certificate.
    #[arg(long, env = "PPS_TLS_KEY", default_value = "certs/tls.key")]
    pub tls_key: PathBuf,
    /// Plain HTTP address of /healthz, /readyz and /metrics.
    #[arg(long, env = "PPS_PROBE_LISTEN", default_value = "0.0.0.0:8080")]
    pub probe_listen: SocketAddr,
    /// Seconds to keep serving after SIGTERM with readiness failing, before refusing connections.
    #[arg(long, env = "PPS_SHUTDOWN_DELAY_SECONDS", default_value_t = 3)]
    pub shutdown_delay_seconds: u64,
    /// Seconds to let requests in flight finish once no longer accepting.
    #[arg(long, env = "PPS_DRAIN_SECONDS", default_value_t = 20)]
    pub drain_seconds: u64,
}

/// Flags of `certs`.
#[derive(Debug, Args)]
pub struct CertsArgs {
    /// Directory to write ca.crt, tls.crt and tls.key into.
    #[arg(long, env = "PPS_CERTS_OUT_DIR")]
    pub out_dir: PathBuf,
    /// DNS name or IP address the certificate is for (repeatable; comma list in the env var).
    #[arg(
        long = "host",
        env = "PPS_CERTS_HOSTS",
        value_delimiter = ',',
        required = true
    )]
    pub hosts: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn serve_defaults() {
        let cli = Cli::try_parse_from(["persistent-pod-state", "serve"]).expect("parses");
        let Command::Serve(args) = cli.command else {
            panic!("serve expected")
        };
        assert_eq!(args.listen.to_string(), "0.0.0.0:9443");
        assert_eq!(args.probe_listen.to_string(), "0.0.0.0:8080");
        assert_eq!(args.tls_cert, PathBuf::from("certs/tls.crt"));
        assert_eq!(args.tls_key, PathBuf::from("certs/tls.key"));
    }

    #[test]
    fn certs_takes_repeated_hosts() {
        let cli = Cli::try_parse_from([
            "persistent-pod-state",
            "certs",
            "--out-dir",
            "x",
            "--host",
            "a.svc",
            "--host",
            "127.0.0.1",
        ])
        .expect("parses");
        let Command::Certs(args) = cli.command else {
            panic!("certs expected")
        };
        assert_eq!(args.hosts, ["a.svc", "127.0.0.1"]);
    }
}
