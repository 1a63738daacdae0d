//! The request inspector on arbitrary bodies: parse, then let every provider
//! read the view (model, stream, output cap, continuation) and estimate it.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tidemark::estimate::Estimator;
use tidemark::json::RequestView;
use tidemark::provider::ALL;

const PATHS: [&str; 5] = [
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1beta/models/gemini-2.5-flash:streamGenerateContent",
    "/api/chat",
];

fn estimator() -> &'static Estimator {
    static E: OnceLock<Estimator> = OnceLock::new();
    E.get_or_init(|| Estimator::new(1 << 20))
}

fuzz_target!(|data: &[u8]| {
    let Some(view) = RequestView::parse(data) else {
        return;
    };
    for (&p, path) in ALL.iter().zip(PATHS) {
        let model = p.model(path, &view);
        let _ = p.is_stream(path, Some("alt=sse"), &view);
        let _ = p.max_output_tokens(&view);
        let _ = p.continues(&view);
        let e = estimator().estimate(p, &view, model.as_deref());
        assert!(e.tokens <= data.len() as u64 * 4 + 1_000_000, "estimate out of bounds");
        for (name, raw) in view.fields() {
            let span = view.span(raw);
            assert_eq!(&data[span], raw.get().as_bytes(), "{name}: span is the raw slice");
        }
    }
});
