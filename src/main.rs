//! Entry point: parse the command line, set up logging, dispatch.

use anyhow::Context;
use clap::Parser;
use persistent_pod_state::cli::{Cli, Command, LogFormat, Mode, OutputFormat};
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
use persistent_pod_state::hot_code;
use persistent_pod_state::{api, certs, explain, plugin, release, serve, serving, unregister};

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Plain => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// mimalloc, returning freed memory as `persistent_pod_state::alloc` says.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    // One crypto provider for the whole process (ring), before any TLS is set up.
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Installed as `kubectl-pps`, it is a kubectl plugin (`kubectl pps ...`).
    let invoked_as = std::env::args_os()
        .next()
        .map(std::path::PathBuf::from)
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()));
    if invoked_as.as_deref() == Some(plugin::PLUGIN_NAME) {
        let cli = plugin::PluginCli::parse();
        init_logging(LogFormat::Plain);
        return serving::main_runtime(0)?.block_on(plugin::run(cli));
    }
    let cli = Cli::parse();
    // `serve`'s hot code onto a huge page, while the process has one thread (x86-64 only:
    // `link/` lays the code out for it there alone).
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    let hot_code = match &cli.command {
        Command::Serve(args) if args.hot_code_huge_page => Some(hot_code::place()),
        _ => None,
    };
    init_logging(cli.log_format);
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    match hot_code {
        Some(Ok(at)) => {
            tracing::info!(
                at = format!("{at:#x}"),
                "the hot code runs from a 2 MiB page"
            );
            if matches!(&cli.command, Command::Serve(args) if args.hot_code_perf_map) {
                match hot_code::write_perf_map(at) {
                    Ok((path, functions)) => tracing::info!(path = %path.display(), functions,
                        "perf's map of the hot code's page written"),
                    Err(why) => tracing::warn!("no perf map of the hot code's page: {why}"),
                }
            }
        }
        Some(Err(why)) => tracing::warn!("the hot code stays on small pages: {why}"),
        None => {}
    }
    // `serve` runs its controllers below admission's priority (`--background-nice`).
    let nice = match &cli.command {
        Command::Serve(args) => args.background_nice,
        _ => 0,
    };
    serving::main_runtime(nice)?.block_on(run(cli.command))
}

/// Runs a command of the binary (apart from the kubectl plugin).
async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve(args) => serve::run(*args).await,
        Command::Crd(args) => {
            let endpoint = match args.conversion_url {
                Some(url) => api::ConversionEndpoint::Url(url),
                None => api::ConversionEndpoint::Service {
                    namespace: args.conversion_service_namespace,
                    name: args.conversion_service_name,
                },
            };
            let ca = match &args.ca_bundle_file {
                Some(path) => Some(
                    std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
                ),
                None => None,
            };
            print!(
                "{}",
                api::crd_yaml(&endpoint, ca.as_deref(), !args.without_selectable_fields)?
            );
            Ok(())
        }
        Command::Explain(args) => {
            let client = kube::Client::try_default()
                .await
                .context("no Kubernetes client configuration (KUBECONFIG or in-cluster)")?;
            let served = explain::AsServed {
                node_lost_after: args.node_lost_after,
                node_keys: release::NodeKeys::with(&args.node_local_volume_keys),
                observe_all: args.mode == Mode::Observe,
                max_releases_per_minute: args.max_releases_per_minute,
            };
            let e = explain::explain(&client, &args.namespace, &args.pod, &served).await?;
            match args.output {
                OutputFormat::Text => print!("{}", e.text()),
                OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&e)?),
            }
            Ok(())
        }
        Command::Release(args) => {
            let client = kube::Client::try_default()
                .await
                .context("no Kubernetes client configuration (KUBECONFIG or in-cluster)")?;
            let keys = release::NodeKeys::with(&args.node_local_volume_keys);
            let r = release::release_pod(&client, &args.namespace, &args.pod, args.dry_run, &keys)
                .await?;
            match args.output {
                OutputFormat::Text => print!("{}", r.text()),
                OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&r)?),
            }
            Ok(())
        }
        Command::Unregister(args) => {
            let client = kube::Client::try_default()
                .await
                .context("no Kubernetes client configuration (KUBECONFIG or in-cluster)")?;
            let lines =
                unregister::unregister(&client, &args.name, &args.release, &args.release_namespace)
                    .await?;
            for line in lines {
                println!("{line}");
            }
            Ok(())
        }
        Command::Certs(args) => {
            let ca = certs::existing_ca(&args.out_dir)?;
            let what = if ca.is_some() {
                "renewed tls.crt and tls.key under the existing CA"
            } else {
                "wrote a new CA and tls.crt, tls.key"
            };
            let bundle = certs::generate(&args.hosts, ca.as_ref())?;
            certs::write(&bundle, &args.out_dir)?;
            eprintln!("{what} in {}", args.out_dir.display());
            Ok(())
        }
    }
}
