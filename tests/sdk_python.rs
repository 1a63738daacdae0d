//! The official Python SDKs as clients: a rejection raises their own
//! `BadRequestError` with the provider's code/message, and they do not retry
//! (the upstream sees nothing). `scripts/test.sh` installs `openai` and
//! `anthropic` from PyPI.

mod support;

use std::process::Command;

use support::*;

fn python() -> String {
    std::env::var("TIDEMARK_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

#[tokio::test]
async fn sdks_see_rejections_as_their_own_errors_and_do_not_retry() {
    let up = upstream(handler(|_req| http::Response::new(full("{}")))).await;
    let proxy = proxy(
        &up.url(),
        &[
            "--route",
            &format!("/v1/messages={}", up.url()),
            "--context-window",
            "gpt-4o=2000,claude-*=2000",
            "--on-over",
            "reject",
        ],
    )
    .await;
    let base = proxy.url("");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk/reject.py");
    let out = within(120, async move {
        tokio::task::spawn_blocking(move || Command::new(python()).arg(script).arg(base).output())
            .await
            .expect("join")
    })
    .await
    .expect("python3 must be installed (scripts/test.sh installs the SDKs)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("OK"),
        "SDK script failed (run scripts/test.sh to install openai/anthropic):\n{stdout}\n{stderr}"
    );
    assert_eq!(
        up.seen.count(),
        0,
        "a rejected request must never reach the upstream"
    );
}
