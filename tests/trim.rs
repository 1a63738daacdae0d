//! The trimmer (SPEC §5 `trim`) on realistic agent sessions of every API:
//! valid for the provider, smaller, under the target when that is possible,
//! head and newest message kept byte for byte, order kept, and a sticky cut
//! that keeps consecutive requests' forwarded prefix byte-identical.

mod trim_support;

use serde_json::Value;
use tidemark::provider::Api;
use tidemark::trim::{trim, trim_sticky, Trimmed};
use trim_support::*;

/// Elements through the first user message.
fn head_len(api: Api, body: &[u8]) -> usize {
    raw_elements(api, body)
        .iter()
        .position(|(_, s)| is_turn_start(api, &serde_json::from_str(s).unwrap()))
        .unwrap()
        + 1
}

fn run(api: Api, body: &[u8], need: u64) -> Option<Trimmed> {
    trim(api, body, &count, need, None)
}

/// The smallest body a trim can reach: head, gap marker and newest message.
fn floor(api: Api, s: &Script) -> u64 {
    let first = s.steps.first().cloned().unwrap();
    let last = s.steps.last().cloned().unwrap();
    let min = Script {
        steps: vec![
            first,
            Step::Assistant("[tidemark: 999 earlier messages omitted]".into()),
            last,
        ],
        ..s.clone()
    };
    count(&render(api, &min, true))
}

#[test]
fn every_api_trims_to_several_targets_validly() {
    for api in APIS {
        for pretty in [false, true] {
            let s = agent_script(12, 2, 6000);
            let body = render(api, &s, pretty);
            let c0 = count(&body);
            let floor = floor(api, &s);
            for frac in [0.95, 0.9, 0.6, 0.3, 0.1, 0.01] {
                let need = (c0 as f64 * frac) as u64;
                let t = run(api, &body, need)
                    .unwrap_or_else(|| panic!("{api:?} {frac}: nothing trimmed"));
                if let Err(e) = check_trimmed(api, &body, &t.body) {
                    panic!("{api:?} pretty={pretty} frac={frac}: {e}");
                }
                let after = count(&t.body);
                if need >= floor {
                    assert!(
                        after <= need,
                        "{api:?} {frac}: {after} > {need} (floor {floor})"
                    );
                }
                // Not over-trimmed: elision and turn drops stop once under.
                if frac >= 0.3 {
                    // At most one message's outputs (2 x 6 KB) more than needed.
                    assert!(
                        after + 3100 > need,
                        "{api:?} {frac}: cut to {after} for {need}"
                    );
                }
                let s = String::from_utf8(t.body.clone()).unwrap();
                let elided = s.matches("[tidemark: elided ").count() as u32;
                assert_eq!(elided, t.tool_results, "{api:?} {frac}");
                assert_eq!(
                    t.turns > 0,
                    t.cut.dropped_until > head_len(api, &body),
                    "{api:?} {frac}: {:?}",
                    t.cut
                );
                if frac >= 0.9 {
                    // Eliding a few old 6 KB outputs is enough: no turn dropped.
                    assert_eq!(t.turns, 0, "{api:?} {frac}: elision comes first");
                    assert!(t.tool_results > 0);
                }
                if frac <= 0.01 {
                    // Text alone is over: turns must go.
                    assert!(t.turns > 0, "{api:?} {frac}: turns must go");
                }
            }
        }
    }
}

#[test]
fn elision_marker_says_how_much_was_removed() {
    let s = agent_script(6, 1, 5000);
    let body = render(Api::OpenAiChat, &s, false);
    let t = run(Api::OpenAiChat, &body, count(&body) - 100).unwrap();
    assert_eq!(t.turns, 0);
    assert_eq!(t.tool_results, 1);
    let v: Value = serde_json::from_slice(&t.body).unwrap();
    let m = v["messages"].as_array().unwrap();
    let i = t.cut.elided[0];
    let content = m[i]["content"].as_str().unwrap();
    let orig: Value = serde_json::from_slice(&body).unwrap();
    let orig_len = serde_json::to_string(&orig["messages"][i]["content"])
        .unwrap()
        .len();
    assert_eq!(
        content,
        format!("[tidemark: elided {orig_len} bytes of tool output]")
    );
    // Everything else is untouched, byte for byte.
    let o = raw_elements(Api::OpenAiChat, &body);
    let n = raw_elements(Api::OpenAiChat, &t.body);
    assert_eq!(o.len(), n.len());
    for k in (0..o.len()).filter(|&k| k != i) {
        assert_eq!(o[k].1, n[k].1);
    }
}

