//! The Sessions API on its own (SPEC §4, the session object of §6): anchors,
//! the legitimate anchor-less requests, anchor loss, calibration, storage.
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidemark::metrics;
use tidemark::provider::{Api, Usage};
use tidemark::session::{
    KeySource, Lane, Outcome, RequestFacts, Session, SessionConfig, Sessions, Src,
};

const CRED: &str = "cafebabe";

fn store(max: usize) -> Sessions {
    Sessions::new(SessionConfig {
        ttl: Duration::from_secs(600),
        max_sessions: max,
    })
}

fn facts(key: &str, model: &str, estimate: u64) -> RequestFacts<'static> {
    RequestFacts {
        key: Some(key.to_string()),
        credential: CRED.to_string(),
        api: Api::OpenAiChat,
        model: Some(model.to_string()),
        estimate,
        window: Some(200_000),
        ..Default::default()
    }
}

fn ok(real: u64) -> Outcome {
    Outcome {
        status: 200,
        usage: Usage {
            total_context: Some(real),
            input: Some(real),
            output: Some(50),
            cached_input: Some(real / 2),
            ..Default::default()
        },
        completed: true,
        ..Default::default()
    }
}

fn ok_without_usage() -> Outcome {
    Outcome {
        status: 200,
        usage: Usage::default(),
        completed: true,
        ..Default::default()
    }
}

fn failed(status: u16) -> Outcome {
    Outcome {
        status,
        usage: Usage::default(),
        completed: true,
        ..Default::default()
    }
}

/// A session's latest lane, with the session's own totals beside it.
struct Rec {
    lane: Lane,
    seq: u64,
    compactions: u32,
}

impl std::ops::Deref for Rec {
    type Target = Lane;
    fn deref(&self) -> &Lane {
        &self.lane
    }
}

fn rec(s: &Sessions, key: &str) -> Rec {
    let r = s.record(key, CRED).expect("session stored");
    Rec {
        lane: r.lane().expect("a lane").clone(),
        seq: r.seq,
        compactions: r.compactions,
    }
}

/// A provider that counts `a * estimate + b`.
fn provider(a: f64, b: f64, est: u64) -> u64 {
    (a * est as f64 + b).round() as u64
}

#[test]
fn calibrated_projection_within_one_percent_from_turn_three() {
    for (ci, &(a, b)) in [
        (0.8, 0.0),
        (1.0, 400.0),
        (1.37, 3_000.0),
        (2.5, 1_200.0),
        (0.93, 17_000.0),
        (2.1, 9.0),
    ]
    .iter()
    .enumerate()
    {
        let s = store(100);
        let key = format!("calib-{ci}");
        let mut est = 900u64;
        let mut worst: f64 = 0.0;
        for t in 1..=30u64 {
            // Uneven turns: some small, some a big tool result.
            est += 120 + (t * 7919) % 2_500;
            let real = provider(a, b, est);
            let begun = s.begin(facts(&key, "calib-model", est));
            let p = begun.projection.clone();
            if t == 1 {
                assert_eq!(p.src, Src::Estimate, "case {ci}: nothing learned on turn 1");
                assert_eq!(p.tokens, est);
            } else {
                assert_eq!(p.src, Src::Anchored, "case {ci} turn {t}");
            }
            let err = (p.tokens as f64 - real as f64).abs() / real as f64;
            if t >= 3 {
                assert!(
                    err < 0.01,
                    "case {ci} (a={a}, b={b}) turn {t}: projected {} real {real} ({:.3}%)",
                    p.tokens,
                    err * 100.0
                );
                worst = worst.max(err);
            }
            s.finish(begun.ticket, ok(real));
        }
        let r = rec(&s, &key);
        let cal = r.marginal.expect("ratio learned");
        assert!(
            (cal - a).abs() < 0.01,
            "case {ci}: learned {cal}, slope {a}"
        );
        assert!(worst < 0.01);
    }
}

