//! The compose stack mounts the very files the Prometheus test checked: the
//! scrape config `scripts/check-prometheus.sh` runs through promtool and a
//! real Prometheus, and the Grafana provisioning that loads the dashboard
//! whose every query that script evaluates. No Docker engine runs here, so
//! this (with `docker-compose config -q` in that script) keeps it honest.

use std::path::Path;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// `host:container[:mode]` volume lines of docker-compose.yml, host side relative.
fn mounts() -> Vec<(String, String)> {
    read("docker-compose.yml")
        .lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("- ./"))
        .filter_map(|m| {
            let mut it = m.split(':');
            Some((it.next()?.to_string(), it.next()?.to_string()))
        })
        .collect()
}

#[test]
fn compose_mounts_exist_and_are_the_files_the_prometheus_test_checks() {
    let m = mounts();
    assert!(
        !m.is_empty(),
        "no volume mounts found in docker-compose.yml"
    );
    for (host, _) in &m {
        assert!(
            Path::new(ROOT).join(host).exists(),
            "mounted {host} is missing"
        );
    }
    let script = read("scripts/check-prometheus.sh");
    let prom = m
        .iter()
        .find(|(_, c)| c == "/etc/prometheus/prometheus.yml")
        .expect("prometheus config mounted");
    assert!(
        script.contains(&format!("$ROOT/{}", prom.0)),
        "check-prometheus.sh must test the mounted {}",
        prom.0
    );
    // The scrape config targets the compose services' admin port.
    let cfg = read(&prom.0);
    assert!(
        cfg.contains("tidemark:9787"),
        "scrapes the tidemark service"
    );
    assert!(
        cfg.contains("job_name: tidemark"),
        "the job the script reuses"
    );

    // Grafana: provisioning mounted where Grafana reads it, the datasource is
    // the compose Prometheus, the dashboard provider reads the mounted folder,
    // and that folder holds the dashboard the script evaluates.
    let prov = m
        .iter()
        .find(|(_, c)| c == "/etc/grafana/provisioning")
        .expect("grafana provisioning mounted");
    let ds = read(&format!("{}/datasources/prometheus.yml", prov.0));
    assert!(
        ds.contains("url: http://prometheus:9090"),
        "datasource is the compose Prometheus"
    );
    let dashboards = m
        .iter()
        .find(|(_, c)| c == "/etc/grafana/dashboards")
        .expect("dashboards mounted");
    let provider = read(&format!("{}/dashboards/tidemark.yml", prov.0));
    assert!(provider.contains("path: /etc/grafana/dashboards"));
    let dash = format!("{}/tidemark.json", dashboards.0);
    let json: serde_json::Value = serde_json::from_str(&read(&dash)).expect("dashboard is JSON");
    assert!(json["panels"].as_array().is_some_and(|p| !p.is_empty()));
    assert!(
        script.contains("tidemark.json"),
        "the script evaluates this dashboard"
    );
}

#[test]
fn the_live_sessions_table_reads_the_admin_api_of_the_compose_services() {
    let ds = read("grafana/provisioning/datasources/sessions.yml");
    assert!(ds.contains("uid: sessions"));
    let compose = read("docker-compose.yml");
    assert!(compose.contains("GF_INSTALL_PLUGINS: yesoreyeram-infinity-datasource"));
    let dash: serde_json::Value =
        serde_json::from_str(&read("grafana/dashboards/tidemark.json")).expect("dashboard JSON");
    let panel = dash["panels"]
        .as_array()
        .and_then(|ps| {
            ps.iter().find(|p| {
                p["title"]
                    .as_str()
                    .is_some_and(|t| t.starts_with("Fullest sessions"))
            })
        })
        .expect("a fullest-sessions table");
    for t in panel["targets"].as_array().expect("targets") {
        let url = t["url"].as_str().expect("url");
        assert!(url.ends_with(":9787/sessions?limit=20"), "{url}");
        let host = url.trim_end_matches("/sessions?limit=20");
        assert!(ds.contains(host), "{host} allowed by the datasource");
        assert_eq!(
            t["root_selector"], "sessions",
            "SPEC §6: {{total, sessions:[...]}}"
        );
        for c in t["columns"].as_array().expect("columns") {
            let field = c["selector"].as_str().unwrap_or_default();
            assert!(
                [
                    "key",
                    "api",
                    "model",
                    "state",
                    "utilization",
                    "projection",
                    "last_real",
                    "window",
                    "turns",
                    "anchor_losses",
                    "compactions",
                    "last_seen"
                ]
                .contains(&field),
                "{field} is a SPEC §6 session field"
            );
        }
    }
}

/// The services of docker-compose.yml, each with the text of its block.
fn services() -> Vec<(String, String)> {
    let compose = read("docker-compose.yml");
    let body = compose
        .split("\nservices:\n")
        .nth(1)
        .expect("a services section");
    let mut out: Vec<(String, String)> = Vec::new();
    for line in body.lines() {
        if !line.starts_with(' ') && !line.trim().is_empty() {
            break; // the next top-level key
        }
        match line.strip_prefix("  ").and_then(|l| l.strip_suffix(':')) {
            Some(name) if !name.starts_with([' ', '#']) => {
                out.push((name.to_string(), String::new()))
            }
            _ => {
                if let Some((_, block)) = out.last_mut() {
                    block.push_str(line);
                    block.push('\n');
                }
            }
        }
    }
    out
}

/// SPEC §1: tidemark refuses a non-loopback `--admin-listen` without
/// `--admin-token` (or `--admin-insecure`). Both tidemark services bind
/// their admin listener to 0.0.0.0, so each gets the one token, and both
/// readers of the admin API send it: Prometheus (its scrape job's
/// `credentials_file`, which the compose entrypoint writes beside the
/// mounted config) and Grafana's sessions datasource.
#[test]
fn every_exposed_admin_listener_of_the_stack_has_the_token_its_readers_send() {
    let svcs = services();
    let block = |name: &str| {
        svcs.iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.clone())
            .unwrap_or_else(|| panic!("service {name}"))
    };
    let token_line = "TIDEMARK_ADMIN_TOKEN: *admin-token";
    let mut exposed = 0;
    for (name, b) in &svcs {
        if b.contains("TIDEMARK_ADMIN_LISTEN: 0.0.0.0") {
            exposed += 1;
            assert!(
                b.contains(token_line),
                "{name}: admin listener on 0.0.0.0 without the token"
            );
        }
    }
    assert_eq!(exposed, 2, "tidemark and traffic");
    assert!(
        read("docker-compose.yml").contains("x-admin-token: &admin-token ${TIDEMARK_ADMIN_TOKEN:-")
    );

    let prom = read("deploy/prometheus/prometheus.yml");
    let file = prom
        .lines()
        .find_map(|l| l.trim().strip_prefix("credentials_file:"))
        .map(str::trim)
        .expect("the tidemark job sends a token from a file");
    assert!(!file.starts_with('/'), "read beside the config: {file}");
    let p = block("prometheus");
    assert!(p.contains(token_line));
    assert!(
        p.contains(&format!("> /etc/prometheus/{file} && exec /bin/prometheus")),
        "the entrypoint writes {file} beside /etc/prometheus/prometheus.yml"
    );
    assert!(p.contains("./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml"));

    assert!(block("grafana").contains(token_line));
    let ds = read("grafana/provisioning/datasources/sessions.yml");
    assert!(ds.contains("httpHeaderName1: Authorization"));
    assert!(ds.contains("httpHeaderValue1: Bearer ${TIDEMARK_ADMIN_TOKEN}"));
}
