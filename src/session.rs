//! STUB: sessions, anchors, projection.
