//! Every provider's usage reading through the tap's reader, for every
//! framing and content encoding: never panics, and the chunking of the body
//! does not change what is read.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidemark::provider::{Framing, ALL};
use tidemark::tap::usage::UsageReader;

const ENCODINGS: [Option<&str>; 5] = [None, Some("gzip"), Some("deflate"), Some("br"), Some("zstd")];
const FRAMINGS: [Framing; 3] = [Framing::Sse, Framing::Ndjson, Framing::Json];

fuzz_target!(|input: &[u8]| {
    let Some((&sel, data)) = input.split_first() else {
        return;
    };
    let framing = FRAMINGS[(sel as usize) % 3];
    let encoding = ENCODINGS[(sel as usize / 3) % 5];
    let step = (sel as usize / 15) % 13 + 1;
    for &p in ALL {
        let mut whole = UsageReader::new(p, framing, encoding);
        whole.feed(data);
        let a = whole.finish();
        let mut cut = UsageReader::new(p, framing, encoding);
        for c in data.chunks(step) {
            cut.feed(c);
        }
        let b = cut.finish();
        assert_eq!(
            a.observed,
            b.observed,
            "{}: chunking (step {step}) changed the usage read",
            p.api().as_str()
        );
    }
});