#[test]
fn calibration_tolerates_noisy_counts() {
    // Real tokenizers are not exactly linear: ±3% noise on each turn's new content.
    let s = store(100);
    let (a, b) = (1.6, 2_500.0);
    let mut est = 2_000u64;
    let mut real = provider(a, b, est);
    let mut worst: f64 = 0.0;
    for t in 1..=30u64 {
        let delta = 300 + (t * 104_729) % 1_800;
        let noise = 1.0 + (((t * 37) % 7) as f64 - 3.0) / 100.0;
        if t > 1 {
            est += delta;
            real += (a * delta as f64 * noise).round() as u64;
        }
        let begun = s.begin(facts("noisy", "noisy-model", est));
        if t >= 3 {
            let err = (begun.projection.tokens as f64 - real as f64).abs() / real as f64;
            worst = worst.max(err);
        }
        s.finish(begun.ticket, ok(real));
    }
    assert!(worst < 0.01, "worst error {:.3}%", worst * 100.0);
}

#[test]
fn per_message_overhead_and_tiny_turns_do_not_derail_the_ratio() {
    // A provider with its own tokenizer (slope 1.3), 7 tokens of framing per
    // message and 900 per request; turns alternate between a few words and
    // large tool results. Turn 2 is tiny, so the slope is first seen on turn 3:
    // from turn 4 on every projection is within 1%.
    let s = store(100);
    let (mut est, mut msgs) = (1_200u64, 2u64);
    let count = |est: u64, msgs: u64| (1.3 * est as f64).round() as u64 + 7 * msgs + 900;
    let mut worst: f64 = 0.0;
    for t in 1..=30u64 {
        if t > 1 {
            est += if t % 3 == 0 {
                2_000 + (t * 7_919) % 3_000
            } else {
                6 + t % 9
            };
            msgs += 2;
        }
        let real = count(est, msgs);
        let b = s.begin(facts("framing", "framing-model", est));
        if t >= 4 {
            let err = (b.projection.tokens as f64 - real as f64).abs() / real as f64;
            assert!(err < 0.01, "turn {t}: {} vs {real}", b.projection.tokens);
            worst = worst.max(err);
        }
        s.finish(b.ticket, ok(real));
    }
    assert!(worst < 0.01);
}

#[test]
fn cold_start_uses_the_models_ratio_learned_across_sessions() {
    let s = store(100);
    let (a, b) = (1.8, 300.0);
    for i in 0..5u64 {
        let key = format!("cold-{i}");
        let est = 1_000 + i * 10;
        let begun = s.begin(facts(&key, "cold-model", est));
        s.finish(begun.ticket, ok(provider(a, b, est)));
    }
    let est = 1_030;
    let begun = s.begin(facts("cold-new", "cold-model", est));
    assert_eq!(begun.projection.src, Src::Calibrated);
    let real = provider(a, b, est) as f64;
    let err = (begun.projection.tokens as f64 - real).abs() / real;
    assert!(
        err < 0.02,
        "cold projection {} vs {real}",
        begun.projection.tokens
    );
    // Another model learned nothing.
    let other = s.begin(facts("cold-other", "other-model", est));
    assert_eq!(other.projection.src, Src::Estimate);
    assert_eq!(other.projection.tokens, est);
}

#[test]
fn key_less_requests_are_projected_and_not_stored() {
    let s = store(100);
    let mut f = facts("x", "keyless-model", 500);
    f.key = None;
    let b = s.begin(f);
    assert_eq!(b.projection.src, Src::Estimate);
    assert_eq!(b.projection.tokens, 500);
    assert_eq!(b.key, None);
    s.finish(b.ticket, ok(1_000));
    assert_eq!(s.len(), 0);
    assert!(s.is_empty());
    assert_eq!(s.list(10)["total"], 0);
}

#[test]
fn newest_response_wins_over_an_older_one_in_flight() {
    let s = store(100);
    let first = s.begin(facts("race", "race-model", 1_000));
    s.finish(first.ticket, ok(1_500));
    // Two requests in flight; the newer one's response comes back first.
    let older = s.begin(facts("race", "race-model", 1_100));
    let newer = s.begin(facts("race", "race-model", 1_300));
    s.finish(newer.ticket, ok(1_950));
    s.finish(older.ticket, ok(1_650));
    let a = rec(&s, "race").anchor.expect("anchored");
    assert_eq!((a.real, a.estimate), (1_950, 1_300));

    // In order: the older one anchors first, the newer one then replaces it.
    let older = s.begin(facts("race", "race-model", 1_400));
    let newer = s.begin(facts("race", "race-model", 1_500));
    s.finish(older.ticket, ok(2_100));
    assert_eq!(rec(&s, "race").anchor.map(|a| a.real), Some(2_100));
    s.finish(newer.ticket, ok(2_250));
    let a = rec(&s, "race").anchor.expect("anchored");
    assert_eq!((a.real, a.estimate), (2_250, 1_500));
}

