//! The trimmer (SPEC §5 `trim`) on realistic agent sessions of every API:
//! valid for the provider, smaller, under the target when that is possible,
//! head and newest message kept byte for byte, order kept, and a sticky cut
//! that keeps consecutive requests' forwarded prefix byte-identical.

mod support;

use serde_json::Value;
use support::trim::*;
use tidemark::policy::trim::{trim, trim_sticky, Trimmed};
use tidemark::provider::Api;

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

        // A trimmable body with one byte that is not UTF-8 inside an old
        // message: not JSON, so forwarded untouched rather than trimmed.
        let mut body = render(api, &agent_script(12, 2, 6000), false);
        assert!(run(api, &body, count(&body) / 2).is_some(), "{api:?}");
        let at = body.len() / 4;
        let at = at
            + body[at..]
                .iter()
                .position(|&b| b.is_ascii_lowercase())
                .unwrap();
        body[at] = 0x80;
        assert!(
            run(api, &body, count(&body) / 2).is_none(),
            "{api:?}: a stray byte"
        );
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

#[test]
fn the_validators_catch_what_a_naive_cut_breaks() {
    let s = agent_script(3, 1, 100);
    for api in APIS {
        let body = render(api, &s, false);
        validate(api, &body).unwrap();
        let key = array_key(api);
        let v: Value = serde_json::from_slice(&body).unwrap();
        let arr = v[key].as_array().unwrap().clone();
        // Drop each single element in turn: every removal of a tool call, a
        // tool result or (for alternating APIs) any message must be caught.
        for (i, elem) in arr.iter().enumerate().take(arr.len() - 1).skip(1) {
            let mut cut = v.clone();
            cut[key].as_array_mut().unwrap().remove(i);
            let b = serde_json::to_vec(&cut).unwrap();
            let tooly = elem.get("tool_calls").is_some()
                || elem["role"] == "tool"
                || elem["type"]
                    .as_str()
                    .is_some_and(|t| t.starts_with("function_call"))
                || serde_json::to_string(elem).unwrap().contains("tool_use")
                || serde_json::to_string(elem)
                    .unwrap()
                    .contains("functionCall")
                || serde_json::to_string(elem)
                    .unwrap()
                    .contains("functionResponse");
            let alternating = matches!(api, Api::Anthropic | Api::Gemini);
            if tooly || alternating {
                assert!(
                    validate(api, &b).is_err(),
                    "{api:?}: removing element {i} not caught"
                );
            }
        }
    }
    let mut s = agent_script(2, 1, 100);
    s.breakpoints = 5;
    assert!(validate(Api::Anthropic, &render(Api::Anthropic, &s, false)).is_err());
}

#[test]
fn a_long_loop_of_small_steps_drops_its_oldest_steps() {
    for api in APIS {
        let mut steps = vec![Step::User("refactor everything".into())];
        for i in 0..60 {
            steps.push(Step::Tools(vec![(format!("t{i}"), text(i, 600))]));
        }
        let s = Script {
            system: "sys".into(),
            steps,
            breakpoints: 0,
        };
        let body = render(api, &s, false);
        let need = count(&body) / 3;
        let t = run(api, &body, need).unwrap();
        check_trimmed(api, &body, &t.body).unwrap();
        assert!(count(&t.body) <= need, "{api:?}");
        assert!(count(&t.body) > need * 8 / 10, "{api:?}: over-trimmed");
        assert_eq!(t.tool_results, 0, "{api:?}: nothing big enough to elide");
        // No marker needed: the kept tail starts with the model's own step.
        let s = String::from_utf8(t.body).unwrap();
        assert!(!s.contains("earlier messages omitted"), "{api:?}");
    }
}

