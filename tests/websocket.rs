//! WebSocket through tidemark: the handshake's upgrade headers both ways,
//! every frame kind byte for byte as it arrives direct, a refused handshake
//! as sent, bounded buffers under a slow reader, the idle timeout, graceful
//! shutdown, and the socket gauge.

mod support;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use tidemark::ws::deflate::{Deflater, Inflater};
use tidemark::ws::frame::{close_payload, encode_frame, Opcode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::*;

/// Tests that open sockets share this; the one that reads the socket gauge
/// (process-wide, like every metric) holds it alone.
static SOCKETS: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

type Conn = Pin<Box<dyn Future<Output = ()> + Send>>;
type OnSocket = Arc<dyn Fn(TcpStream, String, Vec<u8>) -> Conn + Send + Sync>;

/// A raw upstream: reads each connection's request head and hands the
/// socket (with the head and any bytes past it) to `on`.
async fn raw_upstream(on: OnSocket) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let on = Arc::clone(&on);
            tokio::spawn(async move {
                let Some((head, rest)) = read_head(&mut s).await else {
                    return;
                };
                on(s, head, rest).await;
            });
        }
    });
    addr
}

/// An HTTP head off `s`: its text, and the bytes read past it.
async fn read_head(s: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = got.split_off(i + 4);
            return Some((String::from_utf8_lossy(&got).into_owned(), rest));
        }
        let n = s.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        got.extend_from_slice(&buf[..n]);
    }
}

/// A header's value in a head's text (first, any case).
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

/// A client's handshake for `path` through `addr`, with extra header lines.
fn handshake(addr: SocketAddr, path: &str, extra: &str) -> String {
    format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
    )
}

/// The upstream's 101 for a request head, agreeing `extensions` if any.
fn switching(head: &str, extensions: Option<&str>) -> String {
    let key = header(head, "sec-websocket-key").unwrap_or("");
    let mut r = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Accept: {}\r\nX-Upstream: yes\r\n",
        tidemark::ws::accept_key(key.as_bytes())
    );
    if let Some(e) = extensions {
        r.push_str(&format!("Sec-WebSocket-Extensions: {e}\r\n"));
    }
    r.push_str("\r\n");
    r
}

/// Connect, send the handshake, read the answer's head.
async fn open(addr: SocketAddr, path: &str, extra: &str) -> (TcpStream, String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(handshake(addr, path, extra).as_bytes())
        .await
        .unwrap();
    let (head, rest) = within(10, read_head(&mut s)).await.expect("an answer");
    (s, head, rest)
}

/// Read exactly `n` bytes (after `already`), or to the close.
async fn read_n(s: &mut TcpStream, mut already: Vec<u8>, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; 64 * 1024];
    while already.len() < n {
        let k = s.read(&mut buf).await.unwrap_or(0);
        if k == 0 {
            break;
        }
        already.extend_from_slice(&buf[..k]);
    }
    already
}

fn frame(fin: bool, rsv1: bool, op: Opcode, mask: Option<[u8; 4]>, p: &[u8]) -> Vec<u8> {
    let mut b = BytesMut::new();
    encode_frame(&mut b, fin, rsv1, op, mask, p);
    b.to_vec()
}

const M: Option<[u8; 4]> = Some([0x12, 0x34, 0x56, 0x78]);

/// One exchange: the client sends `up`, the server sends `down`; each
/// side's received bytes (after the handshake) come back, and whether each
/// saw the other's close when `close` is set (the server shuts its side
/// once it has read `up`, the client after it read `down`).
struct Case {
    offer: &'static str,
    agree: Option<&'static str>,
    up: Vec<u8>,
    down: Vec<u8>,
    close: bool,
}

#[derive(Debug, PartialEq)]
struct Seen {
    client_got: Vec<u8>,
    server_got: Vec<u8>,
    server_head: String,
    client_head: String,
    closed_both: bool,
}