#[test]
fn order_is_taken_on_arrival_when_projection_comes_later() {
    // Forward-first: a request reserves its place as it arrives and is
    // projected after it has gone upstream, so the later arrival may be
    // projected first. Its response still wins, in either finishing order.
    let s = store(100);
    let reserve = || {
        s.reserve(
            Some("arrive"),
            KeySource::Header,
            CRED,
            Api::OpenAiChat,
            None,
        )
    };
    // A brand-new session is made by the reservation.
    let first = reserve();
    assert_eq!(first, Some(1));
    let b = s.begin_in_order(facts("arrive", "arrive-model", 1_000), first);
    s.finish(b.ticket, ok(1_500));

    for (i, newer_finishes_first) in [(0u64, true), (1, false)] {
        // Each round's bodies grow past the last round's.
        let (est_old, est_new) = (1_100 + 1_000 * i, 1_300 + 1_000 * i);
        let (real_old, real_new) = (1_650 + 1_500 * i, 1_950 + 1_500 * i);
        let older = reserve();
        let newer = reserve();
        let n = s.begin_in_order(facts("arrive", "arrive-model", est_new), newer);
        let n_seq = n.ticket.seq();
        let o;
        if newer_finishes_first {
            s.finish(n.ticket, ok(real_new));
            // Projected only now, after the newer one anchored: its smaller
            // body is older, not a compaction.
            o = s.begin_in_order(facts("arrive", "arrive-model", est_old), older);
            assert!(o.ticket.seq() < n_seq);
            s.finish(o.ticket, ok(real_old));
        } else {
            o = s.begin_in_order(facts("arrive", "arrive-model", est_old), older);
            assert!(o.ticket.seq() < n_seq);
            s.finish(o.ticket, ok(real_old));
            s.finish(n.ticket, ok(real_new));
        }
        let r = rec(&s, "arrive");
        let a = r.anchor.expect("anchored");
        assert_eq!((a.real, a.estimate), (real_new, est_new), "round {i}");
        assert_eq!(r.compactions, 0, "round {i}");
    }
    // And a request that reserved nothing still goes after them all.
    let next = s.begin(facts("arrive", "arrive-model", 1_400));
    assert_eq!(next.ticket.seq(), 6);
    // No key, no place.
    assert_eq!(
        s.reserve(None, KeySource::Fingerprint, CRED, Api::OpenAiChat, None),
        None
    );
}

#[test]
fn an_older_response_does_not_re_anchor_after_a_reset() {
    let s = store(100);
    let b = s.begin(facts("fence", "fence-model", 1_000));
    s.finish(b.ticket, ok(1_200));
    let inflight = s.begin(facts("fence", "fence-model", 1_100));
    assert!(s.reset("fence", None));
    s.finish(inflight.ticket, ok(1_320));
    assert!(rec(&s, "fence").anchor.is_none());
    let next = s.begin(facts("fence", "fence-model", 1_150));
    assert_eq!(next.projection.src, Src::Calibrated);
    s.finish(next.ticket, ok(1_380));
    assert_eq!(rec(&s, "fence").anchor.map(|a| a.real), Some(1_380));
}

fn lost_count(model: &str) -> u64 {
    metrics::get()
        .anchor_lost
        .with_label_values(&[Api::OpenAiChat.as_str(), model])
        .get()
}

fn compactions(model: &str) -> u64 {
    metrics::get()
        .compactions
        .with_label_values(&[Api::OpenAiChat.as_str(), model])
        .get()
}

