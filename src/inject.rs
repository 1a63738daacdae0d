//! STUB: usage injection for OpenAI chat streams.
use bytes::BytesMut;

use crate::inspect::RequestView;

pub fn inject_include_usage(_body: &[u8], _req: &RequestView<'_>) -> Option<Vec<u8>> {
    None
}

pub fn mentions_stream_options(body: &[u8]) -> bool {
    memchr::memmem::find(body, b"stream_options").is_some()
}

#[derive(Default)]
pub struct UsageStripper;

impl UsageStripper {
    pub fn new() -> Self {
        UsageStripper
    }
    pub fn push(&mut self, chunk: &[u8], out: &mut BytesMut) {
        out.extend_from_slice(chunk);
    }
    pub fn finish(&mut self, _out: &mut BytesMut) {}
}