async fn run_case(case: &Case, through: Option<&str>) -> Seen {
    let server_got = Arc::new(Mutex::new((Vec::new(), String::new(), false)));
    let (down, n_up, agree, close) = (case.down.clone(), case.up.len(), case.agree, case.close);
    let sg = Arc::clone(&server_got);
    let up_addr = raw_upstream(Arc::new(move |mut s, head, rest| {
        let (down, sg) = (down.clone(), Arc::clone(&sg));
        Box::pin(async move {
            s.write_all(switching(&head, agree).as_bytes())
                .await
                .unwrap();
            s.write_all(&down).await.unwrap();
            let got = read_n(&mut s, rest, n_up).await;
            let mut eof = false;
            if close {
                let _ = s.shutdown().await;
                eof = s.read(&mut [0u8; 16]).await.unwrap_or(0) == 0;
            }
            *sg.lock().unwrap() = (got, head, eof);
        })
    }))
    .await;
    let proxy = match through {
        Some(_) => Some(proxy(&format!("http://{up_addr}"), &[]).await),
        None => None,
    };
    let addr = proxy.as_ref().map_or(up_addr, |p| p.addr);
    let path = through.unwrap_or("/ws");
    let (mut s, client_head, rest) = open(addr, path, case.offer).await;
    s.write_all(&case.up).await.unwrap();
    let client_got = within(10, read_n(&mut s, rest, case.down.len())).await;
    let mut client_eof = false;
    if case.close {
        client_eof = within(10, s.read(&mut [0u8; 16])).await.unwrap_or(0) == 0;
        let _ = s.shutdown().await;
    }
    // The server's record is complete once it has read all it expects.
    let (server_got, server_head, server_eof) = within(10, async {
        loop {
            {
                let g = server_got.lock().unwrap();
                if !g.1.is_empty() {
                    break g.clone();
                }
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    drop(s);
    if let Some(p) = proxy {
        p.stop().await;
    }
    Seen {
        client_got,
        server_got,
        server_head,
        client_head,
        closed_both: !case.close || (client_eof && server_eof),
    }
}

/// Each side receives through tidemark exactly the bytes it receives
/// direct, and the handshake's upgrade headers reach each side.
async fn same_as_direct(case: Case) {
    let direct = run_case(&case, None).await;
    let proxied = run_case(&case, Some("/ws")).await;
    assert_eq!(proxied.client_got, direct.client_got);
    assert_eq!(proxied.server_got, direct.server_got);
    assert_eq!(proxied.client_got, case.down);
    assert_eq!(proxied.server_got, case.up);
    assert!(proxied.closed_both && direct.closed_both);
    for name in [
        "upgrade",
        "connection",
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
    ] {
        assert_eq!(
            header(&proxied.server_head, name),
            header(&direct.server_head, name),
            "{name} upstream"
        );
    }
    for name in [
        "upgrade",
        "connection",
        "sec-websocket-accept",
        "sec-websocket-extensions",
        "x-upstream",
    ] {
        assert_eq!(
            header(&proxied.client_head, name),
            header(&direct.client_head, name),
            "{name} to the client"
        );
    }
    assert!(proxied.client_head.starts_with("HTTP/1.1 101"));
}

fn plain(up: Vec<u8>, down: Vec<u8>) -> Case {
    Case {
        offer: "",
        agree: None,
        up,
        down,
        close: false,
    }
}

#[tokio::test]
async fn text_frames_pass_as_direct() {
    let _sockets = SOCKETS.read().await;
    same_as_direct(plain(
        frame(true, false, Opcode::Text, M, br#"{"type":"hello"}"#),
        frame(
            true,
            false,
            Opcode::Text,
            None,
            "h\u{e9}llo \u{1f30a}".as_bytes(),
        ),
    ))
    .await;
}

#[tokio::test]
async fn binary_frames_pass_as_direct() {
    let _sockets = SOCKETS.read().await;
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    same_as_direct(plain(
        frame(true, false, Opcode::Binary, M, &big),
        frame(true, false, Opcode::Binary, None, &big[..70_000]),
    ))
    .await;
}

#[tokio::test]
async fn fragmented_messages_with_a_ping_between_pass_as_direct() {
    let _sockets = SOCKETS.read().await;
    let mut up = frame(false, false, Opcode::Text, M, b"{\"a\":");
    up.extend(frame(true, false, Opcode::Ping, M, b"mid"));
    up.extend(frame(false, false, Opcode::Continuation, M, b"1,"));
    up.extend(frame(true, false, Opcode::Continuation, M, b"\"b\":2}"));
    let mut down = frame(false, false, Opcode::Binary, None, &[1, 2, 3]);
    down.extend(frame(true, false, Opcode::Continuation, None, &[4, 5]));
    same_as_direct(plain(up, down)).await;
}

#[tokio::test]
async fn ping_and_pong_pass_as_direct() {
    let _sockets = SOCKETS.read().await;
    let mut up = frame(true, false, Opcode::Ping, M, b"are you there");
    up.extend(frame(true, false, Opcode::Pong, M, b"unsolicited"));
    let mut down = frame(true, false, Opcode::Pong, None, b"are you there");
    down.extend(frame(true, false, Opcode::Ping, None, b""));
    same_as_direct(plain(up, down)).await;
}

#[tokio::test]
async fn close_frames_and_the_close_pass_as_direct() {
    let _sockets = SOCKETS.read().await;
    same_as_direct(Case {
        close: true,
        ..plain(
            frame(true, false, Opcode::Close, M, &close_payload(1000, "done")),
            frame(
                true,
                false,
                Opcode::Close,
                None,
                &close_payload(1000, "done"),
            ),
        )
    })
    .await;
}

/// permessage-deflate agreed between the two ends, with context takeover
/// both ways: compressed frames (RSV1) pass untouched, and each side
/// inflates what it got.
#[tokio::test]
async fn compressed_messages_pass_as_direct() {
    let _sockets = SOCKETS.read().await;
    let msgs: [&[u8]; 3] = [
        br#"{"type":"response.create","input":"the same words the same words"}"#,
        br#"{"type":"response.create","input":"the same words the same words"}"#,
        b"short",
    ];
    let (mut cd, mut sd) = (Deflater::new(false), Deflater::new(false));
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for m in msgs {
        up.extend(frame(true, true, Opcode::Text, M, &cd.compress(m)));
        down.extend(frame(true, true, Opcode::Text, None, &sd.compress(m)));
    }
    let case = Case {
        offer: "Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\n",
        agree: Some("permessage-deflate"),
        up,
        down,
        close: false,
    };
    let seen = run_case(&case, Some("/ws")).await;
    // The bytes came through as compressed as they left, and inflate.
    let mut r = tidemark::ws::frame::MessageReader::new(1 << 20, Some(Inflater::new(false)));
    let mut at = 0;
    let mut got = Vec::new();
    while at < seen.client_got.len() {
        let (n, ev) = r.feed(&seen.client_got[at..]).unwrap();
        at += n;
        if let Some(tidemark::ws::frame::Event::Message {
            compressed: true,
            payload,
            ..
        }) = ev
        {
            got.push(payload.to_vec());
        }
    }
    assert_eq!(got, msgs.map(<[u8]>::to_vec));
    // On the Responses path, where tidemark reads every event (no policy
    // acting), the bytes are the same too.
    let direct = run_case(&case, None).await;
    let responses = run_case(&case, Some("/v1/responses")).await;
    assert_eq!(responses.server_got, direct.server_got);
    assert_eq!(responses.client_got, direct.client_got);
    same_as_direct(case).await;
}

/// A real client and server (tungstenite) talk through tidemark.
#[tokio::test]
async fn a_real_client_and_server_talk_through() {
    let _sockets = SOCKETS.read().await;
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up_addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        let mut ws = tokio_tungstenite::accept_async(s).await.unwrap();
        while let Some(Ok(m)) = ws.next().await {
            if m.is_text() || m.is_binary() {
                ws.send(m).await.unwrap();
            }
        }
    });
    let proxy = proxy(&format!("http://{up_addr}"), &[]).await;
    let s = TcpStream::connect(proxy.addr).await.unwrap();
    let (mut ws, resp) = within(
        10,
        tokio_tungstenite::client_async(format!("ws://{}/v1/echo", proxy.addr), s),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 101);
    ws.send(Message::text("hi")).await.unwrap();
    assert_eq!(
        within(10, ws.next()).await.unwrap().unwrap(),
        Message::text("hi")
    );
    let blob: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
    ws.send(Message::binary(blob.clone())).await.unwrap();
    assert_eq!(
        within(10, ws.next()).await.unwrap().unwrap(),
        Message::binary(blob)
    );
    ws.close(None).await.unwrap();
    drop(ws);
    proxy.stop().await;
}

/// A handshake the upstream refuses (having seen it whole, upgrade
/// headers included) comes back as it sent it.
#[tokio::test]
async fn a_refused_handshake_comes_back_as_sent() {
    let _sockets = SOCKETS.read().await;
    for (status, reason) in [(426, "Upgrade Required"), (400, "Bad Request")] {
        let heads = Arc::new(Mutex::new(Vec::new()));
        let h2 = Arc::clone(&heads);
        let up = raw_upstream(Arc::new(move |mut s, head, _| {
            h2.lock().unwrap().push(head);
            Box::pin(async move {
                let body = format!("{{\"error\":\"refused with {status}\"}}");
                let _ = s
                    .write_all(
                        format!(
                            "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n\
                             x-refusal: 1\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
            })
        }))
        .await;
        let proxy = proxy(&format!("http://{up}"), &[]).await;
        let (mut s, head, rest) = open(proxy.addr, "/v1/responses", "").await;
        assert!(head.starts_with(&format!("HTTP/1.1 {status}")), "{head}");
        assert_eq!(header(&head, "x-refusal"), Some("1"));
        let want = format!("{{\"error\":\"refused with {status}\"}}");
        let body = within(10, read_n(&mut s, rest, want.len())).await;
        assert_eq!(String::from_utf8(body).unwrap(), want);
        let seen = heads
            .lock()
            .unwrap()
            .pop()
            .expect("the upstream saw the handshake");
        assert_eq!(header(&seen, "upgrade"), Some("websocket"));
        assert_eq!(header(&seen, "connection"), Some("Upgrade"));
        assert_eq!(header(&seen, "sec-websocket-key"), Some(KEY));
        drop(s);
        proxy.stop().await;
    }
}

/// No upstream to connect to: a 502 in the API's shape, before any 101,
/// counted as a Responses request.
#[tokio::test]
async fn an_unreachable_upstream_is_a_502() {
    let _sockets = SOCKETS.read().await;
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    let proxy = proxy(&format!("http://{addr}"), &[]).await;
    let before = responses_502(&proxy).await;
    let (s, head, rest) = open(proxy.addr, "/v1/responses", "").await;
    assert!(head.starts_with("HTTP/1.1 502"), "{head}");
    assert_eq!(header(&head, "x-tidemark-error"), Some("upstream-connect"));
    let n: usize = header(&head, "content-length").unwrap().parse().unwrap();
    let body = within(10, read_n(&mut { s }, rest, n)).await;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "upstream_connect", "{v}");
    assert_eq!(responses_502(&proxy).await, before + 1.0);
    proxy.stop().await;
}

async fn gauge(p: &Proxy, api: &str) -> Option<f64> {
    let (_, body) = get(&client_h1(), &p.admin_url("/metrics")).await;
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(&format!("tidemark_websockets{{api=\"{api}\"}}")))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

async fn responses_502(p: &Proxy) -> f64 {
    let (_, body) = get(&client_h1(), &p.admin_url("/metrics")).await;
    String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| {
            l.starts_with("tidemark_requests_total{")
                && l.contains("api=\"openai-responses\"")
                && l.contains("code=\"502\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn counted_101(p: &Proxy) -> f64 {
    let (_, body) = get(&client_h1(), &p.admin_url("/metrics")).await;
    String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| l.starts_with("tidemark_requests_total{") && l.contains("code=\"101\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// An upstream that echoes every byte after a 101.
async fn echo_upstream() -> SocketAddr {
    raw_upstream(Arc::new(|mut s, head, rest| {
        Box::pin(async move {
            s.write_all(switching(&head, None).as_bytes())
                .await
                .unwrap();
            s.write_all(&rest).await.unwrap();
            let (mut r, mut w) = s.into_split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
        })
    }))
    .await
}

/// Silence both ways for `--idle-timeout` closes both ends; bytes within
/// it keep the socket open. The gauge counts the socket while it is open
/// and both of its values exist from start-up.
#[tokio::test]
async fn silence_past_the_idle_timeout_closes_both_ends() {
    let _sockets = SOCKETS.write().await;
    let up = echo_upstream().await;
    let proxy = proxy(&format!("http://{up}"), &["--idle-timeout", "400ms"]).await;
    assert_eq!(gauge(&proxy, "none").await, Some(0.0));
    assert_eq!(gauge(&proxy, "openai-responses").await, Some(0.0));
    let (mut s, head, _) = open(proxy.addr, "/ws", "").await;
    assert!(head.starts_with("HTTP/1.1 101"));
    // Talking every 100 ms for a second: still open.
    let ping = frame(true, false, Opcode::Ping, M, b"x");
    for _ in 0..10 {
        s.write_all(&ping).await.unwrap();
        let got = within(10, read_n(&mut s, Vec::new(), ping.len())).await;
        assert_eq!(got, ping);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(gauge(&proxy, "none").await, Some(1.0));
    assert!(counted_101(&proxy).await >= 1.0);
    // Then silence: tidemark closes.
    let n = within(10, s.read(&mut [0u8; 16])).await.unwrap_or(0);
    assert_eq!(n, 0, "closed by the idle timeout");
    within(10, async {
        while gauge(&proxy, "none").await != Some(0.0) {
            tokio::task::yield_now().await;
        }
    })
    .await;
    proxy.stop().await;
}

/// The upstream floods, the client does not read: the upstream is backed
/// up by TCP, tidemark does not take the flood into memory.
#[tokio::test]
async fn a_slow_reader_backs_the_writer_up() {
    // Alone: the RSS measured is the whole test process's.
    let _sockets = SOCKETS.write().await;
    const FLOOD: u64 = 512 << 20;
    let written = Arc::new(AtomicU64::new(0));
    let w2 = Arc::clone(&written);
    let up = raw_upstream(Arc::new(move |mut s, head, _| {
        let written = Arc::clone(&w2);
        Box::pin(async move {
            s.write_all(switching(&head, None).as_bytes())
                .await
                .unwrap();
            // One 1 MiB binary frame after another, as fast as they go.
            let chunk = frame(true, false, Opcode::Binary, None, &vec![7u8; 1 << 20]);
            while written.load(Ordering::Relaxed) < FLOOD {
                if s.write_all(&chunk).await.is_err() {
                    return;
                }
                written.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
        })
    }))
    .await;
    let proxy = proxy(&format!("http://{up}"), &[]).await;
    let rss_before = rss_kib();
    let (mut s, head, rest) = open(proxy.addr, "/ws", "").await;
    assert!(head.starts_with("HTTP/1.1 101"));
    // Wait (bounded) until the upstream's writes stall.
    let stalled = within(60, async {
        let mut last = 0;
        let mut same = 0;
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = written.load(Ordering::Relaxed);
            if now == last {
                same += 1;
                if same == 10 {
                    break now;
                }
            } else {
                same = 0;
                last = now;
            }
        }
    })
    .await;
    let grown = rss_kib().saturating_sub(rss_before);
    eprintln!("the upstream stalled after {stalled} bytes; RSS grew {grown} KiB");
    // Kernel socket buffers on loopback (two connections, a few MiB each)
    // plus tidemark's own bounded queues: far below the flood.
    assert!(
        stalled < 48 << 20,
        "the upstream wrote {stalled} bytes with nobody reading"
    );
    assert!(grown < 64 * 1024, "RSS grew by {grown} KiB");
    // And the bytes are all there, in order, when the client reads.
    let got = within(30, read_n(&mut s, rest, 3 << 20)).await;
    let first = frame(true, false, Opcode::Binary, None, &vec![7u8; 1 << 20]);
    assert_eq!(&got[..first.len()], &first[..]);
    drop(s);
    proxy.stop().await;
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// On shutdown an open socket keeps working for `--shutdown-grace`, then
/// is closed.
#[tokio::test]
async fn shutdown_gives_open_sockets_the_grace_period() {
    let _sockets = SOCKETS.read().await;
    let up = echo_upstream().await;
    let proxy = proxy(&format!("http://{up}"), &["--shutdown-grace", "1s"]).await;
    let (mut s, head, _) = open(proxy.addr, "/ws", "").await;
    assert!(head.starts_with("HTTP/1.1 101"));
    let stopping = tokio::spawn(proxy.stop());
    // Shutdown has begun (the listener is closed) ...
    within(10, async {
        while TcpStream::connect(s.peer_addr().unwrap()).await.is_ok() {
            tokio::task::yield_now().await;
        }
    })
    .await;
    // ... and the socket still carries messages.
    let msg = frame(true, false, Opcode::Text, M, b"still here");
    s.write_all(&msg).await.unwrap();
    assert_eq!(within(10, read_n(&mut s, Vec::new(), msg.len())).await, msg);
    // After the grace period it is closed.
    within(30, stopping).await.unwrap();
    assert_eq!(within(10, s.read(&mut [0u8; 16])).await.unwrap_or(0), 0);
}

// ---------------------------------------------------------------------------
// The Responses API's WebSocket mode
// ---------------------------------------------------------------------------

use serde_json::{json, Value};

/// What the scripted Responses upstream received.
type Received = Arc<Mutex<Vec<Value>>>;

/// A scripted Responses WebSocket upstream (tungstenite): each
/// `response.create` is answered with `response.created`, a text delta and
/// `response.completed` carrying usage, echoing its `stream_id`. The
/// prompt it reports is the continued response's prompt and output plus a
/// third of the new input's bytes, so chained turns grow like a real
/// conversation. `hold`: answer creates in pairs, the second first (two
/// streams whose responses finish out of order).
async fn responses_upstream(received: Received, hold: bool) -> SocketAddr {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let received = Arc::clone(&received);
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(s).await else {
                    return;
                };
                let mut prompts: std::collections::HashMap<String, u64> = Default::default();
                let mut n = 0;
                let mut waiting: Vec<Vec<Value>> = Vec::new();
                while let Some(Ok(m)) = ws.next().await {
                    let Message::Text(t) = m else { continue };
                    let v: Value = serde_json::from_str(&t).unwrap_or(Value::Null);
                    received.lock().unwrap().push(v.clone());
                    if v["type"] != "response.create" {
                        continue;
                    }
                    n += 1;
                    let id = format!("resp_{n}");
                    let before = v["previous_response_id"]
                        .as_str()
                        .and_then(|p| prompts.get(p).copied())
                        .unwrap_or(0);
                    let real = before + v["input"].to_string().len() as u64 / 3 + 40;
                    prompts.insert(id.clone(), real + 7);
                    let stream = v.get("stream_id").cloned();
                    let with_stream = |mut e: Value| {
                        if let Some(s) = &stream {
                            e["stream_id"] = s.clone();
                        }
                        e
                    };
                    let events = vec![
                        with_stream(json!({"type": "response.created",
                            "response": {"id": id, "status": "in_progress", "usage": null}})),
                        with_stream(json!({"type": "response.output_text.delta", "delta": "ok"})),
                        with_stream(json!({"type": "response.completed", "response": {
                            "id": id, "status": "completed",
                            "usage": {"input_tokens": real, "output_tokens": 7,
                                      "input_tokens_details": {"cached_tokens": 0}}}})),
                    ];
                    waiting.push(events);
                    if hold && waiting.len() < 2 {
                        continue;
                    }
                    for events in waiting.drain(..).rev() {
                        for e in events {
                            let _ = ws.send(Message::text(e.to_string())).await;
                        }
                    }
                }
            });
        }
    });
    addr
}

type Client = tokio_tungstenite::WebSocketStream<TcpStream>;

/// A tungstenite client's socket to `/v1/responses` through `proxy`, with
/// extra handshake headers.
async fn responses_client(proxy: &Proxy, headers: &[(&str, &str)]) -> Client {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut req = format!("ws://{}/v1/responses", proxy.addr)
        .into_client_request()
        .unwrap();
    for (k, v) in headers {
        req.headers_mut().insert(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    let s = TcpStream::connect(proxy.addr).await.unwrap();
    within(10, tokio_tungstenite::client_async(req, s))
        .await
        .unwrap()
        .0
}

/// Send an event; read events until one of the given types (the last
/// event read comes back).
async fn turn(ws: &mut Client, event: Value, until: &[&str]) -> Vec<Value> {
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::Message;
    ws.send(Message::text(event.to_string())).await.unwrap();
    read_until(ws, until).await
}

async fn read_until(ws: &mut Client, until: &[&str]) -> Vec<Value> {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    let mut got = Vec::new();
    loop {
        let m = within(10, ws.next())
            .await
            .expect("open")
            .expect("a message");
        if let Message::Text(t) = m {
            let v: Value = serde_json::from_str(&t).unwrap();
            let done = until.iter().any(|u| v["type"] == *u);
            got.push(v);
            if done {
                return got;
            }
        }
    }
}

fn user(text: &str) -> Value {
    json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
}

async fn session(proxy: &Proxy, key: &str) -> Value {
    let (parts, body) = get(&client_h1(), &proxy.admin_url(&format!("/sessions/{key}"))).await;
    assert_eq!(parts.status, 200, "{}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).unwrap()
}

/// Three turns over one socket, each sending only its new input with
/// `previous_response_id` as Codex does: the session anchors on each
/// `response.completed`, and `/sessions` and the metrics show it.
#[tokio::test]
async fn turns_over_one_socket_anchor_the_session() {
    let _sockets = SOCKETS.read().await;
    let received = Received::default();
    let up = responses_upstream(Arc::clone(&received), false).await;
    let proxy = proxy(&format!("http://{up}"), &[]).await;
    let mut ws = responses_client(
        &proxy,
        &[
            ("authorization", "Bearer sk-ws"),
            ("x-session-id", "ws-anchor"),
        ],
    )
    .await;
    let mut previous: Option<String> = None;
    let mut reals = Vec::new();
    for t in 0..3 {
        let mut event = json!({"type": "response.create", "model": "gpt-4o",
            "instructions": "You are terse.",
            "input": [user(&format!("turn {t}: {}", "words ".repeat(50 * (t + 1))))]});
        if let Some(p) = &previous {
            event["previous_response_id"] = json!(p);
        }
        let got = turn(&mut ws, event, &["response.completed"]).await;
        let done = got.last().unwrap();
        previous = done["response"]["id"].as_str().map(str::to_string);
        reals.push(done["response"]["usage"]["input_tokens"].as_u64().unwrap());
        // The session has heard this turn's end once the client has it.
        within(10, async {
            while session(&proxy, "ws-anchor").await["turns"] != json!(t + 1) {
                tokio::task::yield_now().await;
            }
        })
        .await;
        let s = session(&proxy, "ws-anchor").await;
        assert_eq!(s["anchor"]["real"], json!(reals[t]), "{s}");
        assert_eq!(s["state"], "anchored");
        assert_eq!(s["api"], "openai-responses");
    }
    // The events reached the upstream as the client sent them.
    let sent = received.lock().unwrap().clone();
    assert_eq!(sent.len(), 3);
    assert_eq!(sent[2]["previous_response_id"], "resp_2");
    // The last projection was anchored on the second turn's real count:
    // within the new input's estimate of it.
    let s = session(&proxy, "ws-anchor").await;
    let projection = s["projection"].as_u64().unwrap();
    assert!(
        projection > reals[1] && projection < reals[2] * 2,
        "projection {projection}, reals {reals:?}"
    );
    let (_, m) = get(&client_h1(), &proxy.admin_url("/metrics")).await;
    let m = String::from_utf8_lossy(&m);
    let real_total = m
        .lines()
        .find(|l| {
            l.starts_with("tidemark_prompt_tokens_real_total{")
                && l.contains("api=\"openai-responses\"")
                && l.contains("model=\"gpt-4o\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(real_total >= reals.iter().sum::<u64>(), "{real_total}");
    drop(ws);
    proxy.stop().await;
}

/// `--on-over reject`: an event over the line is answered with the API's
/// own `error` event and never reaches the upstream; the socket carries
/// the next event as before.
#[tokio::test]
async fn reject_answers_with_an_error_event_and_the_socket_stays_usable() {
    let _sockets = SOCKETS.read().await;
    let received = Received::default();
    let up = responses_upstream(Arc::clone(&received), false).await;
    let proxy = proxy(
        &format!("http://{up}"),
        &["--on-over", "reject", "--context-window", "ws-small=2000"],
    )
    .await;
    let mut ws = responses_client(&proxy, &[("x-session-id", "ws-reject")]).await;
    let small = json!({"type": "response.create", "model": "ws-small", "input": [user("hello")]});
    let got = turn(&mut ws, small.clone(), &["response.completed"]).await;
    assert_eq!(got.last().unwrap()["type"], "response.completed");
    let big = json!({"type": "response.create", "model": "ws-small",
        "input": [user(&"many words here ".repeat(2000))]});
    let got = turn(&mut ws, big, &["error", "response.completed"]).await;
    assert_eq!(got.len(), 1, "{got:?}");
    let e = &got[0];
    assert_eq!(e["type"], "error", "{e}");
    assert_eq!(e["status"], 400);
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    assert_eq!(e["error"]["type"], "invalid_request_error");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("This model's maximum context length is 2000 tokens. However, your messages resulted in "),
        "{msg}"
    );
    // The socket stays open and usable.
    let got = turn(&mut ws, small, &["response.completed"]).await;
    assert_eq!(got.last().unwrap()["type"], "response.completed");
    let sent = received.lock().unwrap().clone();
    assert_eq!(sent.len(), 2, "the rejected event never left: {sent:?}");
    drop(ws);
    proxy.stop().await;
}

/// `--on-over trim`: a long history over the line reaches the upstream as
/// a smaller `response.create` (newest message kept), and the answer
/// comes back.
#[tokio::test]
async fn trim_forwards_a_smaller_event() {
    use tidemark::provider::Api;
    let _sockets = SOCKETS.read().await;
    let received = Received::default();
    let up = responses_upstream(Arc::clone(&received), false).await;
    let proxy = proxy(
        &format!("http://{up}"),
        &["--on-over", "trim", "--context-window", "gpt-5=6000"],
    )
    .await;
    let mut ws = responses_client(&proxy, &[("x-session-id", "ws-trim")]).await;
    let script = support::trim::agent_script(12, 2, 600);
    let mut event: Value =
        serde_json::from_slice(&support::trim::render(Api::OpenAiResponses, &script, false))
            .unwrap();
    event.as_object_mut().unwrap().remove("stream");
    event["type"] = json!("response.create");
    let items = event["input"].as_array().unwrap().len();
    let got = turn(&mut ws, event.clone(), &["response.completed", "error"]).await;
    assert_eq!(got.last().unwrap()["type"], "response.completed", "{got:?}");
    let sent = received.lock().unwrap().clone();
    assert_eq!(sent.len(), 1);
    let fwd = &sent[0];
    assert_eq!(fwd["type"], "response.create");
    let kept = fwd["input"].as_array().unwrap();
    assert!(kept.len() < items, "{} of {items} items kept", kept.len());
    assert_eq!(kept.last(), event["input"].as_array().unwrap().last());
    assert_eq!(fwd["instructions"], event["instructions"]);
    drop(ws);
    proxy.stop().await;
}

/// A client that drops the connection as soon as its answer is complete
/// (Codex does, without a close frame), while the turn's long, never-seen
/// history is still being estimated: the turn is still recorded, anchored
/// on the usage its response carried.
#[tokio::test]
async fn a_turn_still_being_estimated_when_the_client_drops_is_recorded() {
    let _sockets = SOCKETS.read().await;
    let received = Received::default();
    let up = responses_upstream(Arc::clone(&received), false).await;
    let proxy = proxy(&format!("http://{up}"), &[]).await;
    let mut ws = responses_client(&proxy, &[("x-session-id", "ws-dropped")]).await;
    // Words no other test tokenizes, so nothing of it is cached.
    let history: String = (0..400_000u64)
        .map(|i| format!("w{:x} ", i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40))
        .collect();
    let event = json!({"type": "response.create", "model": "gpt-4o", "input": [user(&history)]});
    let got = turn(&mut ws, event, &["response.completed"]).await;
    let real = got.last().unwrap()["response"]["usage"]["input_tokens"]
        .as_u64()
        .unwrap();
    drop(ws);
    within(30, async {
        loop {
            let (parts, body) = get(&client_h1(), &proxy.admin_url("/sessions/ws-dropped")).await;
            if parts.status == 200 {
                let s: Value = serde_json::from_slice(&body).unwrap();
                if s["turns"] == 1 {
                    assert_eq!(s["anchor"]["real"], json!(real), "{s}");
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    proxy.stop().await;
}

/// Codex's warm-up (`generate: false`, empty input) opens every socket and
/// its real turn continues it: a warm-up is no turn. Two processes' worth
/// (exec, then resume on a new socket with the whole history) are one
/// session of two turns, no compaction, the second anchored on the first.
#[tokio::test]
async fn a_warmup_is_neither_a_turn_nor_a_compaction() {
    let _sockets = SOCKETS.read().await;
    let received = Received::default();
    let up = responses_upstream(Arc::clone(&received), false).await;
    let proxy = proxy(&format!("http://{up}"), &[]).await;
    let developer = json!({"type": "message", "role": "developer",
        "content": [{"type": "input_text", "text": "You are a coding agent. ".repeat(200)}]});
    let mut history = vec![
        developer,
        user("<environment_context>cwd</environment_context>"),
    ];
    let mut reals = Vec::new();
    for prompt in ["say hi", "again"] {
        let mut ws = responses_client(&proxy, &[("session-id", "ws-warmup")]).await;
        let warm = json!({"type": "response.create", "model": "gpt-4o", "generate": false,
            "input": []});
        let got = turn(&mut ws, warm, &["response.completed"]).await;
        let warm_id = got.last().unwrap()["response"]["id"].clone();
        history.push(user(prompt));
        let event = json!({"type": "response.create", "model": "gpt-4o",
            "previous_response_id": warm_id, "input": history});
        let got = turn(&mut ws, event, &["response.completed"]).await;
        let done = got.last().unwrap();
        reals.push(done["response"]["usage"]["input_tokens"].as_u64().unwrap());
        history.push(json!({"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "ok"}]}));
        drop(ws);
        let want = reals.len();
        within(10, async {
            while session(&proxy, "ws-warmup").await["anchor"]["real"] != json!(reals[want - 1]) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
    }
    let s = session(&proxy, "ws-warmup").await;
    assert_eq!(s["turns"], 2, "{s}");
    assert_eq!(s["compactions"], 0, "{s}");
    assert_eq!(s["lanes"].as_array().unwrap().len(), 1, "{s}");
    assert_eq!(s["state"], "anchored");
    // The resumed turn was projected from the first turn's real count.
    let projection = s["projection"].as_u64().unwrap();
    assert!(
        projection > reals[0] && projection < reals[1] * 2,
        "projection {projection}, reals {reals:?}"
    );
    proxy.stop().await;
}

/// Two streams on one socket (the multi-stream beta), whose responses
/// finish in the other order: each turn is recorded with its own
/// stream's usage, so each conversation's session is anchored on its own
/// real count. TODO(lanes): with the sessions helper's lanes, the two
/// streams become two lanes of one session.
#[tokio::test]
async fn two_streams_on_one_socket_keep_their_own_turns() {
    let _sockets = SOCKETS.read().await;
    let received = Received::default();
    let up = responses_upstream(Arc::clone(&received), true).await;
    let proxy = proxy(&format!("http://{up}"), &[]).await;
    let mut ws = responses_client(&proxy, &[("authorization", "Bearer sk-two")]).await;
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::Message;
    let long = json!({"type": "response.create", "model": "gpt-4o", "stream_id": "main",
        "input": [user(&format!("main loop {}", "context ".repeat(3000)))]});
    let short = json!({"type": "response.create", "model": "gpt-4o-mini", "stream_id": "title",
        "input": [user("title this")]});
    ws.send(Message::text(long.to_string())).await.unwrap();
    ws.send(Message::text(short.to_string())).await.unwrap();
    let mut completed = Vec::new();
    while completed.len() < 2 {
        let got = read_until(&mut ws, &["response.completed"]).await;
        completed.push(got.last().unwrap().clone());
    }
    // The title stream finished first.
    assert_eq!(completed[0]["stream_id"], "title");
    let real = |stream: &str| {
        completed.iter().find(|c| c["stream_id"] == stream).unwrap()["response"]["usage"]
            ["input_tokens"]
            .as_u64()
            .unwrap()
    };
    let (main_real, title_real) = (real("main"), real("title"));
    let list = within(10, async {
        loop {
            let (_, body) = get(&client_h1(), &proxy.admin_url("/sessions")).await;
            let v: Value = serde_json::from_slice(&body).unwrap();
            let ours: Vec<Value> = v["sessions"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["model"] == "gpt-4o" || s["model"] == "gpt-4o-mini")
                .filter(|s| s["turns"] == 1 && !s["anchor"].is_null())
                .cloned()
                .collect();
            if ours.len() >= 2 {
                break ours;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    let by_model = |m: &str| list.iter().find(|s| s["model"] == m).unwrap().clone();
    assert_eq!(by_model("gpt-4o")["anchor"]["real"], json!(main_real));
    assert_eq!(by_model("gpt-4o-mini")["anchor"]["real"], json!(title_real));
    drop(ws);
    proxy.stop().await;
}

/// permessage-deflate with the client's context takeover: a compressed
/// event tidemark rejects never reaches the server, whose inflater then
/// lacks its window, so the next compressed event (which refers back into
/// the rejected one) reaches the server decompressed. The first event,
/// which no policy stopped, reaches it byte for byte; the error event
/// reaches the client uncompressed.
#[tokio::test]
async fn after_a_dropped_compressed_event_the_next_goes_decompressed() {
    let _sockets = SOCKETS.read().await;
    use tidemark::ws::frame::{Event, MessageReader};
    // The server: agrees permessage-deflate, records each frame's bytes
    // (and the message they make), answers each create with completed.
    let frames = Arc::new(Mutex::new(Vec::<(Vec<u8>, Vec<u8>, bool)>::new()));
    let f2 = Arc::clone(&frames);
    let up = raw_upstream(Arc::new(move |mut s, head, rest| {
        let frames = Arc::clone(&f2);
        Box::pin(async move {
            s.write_all(switching(&head, Some("permessage-deflate")).as_bytes())
                .await
                .unwrap();
            let mut r = MessageReader::new(1 << 20, Some(Inflater::new(false)));
            let mut buf = rest;
            let mut scratch = vec![0u8; 65536];
            let mut n_resp = 0;
            loop {
                let mut at = 0;
                let mut start = 0;
                while at < buf.len() {
                    let Ok((n, ev)) = r.feed(&buf[at..]) else {
                        frames.lock().unwrap().push((
                            buf[start..].to_vec(),
                            b"BROKEN".to_vec(),
                            false,
                        ));
                        return;
                    };
                    at += n;
                    if let Some(Event::Message {
                        compressed,
                        payload,
                        ..
                    }) = ev
                    {
                        frames.lock().unwrap().push((
                            buf[start..at].to_vec(),
                            payload.to_vec(),
                            compressed,
                        ));
                        start = at;
                        n_resp += 1;
                        let done = json!({"type": "response.completed", "response": {
                            "id": format!("resp_{n_resp}"),
                            "usage": {"input_tokens": 100, "output_tokens": 1}}});
                        let f = frame(true, false, Opcode::Text, None, done.to_string().as_bytes());
                        if s.write_all(&f).await.is_err() {
                            return;
                        }
                    }
                }
                buf.drain(..start.min(buf.len()));
                if at < start {
                    buf.clear();
                }
                let k = s.read(&mut scratch).await.unwrap_or(0);
                if k == 0 {
                    return;
                }
                buf.extend_from_slice(&scratch[..k]);
            }
        })
    }))
    .await;
    let proxy = proxy(
        &format!("http://{up}"),
        &["--on-over", "reject", "--context-window", "ws-deflate=3000"],
    )
    .await;
    let (mut s, head, rest) = open(
        proxy.addr,
        "/v1/responses",
        "x-session-id: ws-deflate\r\nSec-WebSocket-Extensions: permessage-deflate\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert_eq!(
        header(&head, "sec-websocket-extensions"),
        Some("permessage-deflate")
    );
    let phrase = "zebra quantum xylophone marmalade";
    let events = [
        json!({"type": "response.create", "model": "ws-deflate", "input": [user("hi")]}),
        json!({"type": "response.create", "model": "ws-deflate",
            "input": [user(&format!("{phrase} {}", "filler text ".repeat(1500)))]}),
        json!({"type": "response.create", "model": "ws-deflate",
            "input": [user(&format!("{phrase} again"))]}),
    ];
    let mut deflater = Deflater::new(false);
    let mut client_reader = MessageReader::new(1 << 20, Some(Inflater::new(false)));
    let mut pending = rest;
    let mut wire_sent = Vec::new();
    for (i, e) in events.iter().enumerate() {
        let f = frame(
            true,
            true,
            Opcode::Text,
            M,
            &deflater.compress(e.to_string().as_bytes()),
        );
        wire_sent.push(f.clone());
        s.write_all(&f).await.unwrap();
        // One answer per event: completed, or tidemark's error.
        let (got, compressed) = within(10, async {
            loop {
                let mut at = 0;
                while at < pending.len() {
                    let (n, ev) = client_reader.feed(&pending[at..]).unwrap();
                    at += n;
                    if let Some(Event::Message {
                        payload,
                        compressed,
                        ..
                    }) = ev
                    {
                        pending.drain(..at);
                        return (
                            serde_json::from_slice::<Value>(&payload).unwrap(),
                            compressed,
                        );
                    }
                }
                pending.clear();
                let mut b = vec![0u8; 65536];
                let k = s.read(&mut b).await.unwrap();
                assert!(k > 0, "closed");
                pending.extend_from_slice(&b[..k]);
            }
        })
        .await;
        match i {
            1 => {
                assert_eq!(got["type"], "error", "{got}");
                assert_eq!(got["error"]["code"], "context_length_exceeded");
                assert!(!compressed, "tidemark's frame goes uncompressed");
            }
            _ => assert_eq!(got["type"], "response.completed", "{i}: {got}"),
        }
    }
    let frames = frames.lock().unwrap().clone();
    assert_eq!(
        frames.len(),
        2,
        "the rejected event never reached the server"
    );
    // The first went as the client sent it.
    assert_eq!(frames[0].0, wire_sent[0]);
    assert!(frames[0].2);
    // The third refers back into the rejected one's window: it went
    // decompressed, and reads as sent.
    assert!(!frames[1].2, "forwarded without RSV1");
    assert_eq!(
        serde_json::from_slice::<Value>(&frames[1].1).unwrap(),
        events[2]
    );
    drop(s);
    proxy.stop().await;
}