/// A tracing writer tests can read back.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[test]
fn anchor_loss_is_one_episode_however_many_turns_stay_lost() {
    let model = "loss-model";
    let logs = Captured::default();
    let sub = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .finish();
    let s = store(100);
    let before = lost_count(model);
    tracing::subscriber::with_default(sub, || {
        let b = s.begin(facts("loss", model, 1_000));
        s.finish(b.ticket, ok(1_234));
        let b = s.begin(facts("loss", model, 1_200));
        assert_eq!(b.projection.src, Src::Anchored);
        s.finish(b.ticket, ok_without_usage());
        // Every following request is lost until a response carries usage.
        for i in 0..5u64 {
            let b = s.begin(facts("loss", model, 1_300 + i * 100));
            assert_eq!(b.projection.src, Src::Lost);
            assert!(b.projection.header_value().contains(";src=lost"));
            // Still projected from the last anchor (1234 @ 1000).
            assert!(b.projection.tokens > 1_234);
            s.finish(b.ticket, ok_without_usage());
        }
        assert_eq!(rec(&s, "loss").anchor_losses, 1);
        assert_eq!(lost_count(model) - before, 1);
        assert_eq!(s.get("loss", None).unwrap()["state"], "lost");
        // Usage comes back: the episode ends.
        let b = s.begin(facts("loss", model, 1_900));
        assert_eq!(b.projection.src, Src::Lost);
        s.finish(b.ticket, ok(2_300));
        let b = s.begin(facts("loss", model, 2_000));
        assert_eq!(b.projection.src, Src::Anchored);
        assert_eq!(s.get("loss", None).unwrap()["state"], "anchored");
        s.finish(b.ticket, ok_without_usage());
        // A second episode counts again.
        let b = s.begin(facts("loss", model, 2_100));
        assert_eq!(b.projection.src, Src::Lost);
        s.finish(b.ticket, ok_without_usage());
    });
    assert_eq!(rec(&s, "loss").anchor_losses, 2);
    assert_eq!(lost_count(model) - before, 2);
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let warns: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warns.len(), 2, "one WARN per episode: {text}");
    assert!(warns[0].contains("loss"), "{}", warns[0]);
    assert!(warns[0].contains("estimate=1300"), "{}", warns[0]);
    assert!(
        warns[0].contains("1234"),
        "names the last real count: {}",
        warns[0]
    );
    assert!(warns[1].contains("estimate=2100"), "{}", warns[1]);
    assert!(warns[1].contains("2300"), "{}", warns[1]);
}

#[test]
fn first_request_without_usage_makes_the_next_one_lost() {
    let model = "loss-first-model";
    let before = lost_count(model);
    let s = store(100);
    let b = s.begin(facts("lf", model, 800));
    assert_eq!(b.projection.src, Src::Estimate);
    s.finish(b.ticket, ok_without_usage());
    let b = s.begin(facts("lf", model, 900));
    assert_eq!(b.projection.src, Src::Lost);
    assert_eq!(b.projection.tokens, 900, "no anchor: the estimate");
    s.finish(b.ticket, ok_without_usage());
    assert_eq!(lost_count(model) - before, 1);
}

#[test]
fn failed_requests_neither_anchor_nor_lose() {
    let model = "fail-model";
    let before = lost_count(model);
    let s = store(100);
    let b = s.begin(facts("fail", model, 1_000));
    s.finish(b.ticket, ok(1_100));
    for out in [
        failed(429),
        failed(500),
        failed(400),
        Outcome {
            status: 200,
            completed: false,
            ..Default::default()
        },
    ] {
        let b = s.begin(facts("fail", model, 1_200));
        assert_eq!(b.projection.src, Src::Anchored);
        s.finish(b.ticket, out);
    }
    let r = rec(&s, "fail");
    assert_eq!(r.anchor.map(|a| a.real), Some(1_100));
    assert_eq!(r.turns, 1);
    assert_eq!(r.anchor_losses, 0);
    assert_eq!(lost_count(model), before);
    let b = s.begin(facts("fail", model, 1_300));
    assert_eq!(b.projection.src, Src::Anchored);
    s.finish(b.ticket, ok(1_400));
}

