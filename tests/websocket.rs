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
    let _sockets = SOCKETS.read().await;
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