#[test]
fn the_newest_user_message_is_never_dropped_for_its_own_loop() {
    for api in APIS {
        let mut steps = vec![
            Step::User("first".into()),
            Step::Assistant(text(1, 400)),
            Step::User("now refactor everything".into()),
        ];
        for i in 0..60 {
            steps.push(Step::Tools(vec![(format!("t{i}"), text(i, 600))]));
        }
        let s = Script {
            system: "sys".into(),
            steps,
            breakpoints: 0,
        };
        let body = render(api, &s, false);
        let need = count(&body) / 3;
        let t = run(api, &body, need).unwrap();
        check_trimmed(api, &body, &t.body).unwrap();
        // Only the first answer could go: over the target, the caller rejects.
        assert!(count(&t.body) > need, "{api:?}");
        assert!(
            String::from_utf8(t.body)
                .unwrap()
                .contains("now refactor everything"),
            "{api:?}"
        );
    }
}

#[test]
fn odd_but_valid_json_is_spliced_faithfully() {
    let big = text(9, 3000);
    let big = serde_json::to_string(&big).unwrap();
    // Escaped key names, whitespace everywhere, a member after the array.
    let body = format!(
        r#" {{ "stream" : true ,
  "m\u0065ssages" : [
    {{ "r\u006fle" : "system" , "content" : "sys" }} ,
    {{"role":"user","content":"first"}},
    {{"role":"assistant","content":null,"tool_calls":[{{"id":"a","type":"function","function":{{"name":"f","arguments":"{{}}"}}}}]}},
    {{"role":"tool","tool_call_id":"a","content":{big}}} ,
    {{"role":"assistant","content":"done"}},
    {{"role":"user","content":"second"}}
  ] ,
  "model" : "gpt-4o" }}
"#
    );
    let body = body.as_bytes();
    let t = run(Api::OpenAiChat, body, count(body) / 2).unwrap();
    check_trimmed(Api::OpenAiChat, body, &t.body).unwrap();
    let s = std::str::from_utf8(&t.body).unwrap();
    assert!(s.starts_with(" { \"stream\" : true ,\n  \"m\\u0065ssages\" : [\n    { \"r\\u006fle\""));
    assert!(s.ends_with("] ,\n  \"model\" : \"gpt-4o\" }\n"), "{s}");
    assert_eq!(t.tool_results, 1);
}

#[test]
fn a_growing_session_moves_its_cut_rarely_and_keeps_its_prefix_otherwise() {
    // The proxy's use: trim only when over the limit, down to trim-to, with
    // the session's last cut kept while it still fits under the limit.
    let (limit, trim_to) = (9_000u64, 6_000u64);
    for api in APIS {
        let mut s = agent_script(1, 1, 800);
        let mut cut = None;
        let mut last: Option<Vec<u8>> = None;
        let (mut moves, mut trimmed) = (0, 0);
        for round in 0..60 {
            s.steps.pop();
            s.steps.push(Step::User(format!(
                "question {round}: {}",
                text(round, 150)
            )));
            s.steps
                .push(Step::Tools(vec![("grep".into(), text(round, 700))]));
            s.steps.push(Step::Assistant(text(round + 1, 500)));
            s.steps.push(Step::User(format!("newest {round}")));
            let body = render(api, &s, false);
            if count(&body) <= limit {
                continue;
            }
            let t = trim_sticky(api, &body, &count, trim_to, limit, cut.as_ref())
                .unwrap_or_else(|| panic!("{api:?} round {round}"));
            check_trimmed(api, &body, &t.body).unwrap();
            assert!(count(&t.body) <= limit, "{api:?} round {round}");
            trimmed += 1;
            if cut.as_ref() == Some(&t.cut) {
                // Same cut: the whole previous forwarded conversation but its
                // newest message is a byte-identical prefix of this one.
                let prev = last.as_ref().unwrap();
                let els = raw_elements(api, prev);
                let (off, _) = &els[els.len() - 1];
                assert_eq!(t.body[..*off], prev[..*off], "{api:?} round {round}");
            } else {
                moves += 1;
            }
            cut = Some(t.cut.clone());
            last = Some(t.body);
        }
        eprintln!("{api:?}: {trimmed} trimmed requests, the cut moved {moves} times");
        assert!(trimmed > 20, "{api:?}: {trimmed}");
        assert!(
            moves * 3 < trimmed,
            "{api:?}: cut moved {moves} times in {trimmed}"
        );
    }
}