#[test]
fn shrink_is_a_compaction_not_a_loss_and_its_response_re_anchors() {
    let model = "shrink-model";
    let before = compactions(model);
    let s = store(100);
    let (a, b) = (1.5, 500.0);
    for est in [1_000u64, 3_000, 6_000] {
        let bg = s.begin(facts("shrink", model, est));
        s.finish(bg.ticket, ok(provider(a, b, est)));
    }
    // Compaction: the history was summarised.
    let bg = s.begin(facts("shrink", model, 1_500));
    assert_eq!(bg.projection.src, Src::Calibrated);
    let real = provider(a, b, 1_500);
    let err = (bg.projection.tokens as f64 - real as f64).abs() / real as f64;
    assert!(err < 0.01, "{} vs {real}", bg.projection.tokens);
    assert_eq!(compactions(model) - before, 1);
    assert_eq!(rec(&s, "shrink").compactions, 1);
    assert!(rec(&s, "shrink").anchor.is_none());
    s.finish(bg.ticket, ok(real));
    let bg = s.begin(facts("shrink", model, 1_800));
    assert_eq!(bg.projection.src, Src::Anchored);
    assert_eq!(bg.projection.tokens, provider(a, b, 1_800));
    s.finish(bg.ticket, ok_without_usage());
    // A missing usage on any response makes the next request lost.
    let bg = s.begin(facts("shrink", model, 1_900));
    assert_eq!(bg.projection.src, Src::Lost);
    s.finish(bg.ticket, ok(provider(a, b, 1_900)));
}

#[test]
fn reset_header_model_change_and_delete_are_legitimate_anchor_less() {
    let model = "legit-model";
    let before = lost_count(model);
    let s = store(100);
    let b = s.begin(facts("legit", model, 1_000));
    s.finish(b.ticket, ok(1_300));
    let b = s.begin(facts("legit", model, 1_400));
    s.finish(b.ticket, ok(1_820));

    // x-context-reset: 1
    let mut f = facts("legit", model, 1_500);
    f.reset = true;
    let b = s.begin(f);
    assert_eq!(b.projection.src, Src::Calibrated);
    assert_eq!(s.get("legit", None).unwrap()["state"], "calibrated");
    s.finish(b.ticket, ok_without_usage());
    let b = s.begin(facts("legit", model, 1_600));
    assert_eq!(b.projection.src, Src::Lost, "missing usage after a reset");
    s.finish(b.ticket, ok(2_080));

    // model change
    let b = s.begin(facts("legit", "legit-model-2", 1_700));
    assert_ne!(b.projection.src, Src::Anchored);
    assert_ne!(b.projection.src, Src::Lost);
    s.finish(b.ticket, ok(1_750));
    let b = s.begin(facts("legit", "legit-model-2", 1_800));
    assert_eq!(b.projection.src, Src::Anchored);
    s.finish(b.ticket, ok(1_850));
    // Back on the first model: its lane kept its anchor through the side trip.
    let b = s.begin(facts("legit", model, 1_650));
    assert_eq!(b.projection.src, Src::Anchored);
    s.finish(b.ticket, ok(2_145));

    // DELETE /sessions/{key}
    assert!(s.reset("legit", None));
    assert!(!s.reset("no-such-session", None));
    assert!(s.get("legit", None).unwrap()["anchor"].is_null());
    let b = s.begin(facts("legit", "legit-model-2", 1_900));
    assert_eq!(b.projection.src, Src::Calibrated);
    s.finish(b.ticket, ok(1_950));
    let b = s.begin(facts("legit", "legit-model-2", 2_000));
    assert_eq!(b.projection.src, Src::Anchored);
    s.finish(b.ticket, ok(2_050));

    let r = s.record("legit", CRED).unwrap();
    assert_eq!(r.lanes.len(), 2);
    assert_eq!(r.anchor_losses(), 1, "the first model's lane lost once");
    assert_eq!(lost_count(model) - before, 1);
    assert_eq!(r.compactions, 0);
}

