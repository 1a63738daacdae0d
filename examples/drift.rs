//! Accuracy of tidemark's projection against a provider that counts its own way.
//!
//!     cargo run --release --example drift [-- TURNS] [--tables]
//!
//! Starts the simulated provider with its default, honest counting (each
//! API counted by a public vocabulary the estimator never uses for it, plus
//! hidden per-request, per-message and per-tool framing: `tidemark::sim`)
//! and the real proxy in front of it, then drives two mixed-content agent
//! sessions per API through the proxy (`tests/support/mixed.rs`):
//!
//! - `rotating`: every kind of content (prose, logs, JSON, code, CJK,
//!   base64, emoji, Cyrillic) from the first turns on, on a model the proxy
//!   has never seen: each kind's first turn is projected from a prior;
//! - `one by one`: then, on the same model, logs and JSON first, a large
//!   CJK tool result, base64, emoji-heavy text, another script, then all
//!   mixed: a kind new to the session starts from the model's ratio.
//!
//! For every anchored turn (from turn 2) it compares, with the sim's real
//! count (`x-sim-prompt-tokens` of the same response), chars/4, the raw
//! estimate, the single-ratio projection and the per-class projection, and
//! prints the median and worst absolute error; `--tables` prints every turn.
use tidemark::estimate::Estimator;
use tidemark::sim::{self, SimConfig};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

#[path = "../tests/support/mixed.rs"]
mod mixed;

use mixed::{stats, Row};

fn summary(rows: &[Row]) -> String {
    let anchored: Vec<Row> = rows.iter().filter(|r| r.turn >= 2).cloned().collect();
    let (c4, _) = stats(&anchored, |r| r.chars4);
    let (est, _) = stats(&anchored, |r| r.estimate);
    let (sm, sw) = stats(&anchored, |r| r.single);
    let (pm, pw) = stats(&anchored, |r| r.projection);
    let fresh: Vec<Row> = anchored
        .iter()
        .filter(|r| !r.new_classes.is_empty())
        .cloned()
        .collect();
    let (_, sn) = stats(&fresh, |r| r.single);
    let (_, pn) = stats(&fresh, |r| r.projection);
    format!(
        "| {c4:.1}% | {est:.1}% | {sm:.2}% / {sw:.2}% | **{pm:.2}% / {pw:.2}%** | {sn:.2}% / {pn:.2}% |"
    )
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let turns: usize = args
        .iter()
        .find_map(|a| a.parse().ok())
        .unwrap_or(36)
        .clamp(2, 36);
    let tables = args.iter().any(|a| a == "--tables");

    let sim_l = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let sim_url = format!("http://{}", sim_l.local_addr().map_err(|e| e.to_string())?);
    let (sim_stop, sim_stopped) = oneshot::channel::<()>();
    tokio::spawn(sim::serve(sim_l, SimConfig::default(), async move {
        let _ = sim_stopped.await;
    }));
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let admin = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let proxy = listener.local_addr().map_err(|e| e.to_string())?;
    let route = format!("/v1/messages={sim_url}");
    let config = tidemark::Config::from_args([
        "tidemark",
        "--upstream",
        sim_url.as_str(),
        "--route",
        route.as_str(),
    ])?;
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(tidemark::run(listener, admin, config, async move {
        let _ = stopped.await;
    }));

    let client = mixed::client();
    let estimator = Estimator::new(64 << 20);
    let shadow = mixed::shadow();
    let mut lines = Vec::new();
    let mut result = Ok(());
    'apis: for (api, model) in mixed::APIS {
        for (script, seed) in [(mixed::rotating(7), 7), (mixed::one_by_one(11), 11)] {
            let rows = match mixed::run(
                &client, proxy, &estimator, &shadow, api, model, &script, seed, turns,
            )
            .await
            {
                Ok(rows) => rows,
                Err(e) => {
                    result = Err(format!("{} {}: {e}", api.as_str(), script.name));
                    break 'apis;
                }
            };
            if tables {
                println!(
                    "\n{} ({model}), {}, {turns} turns\n{}",
                    api.as_str(),
                    script.name,
                    mixed::table(&rows)
                );
            }
            lines.push(format!(
                "| {} | {} {}",
                api.as_str(),
                script.name,
                summary(&rows)
            ));
        }
    }
    println!(
        "\n{turns}-turn sessions, absolute error of every anchored turn (from turn 2)\n\n\
         | API | session | chars/4 median | raw estimate median | single ratio median / worst | per-class median / worst | first turn of a new class, worst: single / per-class |\n\
         |---|---|---|---|---|---|---|"
    );
    for l in lines {
        println!("{l}");
    }
    let _ = stop.send(());
    let _ = server.await;
    let _ = sim_stop.send(());
    result
}
