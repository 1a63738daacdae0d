//! Stream a chat completion through tidemark and print when each chunk
//! arrives: evenly spread offsets mean the proxy forwards as it receives, a
//! single burst at the end would mean buffering.
//!
//!     cargo run --example stream_client -- http://127.0.0.1:8787/v1 [model]
//!
//! Against `tidemark demo --keep-running` (the simulated provider paces its
//! chunks) use the OpenAI base URL it prints. The API key is read from
//! `OPENAI_API_KEY` (any value works with the demo).

use std::io::Write;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let base = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:8787/v1".to_string());
    let model = args.next().unwrap_or_else(|| "gpt-4o".to_string());
    let key = std::env::var("OPENAI_API_KEY").unwrap_or_else(|_| "sk-demo".to_string());
    let url = format!("{}/chat/completions", base.trim_end_matches('/'));
    if url.starts_with("https://") {
        return Err("this example speaks plain http (point it at tidemark)".into());
    }
    let body = serde_json::json!({
        "model": model,
        "stream": true,
        "messages": [{"role": "user", "content": "Write three short sentences about tides."}],
    });
    let req = http::Request::post(&url)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .header("x-session-id", "stream-client-example")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();

    let t0 = Instant::now();
    let resp = client.request(req).await?;
    println!(
        "{:>8.1} ms  HTTP {}",
        t0.elapsed().as_secs_f64() * 1e3,
        resp.status()
    );
    if let Some(p) = resp.headers().get("x-context-projection") {
        println!("            x-context-projection: {}", p.to_str()?);
    }
    let mut body = resp.into_body();
    let (mut chunks, mut bytes) = (0usize, 0usize);
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            chunks += 1;
            bytes += data.len();
            let line = writeln!(
                std::io::stdout(),
                "{:>8.1} ms  chunk {chunks:>3}  {:>5} bytes",
                t0.elapsed().as_secs_f64() * 1e3,
                data.len()
            );
            if line.is_err() {
                return Ok(()); // stdout closed (e.g. piped into head)
            }
        }
    }
    println!(
        "{:>8.1} ms  end: {chunks} chunks, {bytes} bytes",
        t0.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}