#[test]
fn two_credentials_are_two_sessions() {
    let s = store(100);
    let b = s.begin(facts("shared", "cred-model", 1_000));
    s.finish(b.ticket, ok(1_100));
    let mut f = facts("shared", "cred-model", 1_000);
    f.credential = "0badf00d".into();
    let b = s.begin(f);
    // Only the model's tokenizer ratio is shared, never the anchor.
    assert_eq!(b.projection.src, Src::Calibrated);
    assert!(s.record("shared", "0badf00d").unwrap().lanes[0]
        .anchor
        .is_none());
    s.finish(b.ticket, ok(1_700));
    assert_eq!(s.len(), 2);
    assert_eq!(s.get("shared", None).unwrap()["credential"], "0badf00d");
    assert_eq!(s.get("shared", Some(CRED)).unwrap()["last_real"], 1_100);
    assert_eq!(
        s.get("shared", Some("0badf00d")).unwrap()["last_real"],
        1_700
    );
    assert!(s.get("shared", Some("ffffffff")).is_none());
    assert!(s.get("nope", None).is_none());
    assert_eq!(s.list(10)["total"], 2);
}

#[test]
fn previous_response_id_continues_the_session_of_its_credential() {
    let s = store(100);
    let chained = |key: &str, est: u64| {
        let mut f = facts(key, "resp-model", est);
        f.api = Api::OpenAiResponses;
        f.source = KeySource::Fingerprint;
        f
    };
    let b = s.begin(chained("fp:abc", 1_000));
    s.finish(
        b.ticket,
        Outcome {
            response_id: Some("resp_1".into()),
            ..ok(1_200)
        },
    );
    // The follow-up carries no system prompt, so its fingerprint differs.
    let mut f = chained("fp:other", 1_300);
    f.continues = Some("resp_1".into());
    let b = s.begin(f);
    assert_eq!(b.key.as_deref(), Some("fp:abc"));
    assert_eq!(b.source, Some(KeySource::Chain));
    assert_eq!(b.projection.src, Src::Anchored);
    s.finish(b.ticket, ok(1_560));
    assert_eq!(s.len(), 1);
    // Another credential cannot follow it.
    let mut f = chained("fp:third", 1_300);
    f.credential = "0badf00d".into();
    f.continues = Some("resp_1".into());
    let b = s.begin(f);
    assert_eq!(b.key.as_deref(), Some("fp:third"));
    s.finish(b.ticket, ok(1_560));
    // An unknown id falls back to the request's own key.
    let mut f = chained("fp:fourth", 1_300);
    f.continues = Some("resp_unknown".into());
    let b = s.begin(f);
    assert_eq!(b.key.as_deref(), Some("fp:fourth"));
    // A session header or an agent's own id comes first: the chain then
    // does not move the request to another session.
    for source in [KeySource::Header, KeySource::Agent] {
        let mut f = chained("named", 1_300);
        f.source = source;
        f.continues = Some("resp_1".into());
        let b = s.begin(f);
        assert_eq!(b.key.as_deref(), Some("named"), "{source:?}");
        assert_eq!(b.source, Some(source));
    }
}

