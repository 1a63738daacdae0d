//! STUB: incremental SSE scanner.
