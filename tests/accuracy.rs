//! Issue 33's accuracy check: through the real proxy and the honest
//! simulator (every API counted by a vocabulary the estimator never uses for
//! it, plus hidden framing), 36-turn mixed-content sessions for every API.
//!
//! For each API a first session (`rotating`: every kind of content from its
//! first turns on) meets a model the proxy has never seen; a second
//! (`one by one`: logs and JSON first, then a large CJK tool result,
//! base64, emoji-heavy text, another script, then all mixed) meets it once
//! the model has taught its per-class ratios. The second is held to the
//! issue's bar on every anchored turn, the first turn of each new class
//! included: median |error| <= 0.5%, worst <= 3%. The first, whose new
//! classes can only start from a prior, is held to the median and to 3%
//! on every turn that brings no new class.

use mixed::{err, stats, Row};
use tidemark::estimate::Estimator;
use tidemark::sim::SimConfig;

mod support;
use support::mixed;

const TURNS: usize = 36;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_class_projection_is_within_half_a_percent_on_every_api() {
    let sim = support::sim(SimConfig::default()).await;
    let sim_url = sim.url.clone();
    let route = format!("/v1/messages={sim_url}");
    let px = support::proxy(&sim_url, &["--route", &route]).await;
    let addr = px.addr;

    let client = mixed::client();
    let estimator = Estimator::new(64 << 20);
    let shadow = mixed::shadow();
    let mut report = String::new();
    let mut failures = Vec::new();
    for (api, model) in mixed::APIS {
        for (script, seed) in [(mixed::rotating(7), 7), (mixed::one_by_one(11), 11)] {
            let rows = support::within(
                120,
                mixed::run(
                    &client, addr, &estimator, &shadow, api, model, &script, seed, TURNS,
                ),
            )
            .await
            .unwrap_or_else(|e| panic!("{} {}: {e}", api.as_str(), script.name));
            let name = format!("{} {}", api.as_str(), script.name);
            let anchored: Vec<Row> = rows.iter().filter(|r| r.turn >= 2).cloned().collect();
            assert!(
                anchored.iter().all(|r| r.src == "anchored"),
                "{name}: anchored from turn 2\n{}",
                mixed::table(&rows)
            );
            let (median, worst) = stats(&anchored, |r| r.projection);
            let (single_median, single_worst) = stats(&anchored, |r| r.single);
            let fresh: Vec<&Row> = anchored
                .iter()
                .filter(|r| !r.new_classes.is_empty())
                .collect();
            let known: Vec<Row> = anchored
                .iter()
                .filter(|r| r.new_classes.is_empty())
                .cloned()
                .collect();
            let (_, known_worst) = stats(&known, |r| r.projection);
            report.push_str(&format!(
                "{name}: per-class median {median:.2}% worst {worst:.2}% (turns of known classes {known_worst:.2}%); single ratio {single_median:.2}% / {single_worst:.2}%\n"
            ));
            let warm = script.name == "one by one";
            let ok = median <= 0.5
                && if warm {
                    worst <= 3.0
                } else {
                    known_worst <= 3.0
                };
            if !ok {
                failures.push(format!("{name}\n{}", mixed::table(&rows)));
            }
            if warm {
                // The session is the issue's: each of these classes arrives
                // on a turn of its own, and that turn is among those held.
                let new: Vec<&str> = fresh.iter().flat_map(|r| r.new_classes.clone()).collect();
                for c in ["json", "han", "kana", "hangul", "binary", "emoji", "script"] {
                    assert!(new.contains(&c), "{name}: no turn brings {c}: {new:?}");
                }
                for r in &fresh {
                    assert!(
                        err(r.projection, r.real).abs() <= 3.0,
                        "{name} turn {}: new {:?}",
                        r.turn,
                        r.new_classes
                    );
                }
            }
        }
    }
    eprintln!("{report}");
    assert!(failures.is_empty(), "{report}\n{}", failures.join("\n"));
    px.stop().await;
    drop(sim);
}