#[test]
fn session_object_has_the_spec_fields() {
    let s = store(100);
    for (est, real) in [(1_000u64, 1_300u64), (2_000, 2_600), (3_000, 3_900)] {
        let b = s.begin(facts("obj", "obj-model", est));
        s.finish(b.ticket, ok(real));
    }
    let b = s.begin(facts("obj", "obj-model", 4_000));
    assert_eq!(b.projection.tokens, 5_200);
    s.finish(b.ticket, failed(500));
    let v = s.get("obj", None).unwrap();
    let obj = v.as_object().unwrap();
    for field in [
        "key",
        "credential",
        "api",
        "model",
        "state",
        "turns",
        "anchor",
        "projection",
        "last_real",
        "window",
        "utilization",
        "calibration",
        "compactions",
        "anchor_losses",
        "cumulative",
        "last_seen",
    ] {
        assert!(obj.contains_key(field), "missing {field}: {v}");
    }
    assert_eq!(v["key"], "obj");
    assert_eq!(v["credential"], CRED);
    assert_eq!(v["api"], "openai-chat");
    assert_eq!(v["model"], "obj-model");
    assert_eq!(v["state"], "anchored");
    assert_eq!(v["turns"], 3);
    assert_eq!(v["anchor"]["real"], 3_900);
    assert_eq!(v["anchor"]["estimate"], 3_000);
    assert_eq!(v["projection"], 5_200);
    assert_eq!(v["last_real"], 3_900);
    assert_eq!(v["window"], 200_000);
    assert_eq!(v["utilization"], 0.026);
    assert_eq!(v["calibration"], 1.3);
    assert_eq!(v["compactions"], 0);
    assert_eq!(v["anchor_losses"], 0);
    assert_eq!(v["cumulative"]["input"], 1_300 + 2_600 + 3_900);
    assert_eq!(v["cumulative"]["cached_input"], 650 + 1_300 + 1_950);
    assert_eq!(v["cumulative"]["output"], 150);
    for t in [
        v["last_seen"].as_str().unwrap(),
        v["anchor"]["at"].as_str().unwrap(),
    ] {
        // 2026-12-03T02:28:37.123Z
        let b = t.as_bytes();
        assert_eq!(b.len(), 24, "{t}");
        assert_eq!(
            (b[4], b[7], b[10], b[13], b[16], b[19], b[23]),
            (b'-', b'-', b'T', b':', b':', b'.', b'Z'),
            "{t}"
        );
        assert!(t.starts_with("20"), "{t}");
    }
    // Spend: cumulative real prompt plus output.
    let b = s.begin(facts("obj", "obj-model", 4_000));
    assert_eq!(b.spent, 1_300 + 2_600 + 3_900 + 150);
}

#[test]
fn list_sorts_by_utilisation_and_honours_the_limit() {
    let s = store(100);
    for (i, est) in [5_000u64, 50_000, 500, 20_000].iter().enumerate() {
        let b = s.begin(facts(&format!("list-{i}"), "list-model", *est));
        s.finish(b.ticket, ok(*est));
    }
    let mut f = facts("list-nowindow", "list-model", 90_000);
    f.window = None;
    s.begin(f);
    let v = s.list(10);
    assert_eq!(v["total"], 5);
    let keys: Vec<&str> = v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["key"].as_str().unwrap())
        .collect();
    assert_eq!(
        keys,
        ["list-1", "list-3", "list-0", "list-2", "list-nowindow"]
    );
    let v = s.list(2);
    assert_eq!(v["total"], 5);
    assert_eq!(v["sessions"].as_array().unwrap().len(), 2);
    assert_eq!(v["sessions"][0]["key"], "list-1");
    assert_eq!(s.list(0)["sessions"].as_array().unwrap().len(), 0);
}

#[test]
fn idle_sessions_are_swept_after_the_ttl() {
    let s = Sessions::new(SessionConfig {
        ttl: Duration::from_secs(60),
        max_sessions: 100,
    });
    s.begin(facts("ttl-a", "ttl-model", 10));
    s.begin(facts("ttl-b", "ttl-model", 10));
    s.sweep(Instant::now());
    assert_eq!(s.len(), 2);
    s.sweep(Instant::now() + Duration::from_secs(61));
    assert_eq!(s.len(), 0);
    assert!(s.get("ttl-a", None).is_none());
}

#[test]
fn the_cap_evicts_the_least_recently_seen() {
    let cap = 160;
    let s = store(cap);
    s.begin(facts("lru-keep", "lru-model", 10));
    for i in 0..2_000 {
        s.begin(facts(&format!("lru-{i}"), "lru-model", 10));
        if i % 50 == 0 {
            // Seen often: stays.
            s.begin(facts("lru-keep", "lru-model", 10));
        }
        assert!(s.len() <= cap, "{} sessions over a cap of {cap}", s.len());
    }
    assert!(s.len() > cap / 2);
    assert!(s.get("lru-keep", None).is_some());
    assert!(s.get("lru-1999", None).is_some());
    assert!(s.get("lru-0", None).is_none());
    assert!(s.get("lru-1000", None).is_none());
    assert_eq!(s.list(usize::MAX)["total"].as_u64(), Some(s.len() as u64));
}

