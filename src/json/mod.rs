//! One JSON module: the request scan ([`RequestView`]: a body read once
//! into borrowed members and messages), the response picker ([`pick`]: the
//! members a provider reads, the rest stepped over), readers of a value
//! already scanned ([`Obj`], [`text`]), and the SIMD they share. It uses
//! nothing else of the crate.

mod pick;
mod simd;
pub mod text;
mod view;

use std::ops::Range;

pub use pick::{content, pick, Node};
pub use view::{Raw, RequestView};

use simd::{block_marks, escaped_by, next_quote_or_escape, prefix_xor};

/// How deep values may nest before the text is refused, as serde_json's
/// recursion limit refuses it.
const MAX_DEPTH: usize = 128;

/// The index of the first byte at or after `i` that is not JSON whitespace.
#[inline]
pub fn skip_ws(b: &[u8], mut i: usize) -> usize {
    // Most calls stand on a value already, or on the one space after a
    // colon; a pretty-printed body's newline and indentation are skipped a
    // block at a time.
    match b.get(i) {
        Some(b' ' | b'\t' | b'\n' | b'\r') => {}
        _ => return i,
    }
    if !matches!(b.get(i + 1), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        return i + 1;
    }
    #[cfg(target_arch = "x86_64")]
    while let Some(v) = simd::lanes::load(b, i) {
        let m = v.not_ws();
        if m != 0 {
            return i + simd::lanes::first(m);
        }
        i += simd::lanes::W;
    }
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = b.get(i) {
        i += 1;
    }
    i
}

/// The end of the JSON number starting at `i` (`-?(0|[1-9][0-9]*)`, then
/// `(\.[0-9]+)?([eE][+-]?[0-9]+)?`), and whether it is an integer; `None`
/// when the grammar is broken (a leading zero, a bare `-`, `.` or `e`).
fn number_end(b: &[u8], mut i: usize) -> Option<(usize, bool)> {
    let digits = |mut j: usize| {
        while b.get(j).is_some_and(u8::is_ascii_digit) {
            j += 1;
        }
        j
    };
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    let end = digits(i);
    // At least one digit, and no leading zero.
    if end == i || (b[i] == b'0' && end > i + 1) {
        return None;
    }
    i = end;
    let mut whole = true;
    if b.get(i) == Some(&b'.') {
        let end = digits(i + 1);
        if end == i + 1 {
            return None;
        }
        i = end;
        whole = false;
    }
    if let Some(b'e' | b'E') = b.get(i) {
        i += 1;
        if let Some(b'+' | b'-') = b.get(i) {
            i += 1;
        }
        let end = digits(i);
        if end == i {
            return None;
        }
        i = end;
        whole = false;
    }
    Some((i, whole))
}

/// Index just past the closing quote of the string opening at `i` (in
/// text whose strings are not checked here), and whether the string holds
/// an escape (which spares a second search of every member name).
#[inline]
pub fn string_end(b: &[u8], i: usize) -> Option<(usize, bool)> {
    let mut j = i + 1;
    let mut escaped = false;
    loop {
        let q = next_quote_or_escape(b, j)?;
        if b[q] == b'"' {
            return Some((q + 1, escaped));
        }
        escaped = true;
        // An escape: step over the backslash and the character it escapes.
        j = q + 2;
    }
}

/// Index just past the quote that closes a string whose bytes continue at
/// `j` (not on an escaped byte).
fn string_rest(b: &[u8], mut j: usize) -> Option<usize> {
    loop {
        let q = next_quote_or_escape(b, j)?;
        if b[q] == b'"' {
            return Some(q + 1);
        }
        j = q + 2;
    }
}

/// Index just past the bracket that closes the one at `i` (a value the
/// provider does not read), its brackets paired by kind and strings
/// stepped over, `depth` deep already.
///
/// simdjson's way, 64 bytes a step: a bit per quote, backslash and
/// bracket; escaped quotes dropped (an odd run of backslashes before
/// them); a prefix XOR of the quotes marks what is inside strings; the
/// brackets outside them are read one by one. The bench's pretty-printed
/// completion steps over its `choices` and `completion_tokens_details`
/// this way a block at a time, rather than stopping at every quote. A string running past a block's end is finished
/// by [`string_end`]'s search (memchr over a long one), and the blocks
/// start again after it.
fn container_end(b: &[u8], i: usize, depth: usize) -> Option<usize> {
    // A bit per open level, set for `{`; the outermost is bit 0 of `nested`.
    let (mut kinds, mut nested) = (0u128, 0u32);
    let mut base = i;
    // Block state carried over: inside a string, after an escaping backslash.
    let (mut inside_carry, mut escape_carry) = (0u64, 0u64);
    loop {
        let (marks, valid) = block_marks(b, base)?;
        let escaped = escaped_by(marks.backslash, &mut escape_carry);
        let quotes = marks.quote & !escaped;
        let inside = prefix_xor(quotes) ^ inside_carry;
        let mut brackets = marks.bracket & !inside & valid;
        while brackets != 0 {
            let at = base + brackets.trailing_zeros() as usize;
            brackets &= brackets - 1;
            match b[at] {
                c @ (b'{' | b'[') => {
                    if depth + nested as usize > MAX_DEPTH {
                        return None;
                    }
                    kinds = kinds << 1 | u128::from(c == b'{');
                    nested += 1;
                }
                c => {
                    if nested == 0 || (kinds & 1 == 1) != (c == b'}') {
                        return None;
                    }
                    kinds >>= 1;
                    nested -= 1;
                    if nested == 0 {
                        return Some(at + 1);
                    }
                }
            }
        }
        if valid != u64::MAX {
            // The text ended inside the value.
            return None;
        }
        base += 64;
        if (inside as i64) < 0 {
            // A string runs on past the block: find its end by search (the
            // byte after an escaping backslash is not its end).
            base = string_rest(b, base + escape_carry as usize)?;
            escape_carry = 0;
        }
        inside_carry = 0;
    }
}

