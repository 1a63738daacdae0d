//! Instructions of one `pick` (the tap's reader of a JSON body) over the
//! bench's 815-byte pretty-printed OpenAI completion, counted by callgrind,
//! which counts the same on a busy machine as on a quiet one:
//!
//!     cargo build --release --example pick_instructions
//!     for n in 1000 2000; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!         target/release/examples/pick_instructions $n 2>&1 | grep refs; done
//!
//! The difference of the two totals over 1000 is one pick.
use tidemark::provider::Api;

fn main() {
    let body = include_bytes!("../tests/fixtures/openai-chat/nonstream_basic.json");
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1000);
    let keep = Api::OpenAiChat.provider().reads();
    let read = (0..n)
        .filter(|_| tidemark::json::pick(std::hint::black_box(body), keep).is_some())
        .count();
    println!("{read} of {n} read");
}