#[test]
fn trimming_reprojects_with_the_same_ruler_and_anchors_what_was_sent() {
    let s = store(100);
    let (a, b) = (2.0, 100.0);
    for est in [1_000u64, 2_000] {
        let bg = s.begin(facts("trim", "trim-model", est));
        s.finish(bg.ticket, ok(provider(a, b, est)));
    }
    let mut bg = s.begin(facts("trim", "trim-model", 10_000));
    assert_eq!(bg.projection.tokens, provider(a, b, 10_000));
    s.reproject(&mut bg, 1_500);
    assert_eq!(bg.projection.tokens, provider(a, b, 1_500));
    assert_eq!(bg.projection.src, Src::Anchored);
    s.finish(bg.ticket, ok(provider(a, b, 1_500)));
    let anchor = rec(&s, "trim").anchor.unwrap();
    assert_eq!(anchor.estimate, 1_500);
    // The client sends its full history again: no shrink, projected in full.
    let bg = s.begin(facts("trim", "trim-model", 10_200));
    assert!(!bg.anchorless());
    assert_eq!(bg.projection.src, Src::Anchored);
    assert_eq!(bg.projection.tokens, provider(a, b, 10_200));
    assert_eq!(rec(&s, "trim").compactions, 0);
}

#[test]
fn a_provider_count_replaces_the_cold_projection() {
    let s = store(100);
    let mut f = facts("count", "count-model", 1_000);
    f.counted = Some(1_444);
    let b = s.begin(f);
    assert_eq!(b.projection.src, Src::Counted);
    assert_eq!(b.projection.tokens, 1_444);
    s.finish(b.ticket, ok(1_444));
    let mut b = s.begin(facts("count-2", "count-model", 2_000));
    assert!(b.anchorless());
    s.apply_count(&mut b, 2_345);
    assert_eq!(b.projection.src, Src::Counted);
    assert_eq!(b.projection.tokens, 2_345);
    assert!(b
        .projection
        .header_value()
        .starts_with("2345;src=counted;window=200000"));
}

#[test]
fn turns_left_follows_recent_growth() {
    let s = store(100);
    let mut f = facts("growth", "growth-model", 10_000);
    f.window = Some(100_000);
    let b = s.begin(f);
    assert_eq!(b.projection.turns_left, None, "no growth known yet");
    s.finish(b.ticket, ok(10_000));
    for est in [20_000u64, 30_000] {
        let mut f = facts("growth", "growth-model", est);
        f.window = Some(100_000);
        let b = s.begin(f);
        s.finish(b.ticket, ok(est));
    }
    let mut f = facts("growth", "growth-model", 40_000);
    f.window = Some(100_000);
    let b = s.begin(f);
    assert_eq!(b.projection.tokens, 40_000);
    assert_eq!(b.projection.turns_left, Some(6));
    assert_eq!(
        b.projection.header_value(),
        "40000;src=anchored;window=100000;util=0.4;turns-left=6"
    );
}

#[test]
fn records_round_trip_through_serde() {
    let s = store(100);
    let b = s.begin(facts("serde", "serde-model", 1_000));
    s.finish(b.ticket, ok(1_200));
    let b = s.begin(facts("serde", "serde-model", 1_100));
    s.finish(b.ticket, ok(1_330));
    let r = s.record("serde", CRED).unwrap();
    let json = serde_json::to_string(&r).unwrap();
    let back: Session = serde_json::from_str(&json).unwrap();
    assert_eq!(back.seq, 2);
    assert_eq!(back.api, Api::OpenAiChat);
    assert_eq!(back.lanes.len(), 1);
    let (l, b) = (r.lane().unwrap(), back.lane().unwrap());
    assert_eq!(b.anchor, l.anchor);
    assert_eq!(b.marginal, l.marginal);
    assert_eq!(b.state, l.state);
    assert_eq!(b.id, l.id);
    assert!(json.contains("\"openai-chat\""));
}

#[test]
fn concurrent_sessions_keep_count_and_state() {
    let s = Arc::new(store(100_000));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                for i in 0..500u64 {
                    let key = format!("conc-{}", i % 50);
                    let b = s.begin(facts(&key, "conc-model", 1_000 + i * 10 + t));
                    s.finish(b.ticket, ok(1_200 + i * 12));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(s.len(), 50);
    let r = rec(&s, "conc-7");
    assert_eq!(r.seq, 40);
    assert!(r.anchor.is_some());
}