/// The end of the number or literal at `i` (already known to be valid JSON).
fn scalar_end(b: &[u8], i: usize) -> usize {
    i + b[i..]
        .iter()
        .position(|&c| matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
        .unwrap_or(b.len() - i)
}

/// End (exclusive) of the JSON value starting at `i`, in text already
/// scanned (its grammar is not checked again); `None` if it does not close.
pub fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => string_end(b, i).map(|(e, _)| e),
        b'{' | b'[' => container_end(b, i, 0),
        _ => {
            let e = scalar_end(b, i);
            (e > i).then_some(e)
        }
    }
}

/// A JSON object's members in text already scanned: decoded names and the
/// byte range of each value in the text.
pub struct Obj<'a> {
    b: &'a [u8],
    members: Vec<(String, Range<usize>)>,
}

impl<'a> Obj<'a> {
    /// The object whose value starts at `r.start` in `b`; `None` if it is
    /// not an object.
    pub fn parse(b: &'a [u8], r: Range<usize>) -> Option<Obj<'a>> {
        let mut i = skip_ws(b, r.start);
        if b.get(i) != Some(&b'{') {
            return None;
        }
        i = skip_ws(b, i + 1);
        let mut members = Vec::new();
        if b.get(i) == Some(&b'}') {
            return Some(Obj { b, members });
        }
        loop {
            let (ke, escaped) = string_end(b, i)?;
            let key = if escaped {
                serde_json::from_slice(b.get(i..ke)?).ok()?
            } else {
                std::str::from_utf8(b.get(i + 1..ke - 1)?).ok()?.to_owned()
            };
            i = skip_ws(b, ke);
            if b.get(i) != Some(&b':') {
                return None;
            }
            let vs = skip_ws(b, i + 1);
            let ve = value_end(b, vs)?;
            members.push((key, vs..ve));
            i = skip_ws(b, ve);
            match b.get(i)? {
                b',' => i = skip_ws(b, i + 1),
                b'}' => return Some(Obj { b, members }),
                _ => return None,
            }
        }
    }

    /// The value range of the last member named `key` (as serde does).
    pub fn get(&self, key: &str) -> Option<Range<usize>> {
        self.members
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, r)| r.clone())
    }

    /// A string member, decoded; `None` if absent or not a string.
    pub fn str(&self, key: &str) -> Option<String> {
        serde_json::from_slice(self.b.get(self.get(key)?)?).ok()
    }

    /// How many members it has.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

/// The value ranges of a JSON array's elements in text already scanned;
/// `None` if the value at `r.start` is not an array.
pub fn elements(b: &[u8], r: Range<usize>) -> Option<Vec<Range<usize>>> {
    let mut i = skip_ws(b, r.start);
    if b.get(i) != Some(&b'[') {
        return None;
    }
    i = skip_ws(b, i + 1);
    let mut out = Vec::new();
    if b.get(i) == Some(&b']') {
        return Some(out);
    }
    loop {
        let e = value_end(b, i)?;
        out.push(i..e);
        i = skip_ws(b, e);
        match b.get(i)? {
            b',' => i = skip_ws(b, i + 1),
            b']' => return Some(out),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_and_elements_of_scanned_text() {
        let b = br#" { "a" : [1, "x\"]", {"b":null} ] , "c":true, "d\u0065":-1.5e3 }"#;
        let o = Obj::parse(b, 0..b.len()).unwrap();
        assert_eq!(o.len(), 3);
        let els = elements(b, o.get("a").unwrap()).unwrap();
        let texts: Vec<&[u8]> = els.iter().map(|r| &b[r.clone()]).collect();
        assert_eq!(texts, vec![&b"1"[..], br#""x\"]""#, br#"{"b":null}"#]);
        assert_eq!(&b[o.get("c").unwrap()], b"true");
        assert_eq!(&b[o.get("de").unwrap()], b"-1.5e3");
        assert!(Obj::parse(b"[1]", 0..3).is_none());
        assert!(elements(b"{}", 0..2).is_none());
    }

    #[test]
    fn whitespace_is_skipped_across_blocks() {
        for n in 0..70 {
            let mut b = vec![b' '; n];
            b.extend_from_slice(b"\n\t\rx");
            assert_eq!(skip_ws(&b, 0), n + 3, "{n}");
            assert_eq!(skip_ws(&b, n + 3), n + 3);
        }
        assert_eq!(skip_ws(b"  ", 0), 2);
        assert_eq!(skip_ws(b"", 0), 0);
    }
}
