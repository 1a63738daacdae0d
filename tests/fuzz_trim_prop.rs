//! Property tests for the trimmer: random conversations of every API, random
//! targets, random prior cuts — the output is always a valid request for its
//! API, shorter, with head, newest message and order kept; broken input never
//! panics. `PROPTEST_CASES` sets the number of cases (default 256).

mod support;

use proptest::prelude::*;
use std::sync::OnceLock;
use support::trim::*;

use tidemark::estimate::{Estimate, Estimator};
use tidemark::json::RequestView;
use tidemark::policy::trim::{trim, trim_estimated, trim_sticky, Cut, Trimmed};
use tidemark::provider::Api;

/// One user turn: question length, tool steps (output lengths per call),
/// and the answer's length if it has one.
#[derive(Debug, Clone)]
struct Turn {
    question: usize,
    steps: Vec<Vec<usize>>,
    answer: Option<usize>,
}

fn turn(answered: bool) -> impl Strategy<Value = Turn> {
    (
        1usize..400,
        prop::collection::vec(prop::collection::vec(0usize..3000, 1..4), 0..4),
        300usize..600,
        any::<bool>(),
    )
        .prop_map(move |(question, steps, a, has)| Turn {
            question,
            steps,
            answer: (answered || has).then_some(a),
        })
}

fn script(turns: &[Turn], breakpoints: usize) -> Script {
    let mut steps = Vec::new();
    for (t, tn) in turns.iter().enumerate() {
        steps.push(Step::User(text(t, tn.question)));
        for (s, calls) in tn.steps.iter().enumerate() {
            steps.push(Step::Tools(
                calls
                    .iter()
                    .enumerate()
                    .map(|(c, &len)| (format!("tool_{c}"), text(t + s + c, len)))
                    .collect(),
            ));
        }
        if let Some(a) = tn.answer {
            steps.push(Step::Assistant(text(t + 11, a)));
        }
    }
    Script {
        system: text(3, 300),
        steps,
        breakpoints,
    }
}

fn conversation() -> impl Strategy<Value = (usize, Vec<Turn>, bool, usize)> {
    (
        0usize..APIS.len(),
        prop::collection::vec(turn(true), 0..8),
        turn(false),
        any::<bool>(),
        0usize..8,
    )
        .prop_map(|(api, mut turns, last, pretty, bp)| {
            turns.push(last);
            (api, turns, pretty, bp)
        })
}

