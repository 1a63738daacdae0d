//! The SSE scanner sees a stream in arbitrary chunks: whatever the cuts, it
//! hands on the same events as for the whole stream, and never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidemark::tap::sse::SseScanner;

type Ev = (Option<String>, Vec<u8>);

fn scan(chunks: &[&[u8]]) -> (Vec<Ev>, Option<Ev>, bool) {
    let mut s = SseScanner::new();
    let mut out = Vec::new();
    for c in chunks {
        s.feed(c, &mut |e| out.push((e.name.map(str::to_owned), e.data.to_vec())));
    }
    let overflowed = s.overflowed();
    let last = s
        .finish()
        .map(|e| (e.name.map(str::to_owned), e.data.to_vec()));
    (out, last, overflowed)
}

fuzz_target!(|input: &[u8]| {
    let Some((&seed, data)) = input.split_first() else {
        return;
    };
    let whole = scan(&[data]);
    // Cut every `step` bytes, step from the first byte (1 = bytewise).
    let step = (seed as usize % 17) + 1;
    let chunks: Vec<&[u8]> = data.chunks(step).collect();
    let cut = scan(&chunks);
    assert_eq!(whole, cut, "chunking changed the events (step {step})");
});