/// End (exclusive byte offset in `out`) of the first kept turn after the head.
fn end_of_first_kept_turn(api: Api, orig: &[u8], out: &[u8]) -> usize {
    let head = head_len(api, orig);
    let t = raw_elements(api, out);
    let starts: Vec<usize> = (head..t.len())
        .filter(|&i| is_turn_start(api, &serde_json::from_str(&t[i].1).unwrap()))
        .collect();
    let last = match starts.get(1) {
        Some(&next) => next - 1,
        None => t.len() - 1,
    };
    t[last].0 + t[last].1.len()
}

#[test]
fn sticky_cut_keeps_the_forwarded_prefix_byte_identical() {
    for api in APIS {
        for pretty in [false, true] {
            let s1 = agent_script(10, 2, 1500);
            let body1 = render(api, &s1, pretty);
            let need = count(&body1) / 8;
            let t1 = run(api, &body1, need).unwrap();
            assert!(t1.turns > 0, "{api:?}");
            check_trimmed(api, &body1, &t1.body).unwrap();

            // The next request of the same conversation: two messages more.
            let mut s2 = s1.clone();
            s2.steps.push(Step::Assistant(text(42, 500)));
            s2.steps.push(Step::User(text(43, 120)));
            let body2 = render(api, &s2, pretty);
            let grew = count(&body2) - count(&body1);
            let keep = need + grew + 50;
            let t2 = trim_sticky(api, &body2, &count, need, keep, Some(&t1.cut)).unwrap();
            check_trimmed(api, &body2, &t2.body).unwrap();
            assert_eq!(t2.cut, t1.cut, "{api:?}: the same cut");

            let end = end_of_first_kept_turn(api, &body1, &t1.body);
            assert_eq!(t2.body[..end], t1.body[..end], "{api:?} pretty={pretty}");
            // In fact every kept element of the first request is a prefix of the second.
            let last = raw_elements(api, &t1.body).pop().unwrap();
            let all = last.0 + last.1.len();
            assert_eq!(t2.body[..all], t1.body[..all], "{api:?} pretty={pretty}");

            // Without hysteresis the second request is cut further, still valid,
            // and the head is still byte-identical.
            let t3 = trim(api, &body2, &count, need, Some(&t1.cut)).unwrap();
            check_trimmed(api, &body2, &t3.body).unwrap();
            assert!(count(&t3.body) <= need);
            let h = &raw_elements(api, &t1.body)[head_len(api, &body1) - 1];
            let head_end = h.0 + h.1.len();
            assert_eq!(t3.body[..head_end], t1.body[..head_end], "{api:?}");
        }
    }
}

#[test]
fn a_cut_from_another_conversation_is_not_applied() {
    for api in APIS {
        let s1 = agent_script(10, 2, 4000);
        let body1 = render(api, &s1, false);
        let t1 = run(api, &body1, count(&body1) / 3).unwrap();
        let mut other = agent_script(4, 1, 300);
        other.steps[0] = Step::User("a different first question".into());
        let body = render(api, &other, false);
        // Plenty of room: with the foreign cut ignored there is nothing to do.
        assert!(
            trim(api, &body, &count, count(&body), Some(&t1.cut)).is_none(),
            "{api:?}"
        );
        let need = count(&body) * 8 / 10;
        let with = trim(api, &body, &count, need, Some(&t1.cut)).unwrap();
        let without = run(api, &body, need).unwrap();
        assert_eq!(with.body, without.body, "{api:?}");
        check_trimmed(api, &body, &with.body).unwrap();
    }
}

