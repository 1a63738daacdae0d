//! flags -> Config -> run. The only place `anyhow` is used.

use anyhow::Context;

/// mimalloc (src/alloc.rs): per-request allocations are small and die
/// young, which its per-thread free lists serve without locks;
/// examples/bench uses the same allocator so it measures what ships.
#[global_allocator]
static GLOBAL: alloc::Mimalloc = alloc::Mimalloc;
mod alloc;

use clap::Parser;
use tidemark::config::{Cli, Command, LogFormat};

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TIDEMARK_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a terminal: a log file or a pipe gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => b.json().init(),
        LogFormat::Text => b.init(),
    }
}

/// Resolves on the first SIGINT/SIGTERM; a second one exits at once.
async fn shutdown_signal() {
    wait_signal().await;
    tracing::info!("signal received: stopping (send again to exit at once)");
    tokio::spawn(async {
        wait_signal().await;
        tracing::warn!("second signal: exiting now");
        std::process::exit(130);
    });
}

async fn wait_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match serve().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line, cause chain included: what was wrong and what to do.
            eprintln!("tidemark: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logs(cli.flags.log_format);
    match cli.command {
        Some(Command::Demo {
            turns,
            keep_running,
        }) => {
            let flags = cli.flags.clone();
            tidemark::demo::main(flags, turns, keep_running)
                .await
                .map_err(anyhow::Error::msg)
                .context("demo")?;
            Ok(())
        }
        Some(Command::Sim(args)) => {
            let cfg = tidemark::sim::SimConfig::from_args(&args)
                .map_err(anyhow::Error::msg)
                .context("invalid flags")?;
            let listener = tokio::net::TcpListener::bind(args.listen)
                .await
                .with_context(|| format!("binding --listen {}", args.listen))?;
            tracing::info!(listen = %listener.local_addr()?, "tidemark sim serving");
            tidemark::sim::Simulator::new(cfg)
                .serve(listener, shutdown_signal())
                .await;
            Ok(())
        }
        None => {
            let config = cli
                .flags
                .resolve()
                .map_err(anyhow::Error::msg)
                .context("invalid flags")?;
            let listener = tokio::net::TcpListener::bind(config.listen)
                .await
                .with_context(|| format!("binding --listen {}", config.listen))?;
            let admin = tokio::net::TcpListener::bind(config.admin_listen)
                .await
                .with_context(|| format!("binding --admin-listen {}", config.admin_listen))?;
            tracing::info!(listen = %config.listen, admin = %config.admin_listen, upstream = %format!("{}://{}{}", config.upstream.scheme, config.upstream.authority, config.upstream.prefix), "tidemark serving");
            tidemark::run(listener, admin, config, shutdown_signal()).await?;
            Ok(())
        }
    }
}
