//! The trimmer on arbitrary bodies: when it trims, the body is shorter and
//! still a JSON object the inspector reads (valid for its API); it never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidemark::json::RequestView;
use tidemark::provider::ALL;
use tidemark::policy::trim::trim;

fuzz_target!(|input: &[u8]| {
    let Some((&sel, body)) = input.split_first() else {
        return;
    };
    let p = ALL[sel as usize % ALL.len()];
    let count = |b: &[u8]| b.len() as u64 / 4;
    let need = count(body) * (sel as u64 % 8 + 1) / 10;
    if let Some(t) = trim(p.api(), body, &count, need, None) {
        assert!(t.body.len() < body.len(), "a trim makes the body shorter");
        assert!(
            RequestView::parse(&t.body).is_some(),
            "a trimmed body is still a JSON object"
        );
    }
});