proptest! {
    #[test]
    fn trimmed_requests_are_always_valid(
        (api, turns, pretty, bp) in conversation(),
        frac in 0.0f64..1.1,
    ) {
        let api = APIS[api];
        let s = script(&turns, bp);
        let body = render(api, &s, pretty);
        let need = (count(&body) as f64 * frac) as u64;
        if let Some(t) = trim(api, &body, &count, need, None) {
            if let Err(e) = check_trimmed(api, &body, &t.body) {
                return Err(TestCaseError::fail(format!("{api:?} need={need}: {e}")));
            }
            prop_assert!(t.cut.elided.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(t.cut.elided.iter().all(|&i| i >= t.cut.dropped_until));
            // Nothing is cut once under: a trim of the trimmed body with the
            // same cut changes nothing more.
            if count(&t.body) <= need {
                prop_assert!(count(&body) > need);
            }
        } else if api != tidemark::provider::Api::Anthropic || bp <= 4 {
            // Nothing trimmed: either the target is met already or there is
            // nothing old to remove.
            prop_assert!(count(&body) <= need || s.steps.len() <= 2 || turns.len() == 1
                || no_old_outputs(&turns), "{api:?}: gave up on a trimmable body");
        }
    }

    #[test]
    fn sticky_cuts_stay_valid_as_the_conversation_grows(
        (api, turns, pretty, bp) in conversation(),
        frac1 in 0.0f64..1.0,
        frac2 in 0.0f64..1.1,
        split in 0usize..8,
    ) {
        let api = APIS[api];
        let (body1, body2) = grown(api, &turns, split, bp, pretty);
        let need1 = (count(&body1) as f64 * frac1) as u64;
        let Some(t1) = trim(api, &body1, &count, need1, None) else { return Ok(()) };
        let need2 = (count(&body2) as f64 * frac2) as u64;
        let keep = need2.max(count(&t1.body) + count(&body2) - count(&body1));
        for t2 in [
            trim(api, &body2, &count, need2, Some(&t1.cut)),
            trim_sticky(api, &body2, &count, need2, keep, Some(&t1.cut)),
        ]
        .into_iter()
        .flatten()
        {
            if let Err(e) = check_trimmed(api, &body2, &t2.body) {
                return Err(TestCaseError::fail(format!("{api:?} {:?}: {e}", t1.cut)));
            }
            // The cut is re-applied (and only ever extended) when the head is
            // unchanged; agents moving `cache_control` onto it make a new head.
            let head = |b: &[u8]| {
                let n = head_len(api, b);
                raw_elements(api, b).into_iter().take(n).map(|e| e.1).collect::<Vec<_>>()
            };
            if head(&body1) == head(&body2) {
                prop_assert!(t2.cut.dropped_until >= t1.cut.dropped_until);
            }
        }
    }

    #[test]
    fn a_tampered_prior_cut_is_validated_not_trusted(
        (api, turns, pretty, bp) in conversation(),
        frac in 0.0f64..1.0,
        until in 0usize..80,
        elided in prop::collection::vec(0usize..80, 0..6),
    ) {
        let api = APIS[api];
        let body = render(api, &script(&turns, bp), pretty);
        let need = (count(&body) as f64 * frac) as u64;
        let Some(t) = trim(api, &body, &count, need, None) else { return Ok(()) };
        // Same head hash, arbitrary cut: only legal parts may be applied.
        let prior = Cut { dropped_until: until, elided, ..t.cut.clone() };
        if let Some(t2) = trim(api, &body, &count, need, Some(&prior)) {
            if let Err(e) = check_trimmed(api, &body, &t2.body) {
                return Err(TestCaseError::fail(format!("{api:?} {prior:?}: {e}")));
            }
        }
    }

    /// The proxy's trim weighs each cut by adding up its elements' cached
    /// counts; it must cut exactly where estimating each candidate body
    /// whole would, and say what estimating its body gives. Fresh and
    /// with the prior cut of an earlier request.
    #[test]
    fn weighing_by_parts_cuts_as_estimating_bodies_does(
        (api, turns, pretty, bp) in conversation(),
        frac1 in 0.0f64..1.0,
        frac2 in 0.0f64..1.1,
        split in 0usize..8,
    ) {
        let api = APIS[api];
        let (body1, body2) = grown(api, &turns, split, bp, pretty);
        let need1 = (tokens(api, &body1) as f64 * frac1) as u64;
        let t1 = compare(api, &body1, need1, need1, None)?;
        let need2 = (tokens(api, &body2) as f64 * frac2) as u64;
        let prior = t1.as_ref().map(|t| &t.cut);
        compare(api, &body2, need2, need2, prior)?;
        compare(api, &body2, need2, need2 * 5 / 4, prior)?;
    }

    #[test]
    fn broken_bodies_never_panic(
        (api, turns, pretty, bp) in conversation(),
        cut in 0usize..100_000,
        flip in 0usize..100_000,
        byte in any::<u8>(),
        need in 0u64..10_000,
    ) {
        let api = APIS[api];
        let mut body = render(api, &script(&turns, bp), pretty);
        let at = flip % body.len();
        body[at] = byte;
        body.truncate(body.len() - cut % body.len());
        if let Some(t) = trim(api, &body, &count, need, None) {
            prop_assert!(t.body.len() < body.len());
            prop_assert!(serde_json::from_slice::<serde_json::Value>(&t.body).is_ok());
        }
    }
}

/// No tool output before the newest turn is big enough to elide.
fn no_old_outputs(turns: &[Turn]) -> bool {
    turns[..turns.len() - 1]
        .iter()
        .all(|t| t.steps.iter().flatten().all(|&len| len < 1000))
}

/// An earlier request (the first `split` turns plus the next question)
/// and the whole conversation, as one that grew.
fn grown(api: Api, turns: &[Turn], split: usize, bp: usize, pretty: bool) -> (Vec<u8>, Vec<u8>) {
    let split = split.min(turns.len() - 1);
    let mut early: Vec<Turn> = turns[..split].to_vec();
    early.push(Turn {
        steps: Vec::new(),
        answer: None,
        ..turns[split].clone()
    });
    let body1 = render(api, &script(&early, bp), pretty);
    (body1, render(api, &script(turns, bp), pretty))
}

/// One estimator for every case: its cache fills as a proxy's does.
fn estimator() -> &'static Estimator {
    static E: OnceLock<Estimator> = OnceLock::new();
    E.get_or_init(|| Estimator::new(64 << 20))
}

/// A ruler that is not the bare total: classes and characters move it too.
fn measure(e: &Estimate) -> u64 {
    e.tokens + e.chars / 16 + u64::from(e.classes.0[0]) / 3
}

fn tokens(api: Api, body: &[u8]) -> u64 {
    estimator()
        .estimate_body(api, body, None)
        .map_or(u64::MAX, |e| measure(&e))
}

/// [`trim_estimated`] against [`trim_sticky`] with whole bodies estimated.
fn compare(
    api: Api,
    body: &[u8],
    need: u64,
    keep: u64,
    prior: Option<&Cut>,
) -> Result<Option<Trimmed>, TestCaseError> {
    let whole = trim_sticky(api, body, &|b| tokens(api, b), need, keep, prior);
    let view = RequestView::parse(body).expect("a JSON object");
    let parts = trim_estimated(estimator(), api, &view, None, &measure, need, keep, prior);
    match (&whole, &parts) {
        (None, None) => {}
        (Some(w), Some((p, e))) => {
            prop_assert_eq!(&w.cut, &p.cut, "{:?}", api);
            prop_assert_eq!((w.turns, w.tool_results), (p.turns, p.tool_results));
            prop_assert!(w.body == p.body, "{api:?}: bodies differ");
            let again = estimator().estimate_body(api, &p.body, None);
            prop_assert_eq!(
                Some(*e),
                again,
                "{:?}: the estimate of the trimmed body",
                api
            );
        }
        _ => prop_assert!(false, "{api:?}: one trimmed, the other not"),
    }
    Ok(whole)
}