#[test]
fn untrimmable_requests_are_left_alone() {
    for api in APIS {
        let huge = Script {
            system: "sys".into(),
            steps: vec![Step::User(text(1, 200_000))],
            breakpoints: 0,
        };
        let body = render(api, &huge, false);
        assert!(
            run(api, &body, 10).is_none(),
            "{api:?}: one huge user message"
        );

        // The newest tool step's output has not been seen by the model yet: kept.
        let fresh = Script {
            system: "sys".into(),
            steps: vec![
                Step::User("go".into()),
                Step::Tools(vec![("read".into(), text(2, 100_000))]),
            ],
            breakpoints: 0,
        };
        let body = render(api, &fresh, false);
        assert!(run(api, &body, 10).is_none(), "{api:?}: fresh tool output");
        assert!(run(api, b"not json", 10).is_none());
        assert!(run(api, br#"{"messages":[],"input":[],"contents":[]}"#, 0).is_none());
    }
    let body = br#"{"model":"gpt-5","input":"a very long string input that cannot be cut"}"#;
    assert!(run(Api::OpenAiResponses, body, 1).is_none());
}

#[test]
fn a_single_long_agent_loop_elides_what_the_model_has_already_read() {
    for api in APIS {
        let mut steps = vec![Step::User("fix the bug".into())];
        for i in 0..20 {
            steps.push(Step::Tools(vec![(format!("t{i}"), text(i, 8000))]));
        }
        let s = Script {
            system: "sys".into(),
            steps,
            breakpoints: 0,
        };
        let body = render(api, &s, false);
        let need = count(&body) / 4;
        let t = run(api, &body, need).unwrap();
        check_trimmed(api, &body, &t.body).unwrap();
        assert!(count(&t.body) <= need, "{api:?}");
        assert_eq!(t.turns, 0);
        // The newest output is intact.
        let orig = raw_elements(api, &body);
        let out = raw_elements(api, &t.body);
        assert_eq!(orig.last().unwrap().1, out.last().unwrap().1);
        assert!(!out.last().unwrap().1.contains("[tidemark: elided"));
    }
}

#[test]
fn anthropic_keeps_at_most_four_breakpoints() {
    let mut s = agent_script(8, 1, 3000);
    s.breakpoints = 7;
    let body = render(Api::Anthropic, &s, false);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(cache_controls(&v), 7);
    for frac in [0.9, 0.5, 0.2] {
        let need = (count(&body) as f64 * frac) as u64;
        let t = run(Api::Anthropic, &body, need).unwrap();
        check_trimmed(Api::Anthropic, &body, &t.body).unwrap();
        let v: Value = serde_json::from_slice(&t.body).unwrap();
        let n = cache_controls(&v);
        assert!(n <= 4, "{frac}: {n}");
        // The newest breakpoints are the ones that stay.
        let m = v["messages"].as_array().unwrap();
        assert!(cache_controls(m.last().unwrap()) == 1, "{frac}");
    }
}

#[test]
fn anthropic_gap_keeps_alternation_with_a_visible_marker() {
    let s = agent_script(6, 1, 500);
    let body = render(Api::Anthropic, &s, false);
    let t = run(Api::Anthropic, &body, count(&body) / 2).unwrap();
    let v: Value = serde_json::from_slice(&t.body).unwrap();
    let m = v["messages"].as_array().unwrap();
    assert_eq!(m[1]["role"], "assistant");
    let dropped = t.cut.dropped_until - head_len(Api::Anthropic, &body);
    assert_eq!(
        m[1]["content"],
        format!("[tidemark: {dropped} earlier messages omitted]")
    );
    assert_eq!(m[2]["role"], "user");
    validate(Api::Anthropic, &t.body).unwrap();
}

#[test]
fn trimming_a_large_session_is_quick() {
    // 200 turns of 3 tool steps of 4 KB: ~5 MB.
    let s = agent_script(200, 3, 4000);
    let body = render(Api::Anthropic, &s, false);
    let start = std::time::Instant::now();
    let t = run(Api::Anthropic, &body, count(&body) / 5).unwrap();
    let took = start.elapsed();
    check_trimmed(Api::Anthropic, &body, &t.body).unwrap();
    eprintln!(
        "trimmed {} bytes to {} in {:?} (dropped {} turns, elided {})",
        body.len(),
        t.body.len(),
        took,
        t.turns,
        t.tool_results
    );
    assert!(took.as_secs() < 20, "{took:?}");
}
