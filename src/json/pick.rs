//! Pick the members a provider reads out of one JSON text without parsing
//! the rest: the tap's reader of usage.
//!
//! A response body is mostly content the tap never looks at (`choices`,
//! `content`, `candidates`), and a full validating parse of it was the
//! largest single cost of a tapped small request. Here a member whose name the provider does
//! not read is skipped by its structure alone: strings to their closing
//! quote, objects and arrays to their closing bracket (see
//! `container_end`), a scalar read as a number or literal. Kept members
//! are parsed strictly, into the same [`Node`] tree the providers read.
//!
//! What a skipped object or array is not checked for: the grammar inside
//! it (`[1,,2]` or `{"a":}` pass where serde_json would fail). Unbalanced
//! brackets, an unterminated string, a missing `:` or `,` between members,
//! and anything after the value are still errors, so a body cut short or
//! two bodies run together count as a parse error as before.

use super::{container_end, number_end, scalar_end, skip_ws, string_end, MAX_DEPTH};

/// A JSON value as the tap parsed it for a provider: objects hold only the
/// members a provider reads (`Provider::reads`), under those `'static` names, so nothing
/// but kept strings is allocated. Mirrors the parts of `serde_json::Value`'s
/// API the providers use.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Null,
    Bool(bool),
    /// A non-negative integer: every token count.
    Count(u64),
    /// Any other number.
    Number,
    Str(String),
    Obj(Vec<(&'static str, Node)>),
    Arr(Vec<Node>),
}

impl Node {
    /// A member of an object; the last one when repeated, as serde_json does.
    pub fn get(&self, key: &str) -> Option<&Node> {
        match self {
            Node::Obj(m) => m.iter().rev().find(|(k, _)| *k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Node::Count(n) => Some(*n),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Node::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Node::Bool(b) => Some(*b),
            _ => None,
        }
    }
    pub fn is_object(&self) -> bool {
        matches!(self, Node::Obj(_))
    }
    pub fn is_null(&self) -> bool {
        matches!(self, Node::Null)
    }
}

/// The value in `bytes`, holding at every depth only the object members
/// named in `keep` (arrays and kept values whole). `None`: not JSON.
pub fn pick(bytes: &[u8], keep: &'static [&'static str]) -> Option<Node> {
    let mut p = Picker {
        b: bytes,
        i: 0,
        keep,
        lengths: keep.iter().fold(0, |m, k| m | length_bit(k.len())),
    };
    let v = p.value(0)?;
    p.ws();
    (p.i == p.b.len()).then_some(v)
}

struct Picker<'a> {
    b: &'a [u8],
    i: usize,
    keep: &'static [&'static str],
    /// A bit per length of the names in `keep` ([`length_bit`]): most
    /// names a body holds are told apart by their length alone, without
    /// comparing them with each kept name: a response holds many more
    /// names than the provider keeps.
    lengths: u64,
}

/// Lengths 0 to 62 have a bit each; longer ones share the last.
fn length_bit(len: usize) -> u64 {
    1 << len.min(63)
}

impl Picker<'_> {
    fn ws(&mut self) {
        self.i = skip_ws(self.b, self.i);
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        self.ws();
        (self.b.get(self.i) == Some(&c)).then(|| self.i += 1)
    }

    /// A kept value, parsed strictly.
    fn value(&mut self, depth: usize) -> Option<Node> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.ws();
        match *self.b.get(self.i)? {
            b'{' => {
                self.i += 1;
                self.ws();
                if self.b.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Some(Node::Obj(Vec::new()));
                }
                let mut members = Vec::with_capacity(4);
                loop {
                    self.ws();
                    let key = self.key()?;
                    self.eat(b':')?;
                    match key {
                        Some(k) => members.push((k, self.value(depth + 1)?)),
                        None => self.skip(depth + 1)?,
                    }
                    self.ws();
                    match *self.b.get(self.i)? {
                        b',' => self.i += 1,
                        b'}' => {
                            self.i += 1;
                            return Some(Node::Obj(members));
                        }
                        _ => return None,
                    }
                }
            }
            b'[' => {
                self.i += 1;
                let mut items = Vec::new();
                self.ws();
                if self.b.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Some(Node::Arr(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    self.ws();
                    match *self.b.get(self.i)? {
                        b',' => self.i += 1,
                        b']' => {
                            self.i += 1;
                            return Some(Node::Arr(items));
                        }
                        _ => return None,
                    }
                }
            }
            b'"' => {
                let start = self.i;
                let escaped;
                (self.i, escaped) = string_end(self.b, start)?;
                let raw = &self.b[start..self.i];
                let s = if escaped {
                    serde_json::from_slice::<String>(raw).ok()?
                } else {
                    let s = std::str::from_utf8(&raw[1..raw.len() - 1]).ok()?;
                    // Control characters must be escaped in JSON.
                    if s.bytes().any(|c| c < 0x20) {
                        return None;
                    }
                    s.to_owned()
                };
                Some(Node::Str(s))
            }
            b't' => self.literal(b"true", Node::Bool(true)),
            b'f' => self.literal(b"false", Node::Bool(false)),
            b'n' => self.literal(b"null", Node::Null),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn literal(&mut self, word: &[u8], node: Node) -> Option<Node> {
        let end = self.i + word.len();
        (self.b.get(self.i..end)? == word).then(|| {
            self.i = end;
            node
        })
    }

    /// A number as serde_json reads it: a non-negative integer that fits
    /// u64 is a count; a negative one, a fraction, an exponent or an
    /// integer past u64 is some other number.
    fn number(&mut self) -> Option<Node> {
        let start = self.i;
        let (end, whole) = number_end(self.b, start)?;
        self.i = end;
        if !whole || self.b[start] == b'-' {
            // Negative integers, -0 among them (serde_json reads it as a float).
            return Some(Node::Number);
        }
        // Digits only (number_end checked them): summed in place, without
        // a UTF-8 check and a second pass of `str::parse`.
        let count = self.b[start..end].iter().try_fold(0u64, |n, &d| {
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        });
        Some(count.map_or(Node::Number, Node::Count))
    }

    /// A member name: which of `keep` it is, if any.
    fn key(&mut self) -> Option<Option<&'static str>> {
        if self.b.get(self.i) != Some(&b'"') {
            return None;
        }
        let start = self.i;
        let escaped;
        (self.i, escaped) = string_end(self.b, start)?;
        let raw = &self.b[start + 1..self.i - 1];
        if !escaped {
            if self.lengths & length_bit(raw.len()) == 0 {
                return Some(None);
            }
            return Some(self.keep.iter().copied().find(|k| k.as_bytes() == raw));
        }
        // An escaped name is compared as what it stands for; one that does
        // not decode is no name the provider reads.
        let name: Option<String> = serde_json::from_slice(&self.b[start..self.i]).ok();
        Some(name.and_then(|n| self.keep.iter().copied().find(|k| *k == n)))
    }

    /// Step over a value the provider does not read, by its structure.
    fn skip(&mut self, depth: usize) -> Option<()> {
        self.ws();
        let b = self.b;
        match *b.get(self.i)? {
            b'{' | b'[' => {
                self.i = container_end(b, self.i, depth)?;
                Some(())
            }
            b'"' => {
                self.i = string_end(b, self.i)?.0;
                Some(())
            }
            // A scalar: a number or a literal, checked as a kept one is (it
            // must not step over a quote the container skip would count).
            b't' => self.literal(b"true", Node::Null).map(drop),
            b'f' => self.literal(b"false", Node::Null).map(drop),
            b'n' => self.literal(b"null", Node::Null).map(drop),
            _ => {
                self.i = number_end(b, self.i)?.0;
                Some(())
            }
        }
    }
}
/// Feed `feed` the JSON value `b` (already known to be valid) without any
/// object member named `drop`, at any depth, and without the separator
/// that joined it to its neighbours: what a client that moves such a
/// marker from message to message (Anthropic's `cache_control`) sends for
/// the same value without it, as long as it lays values out the same way.
/// The rest goes out as written, in runs: a value without the member is
/// one call. `None`: a string or bracket that does not close (the caller
/// then uses the raw bytes).
pub fn content(b: &[u8], drop: &[u8], feed: &mut impl FnMut(&[u8])) -> Option<()> {
    // Bytes from `run` on are not fed yet; `end` is where the last value
    // ended; `kept`: a member of the innermost open object was kept (a
    // dropped one then takes the separator before it, else the one after).
    let (mut i, mut run, mut end, mut kept) = (0, 0, 0, false);
    while let Some(&c) = b.get(i) {
        match c {
            b'"' => {
                let (close, _) = string_end(b, i)?;
                let colon = skip_ws(b, close);
                if b.get(colon) != Some(&b':') {
                    // A string value.
                    i = close;
                    end = close;
                    continue;
                }
                if &b[i + 1..close - 1] != drop {
                    kept = true;
                    i = close;
                    continue;
                }
                let v = skip_ws(b, colon + 1);
                let vend = match *b.get(v)? {
                    b'{' | b'[' => container_end(b, v, 0)?,
                    b'"' => string_end(b, v)?.0,
                    _ => scalar_end(b, v),
                };
                if kept {
                    // `, "drop": …` goes from the end of the member before.
                    feed(&b[run..end]);
                    run = vend;
                    i = vend;
                } else {
                    // `"drop": …, ` goes up to the next member's name.
                    feed(&b[run..i]);
                    let mut next = skip_ws(b, vend);
                    if b.get(next) == Some(&b',') {
                        next = skip_ws(b, next + 1);
                    }
                    run = next;
                    i = next;
                }
            }
            b'{' => {
                kept = false;
                i += 1;
            }
            b'}' | b']' => {
                // Back in the member (or element) that holds this value.
                kept = true;
                i += 1;
                end = i;
            }
            b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
                i = scalar_end(b, i);
                end = i;
            }
            _ => i += 1,
        }
    }
    feed(&b[run..]);
    Some(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    #[cfg(target_arch = "x86_64")]
    use crate::json::simd::sse2;
    use crate::json::simd::{escaped_by, swar, Marks};
    use crate::provider::Api;
    use serde::de::DeserializeSeed;

    /// The reference: what the tap read before, serde_json's validating
    /// parse keeping the same members.
    fn strict(bytes: &[u8], keep: &'static [&'static str]) -> Option<Node> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let v = Filter(keep).deserialize(&mut de).ok()?;
        de.end().ok()?;
        Some(v)
    }

    #[derive(Clone, Copy)]
    struct Filter(&'static [&'static str]);

    impl<'de> serde::de::DeserializeSeed<'de> for Filter {
        type Value = Node;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> serde::de::Visitor<'de> for Filter {
        type Value = Node;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
            let mut m = Vec::new();
            while let Some(key) = map.next_key::<String>()? {
                match self.0.iter().copied().find(|k| *k == key) {
                    None => {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                    Some(k) => m.push((k, map.next_value_seed(self)?)),
                }
            }
            Ok(Node::Obj(m))
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
            let mut v = Vec::new();
            while let Some(e) = seq.next_element_seed(self)? {
                v.push(e);
            }
            Ok(Node::Arr(v))
        }
        fn visit_bool<E>(self, b: bool) -> Result<Node, E> {
            Ok(Node::Bool(b))
        }
        fn visit_i64<E>(self, n: i64) -> Result<Node, E> {
            Ok(u64::try_from(n).map_or(Node::Number, Node::Count))
        }
        fn visit_u64<E>(self, n: u64) -> Result<Node, E> {
            Ok(Node::Count(n))
        }
        fn visit_f64<E>(self, _: f64) -> Result<Node, E> {
            Ok(Node::Number)
        }
        fn visit_str<E>(self, s: &str) -> Result<Node, E> {
            Ok(Node::Str(s.to_owned()))
        }
        fn visit_unit<E>(self) -> Result<Node, E> {
            Ok(Node::Null)
        }
    }

    #[test]
    fn every_fixture_reads_the_same_as_a_full_parse() {
        let mut seen = 0;
        for api in [
            Api::OpenAiChat,
            Api::OpenAiResponses,
            Api::Anthropic,
            Api::Gemini,
            Api::Ollama,
        ] {
            let keep = api.provider().reads();
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
            for entry in walk(&dir) {
                let text = std::fs::read(&entry).unwrap();
                // Whole documents, NDJSON lines and SSE data lines alike.
                let mut pieces: Vec<&[u8]> = vec![&text];
                for line in text.split(|&c| c == b'\n') {
                    pieces.push(line.strip_prefix(b"data: ").unwrap_or(line));
                }
                for piece in pieces {
                    let want = strict(piece, keep);
                    if want.is_some() {
                        seen += 1;
                    }
                    assert_eq!(pick(piece, keep), want, "{}", entry.display());
                }
            }
        }
        assert!(seen > 100, "only {seen} JSON texts in the fixtures");
    }

    fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
        out
    }

    #[test]
    fn kept_values_are_parsed_strictly_and_the_rest_structurally() {
        let keep: &'static [&'static str] = &["usage", "n", "s"];
        let ok = |t: &str| pick(t.as_bytes(), keep);
        // Kept values: the same as serde_json.
        for t in [
            r#"{"n":0}"#,
            r#"{"n":-0}"#,
            r#"{"n":18446744073709551615}"#,
            r#"{"n":18446744073709551616}"#,
            r#"{"n":-3}"#,
            r#"{"n":1.5e3}"#,
            r#"{"n":1E-2}"#,
            r#"{"s":"a\"b\\c\u00e9\ud83d\ude00"}"#,
            r#"{"us\u0061ge":{"n":7}}"#,
            r#" [ {"n" : 1 } , {"x":[{"n":2}]} , null , true ] "#,
            r#"{"usage":{"n":1},"usage":{"n":2}}"#,
        ] {
            assert_eq!(ok(t), strict(t.as_bytes(), keep), "{t}");
            assert!(ok(t).is_some(), "{t}");
        }
        // Errors in kept values, or in the structure anywhere.
        for t in [
            r#"{"n":01}"#,
            r#"{"n":1.}"#,
            r#"{"n":-}"#,
            r#"{"n":1e}"#,
            r#"{"n":tru}"#,
            "{\"s\":\"a\tb\"}",
            r#"{"s":"\x"}"#,
            r#"{"n":1"#,
            r#"{"x":[1,2}"#,
            r#"{"x":{"y":"}"}"#,
            r#"{"x":"unterminated}"#,
            r#"{"x":1 "n":2}"#,
            r#"{"x" 1}"#,
            r#"{"n":1} {"n":2}"#,
            r#"{"n":1},"#,
            r#"{"x":}"#,
            "",
            "   ",
        ] {
            assert_eq!(ok(t), None, "{t}");
        }
        // What is skipped is checked for structure only.
        assert_eq!(
            ok(r#"{"x":[1,,2],"n":3}"#),
            Some(Node::Obj(vec![("n", Node::Count(3))]))
        );
        // Long strings (past the word-at-a-time part), escapes at every offset.
        for pad in 0..80 {
            let x = "a".repeat(pad);
            let t = format!(r#"{{"x":"{x}\"]}}[","s":"{x}\"{x}","n":{pad}}}"#);
            assert_eq!(ok(&t), strict(t.as_bytes(), keep), "{t}");
            assert!(ok(&t).is_some(), "{t}");
            let cut = format!(r#"{{"x":"{x}\"}}"#);
            assert_eq!(ok(&cut), None, "{cut}");
            let brackets = format!(r#"{{"x":[{x:?},{{"y":[[{x:?}]]}}],"n":1}}"#);
            assert_eq!(
                ok(&brackets),
                strict(brackets.as_bytes(), keep),
                "{brackets}"
            );
        }
        // Escaped quotes and brackets inside skipped strings.
        assert_eq!(
            ok(r#"{"x":{"y":"a\"]}\\","z":["}"]},"n":4}"#),
            Some(Node::Obj(vec![("n", Node::Count(4))]))
        );
    }

    /// Any JSON value, its strings and names rich in what a scanner trips on.
    pub(crate) fn any_json() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (-1e9f64..1e9).prop_map(Value::from),
            "[a-z\"\\\\/{}\\[\\],:\u{e9}\u{1F600}\n\t\u{1} ]{0,40}".prop_map(Value::String),
        ];
        let key = prop_oneof![
            Just("usage".to_string()),
            Just("n".to_string()),
            Just("s".to_string()),
            "[a-z\"\\\\{}\\[\\] ]{0,10}",
        ];
        leaf.prop_recursive(6, 96, 8, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
                proptest::collection::vec((key.clone(), inner), 0..8)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
        /// Any JSON, compact or pretty: read exactly as the serde reader
        /// reads it; any cut short before its last byte: refused (an
        /// object or array cannot end early); any one byte changed: never
        /// read differently from serde when serde accepts it.
        #[test]
        fn any_json_reads_as_serde_reads_it(
            v in any_json(),
            pretty in proptest::prelude::any::<bool>(),
            cut in proptest::prelude::any::<proptest::sample::Index>(),
            at in proptest::prelude::any::<proptest::sample::Index>(),
            byte in proptest::prelude::any::<u8>(),
        ) {
            let keep: &'static [&'static str] = &["usage", "n", "s"];
            let text = if pretty {
                serde_json::to_vec_pretty(&v).unwrap()
            } else {
                serde_json::to_vec(&v).unwrap()
            };
            let want = strict(&text, keep);
            proptest::prop_assert!(want.is_some());
            proptest::prop_assert_eq!(pick(&text, keep), want);
            if v.is_object() || v.is_array() {
                let short = &text[..cut.index(text.len())];
                proptest::prop_assert_eq!(pick(short, keep), None);
            }
            let mut changed = text.clone();
            changed[at.index(text.len())] = byte;
            if let Some(w) = strict(&changed, keep) {
                proptest::prop_assert_eq!(pick(&changed, keep), Some(w));
            }
        }
    }

    /// A block's marks agree with the byte-by-byte definition, for every
    /// byte value at every place in the block and every byte behind it (a
    /// later mark must not hide the first; a false mark may only sit above
    /// a true one): the eight-byte words (any target) and, on x86_64, the
    /// SSE2 blocks.
    #[test]
    fn blocks_mark_the_first_byte_of_each_kind() {
        // The bytes a scan stops at; the block's first mark, if any.
        type Kind = (usize, fn(u8) -> bool, fn(&[u8]) -> Option<usize>);
        let quote_or_escape = |c| c == b'"' || c == b'\\';
        let mut kinds: Vec<Kind> = vec![(8, quote_or_escape, |b| {
            let m = swar::load(b, 0)?.quote_or_escape();
            (m != 0).then(|| swar::first(m))
        })];
        #[cfg(target_arch = "x86_64")]
        kinds.extend::<[Kind; 2]>([
            (16, quote_or_escape, |b| {
                let m = sse2::load(b, 0)?.quote_or_escape();
                (m != 0).then(|| sse2::first(m))
            }),
            (
                16,
                |c| !matches!(c, b' ' | b'\t' | b'\n' | b'\r'),
                |b| {
                    let m = sse2::load(b, 0)?.not_ws();
                    (m != 0).then(|| sse2::first(m))
                },
            ),
        ]);
        for (width, hit, block) in kinds {
            for filler in [b'a', b' '] {
                for at in 0..width {
                    for byte in 0..=255u8 {
                        for behind in [b'a', b'"', b'{', b']', b'\\', b' ', b'\n', 0x80, 0xff] {
                            let mut b = vec![filler; width];
                            b[at] = byte;
                            b[at + 1..].fill(behind);
                            let want = b.iter().position(|&c| hit(c));
                            assert_eq!(
                                block(&b),
                                want,
                                "width {width}, {byte:#x} at {at} in {filler:#x}, {behind:#x} behind"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The scanners read a block at a time and the last bytes one by one:
    /// every length of whitespace, string and skipped member around the
    /// block's size, ending anywhere relative to the body's end, reads as
    /// serde reads it, and so does every cut of it.
    #[test]
    fn block_edges_read_as_serde_reads_them() {
        let keep = Api::OpenAiChat.provider().reads();
        let mut bodies = 0;
        for ws in [0, 1, 7, 8, 15, 16, 17, 31, 33] {
            for len in [0, 1, 7, 8, 15, 16, 17, 63, 64, 65, 80] {
                let pad = " \n\t\r".repeat(ws).chars().take(ws).collect::<String>();
                let text = "x".repeat(len);
                let escaped = format!("{}\\\"{}", "y".repeat(len / 2), "z".repeat(len / 2));
                let body = format!(
                    "{pad}{{{pad}\"skipped\"{pad}:{pad}[\"{text}\",{{\"{escaped}\":[{pad}]}}]{pad},\
                     \"usage\":{{\"prompt_tokens\":{len},\"error\":\"{text}\",\"cached_tokens\":\"{escaped}\"}}{pad}}}{pad}"
                );
                let want = strict(body.as_bytes(), keep);
                assert!(want.is_some(), "{body:?}");
                assert_eq!(pick(body.as_bytes(), keep), want, "{body:?}");
                for cut in 0..body.len() {
                    let b = &body.as_bytes()[..cut];
                    assert_eq!(pick(b, keep), strict(b, keep), "{:?}", &body[..cut]);
                }
                bodies += 1;
            }
        }
        assert_eq!(bodies, 99);
    }

    /// The skip's escape scan against its byte-by-byte definition: every
    /// run of backslashes, before a quote or not, ending at every place
    /// around the 64-byte blocks' edges, in strings that end in the block,
    /// run past it or start in it, reads as serde reads it; so does every
    /// cut of it, and the scan itself matches the definition on every
    /// carry and a spread of bit patterns.
    #[test]
    fn skipped_escapes_and_strings_read_as_serde_reads_them() {
        let keep: &'static [&'static str] = &["n"];
        let mut bodies = 0;
        for lead in [0, 1, 30, 58, 61, 62, 63, 64, 65, 120, 190] {
            for run in 0..5 {
                for tail in ["", "\\\"", "]}[{", "x\\\\"] {
                    // Escaped backslashes (2 raw each), then what follows.
                    let inner = format!("{}{}{tail}", "a".repeat(lead), "\\\\".repeat(run));
                    let body = format!(
                        r#"{{"x":[{{"y":"{inner}"}},["{inner}",[]],"{inner}{inner}"],"n":{lead}}}"#
                    );
                    let want = strict(body.as_bytes(), keep);
                    assert!(want.is_some(), "{body}");
                    assert_eq!(pick(body.as_bytes(), keep), want, "{body}");
                    for cut in (0..body.len()).step_by(3) {
                        let b = &body.as_bytes()[..cut];
                        assert_eq!(pick(b, keep), None, "{}", &body[..cut]);
                    }
                    bodies += 1;
                }
            }
        }
        assert_eq!(bodies, 11 * 5 * 4);

        // The definition: a byte is escaped when an odd run of backslashes
        // ends right before it (a run may start in the previous block).
        let reference = |bits: u64, carry: u64| {
            let (mut escaped, mut odd) = (0u64, carry == 1);
            for k in 0..64 {
                if odd {
                    escaped |= 1 << k;
                    odd = false;
                } else if bits >> k & 1 == 1 {
                    odd = true;
                }
            }
            (escaped, u64::from(odd))
        };
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for n in 0..20_000u64 {
            // Dense and sparse patterns, long runs among them.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let bits = match n % 4 {
                0 => x,
                1 => x | x >> 1 | x >> 2,
                2 => x & x >> 1,
                _ => !(1u64 << (n % 64)),
            };
            for carry in [0, 1] {
                let mut c = carry;
                let got = escaped_by(bits, &mut c);
                assert_eq!(
                    (got, c),
                    reference(bits, carry),
                    "{bits:#066b} carry {carry}"
                );
            }
        }
    }

    /// The SSE2 64-byte marks agree with the byte-by-byte ones for every
    /// byte value at every place, over fillers that are and are not marked.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn block_marks_are_the_bytes_marks() {
        let bits = |m: Marks| (m.quote, m.backslash, m.bracket);
        for filler in [b'a', b'"', b'\\', b'[', b'}', 0x80] {
            for at in 0..64 {
                for byte in 0..=255u8 {
                    let mut block = [filler; 64];
                    block[at] = byte;
                    assert_eq!(
                        bits(sse2::marks64(&block)),
                        bits(swar::marks64(&block)),
                        "{byte:#x} at {at} in {filler:#x}"
                    );
                }
            }
        }
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let keep: &'static [&'static str] = &["a"];
        let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(pick(deep.as_bytes(), keep), None);
        // Nor is skipped nesting past the limit, as serde_json refuses it.
        let skipped = format!("{{\"x\":{}1{}}}", "[".repeat(200), "]".repeat(200));
        assert_eq!(pick(skipped.as_bytes(), keep), None);
        let fine = format!("{{\"x\":{}1{}}}", "[".repeat(100), "]".repeat(100));
        assert_eq!(pick(fine.as_bytes(), keep), Some(Node::Obj(vec![])));
    }

    /// What [`content`] feeds, joined.
    fn fed(b: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        content(b, b"cache_control", &mut |run: &[u8]| {
            out.extend_from_slice(run)
        })
        .expect("valid JSON");
        out
    }

    /// `v` with a `cache_control` member in every object that has members
    /// (an object of nothing but the marker is written `{}` without it by
    /// no serialiser), its value of a kind chosen by depth.
    fn with_marker(v: &serde_json::Value, depth: usize) -> serde_json::Value {
        use serde_json::{json, Value};
        match v {
            Value::Object(m) => {
                let mut m: serde_json::Map<String, Value> = m
                    .iter()
                    .map(|(k, v)| (k.clone(), with_marker(v, depth + 1)))
                    .collect();
                if m.is_empty() {
                    return Value::Object(m);
                }
                let marker = match depth % 4 {
                    0 => json!({"type": "ephemeral", "ttl": "5m"}),
                    1 => json!("ephemeral"),
                    2 => json!(1.5e3),
                    _ => json!([{"x": null}, true]),
                };
                m.insert("cache_control".into(), marker);
                Value::Object(m)
            }
            Value::Array(a) => Value::Array(a.iter().map(|v| with_marker(v, depth + 1)).collect()),
            v => v.clone(),
        }
    }

    #[test]
    fn content_drops_the_marker_and_its_separator() {
        let cases: &[(&str, &str)] = &[
            (r#"{"a":1}"#, r#"{"a":1}"#),
            (
                r#"{"cache_control":{"type":"ephemeral"},"a":1}"#,
                r#"{"a":1}"#,
            ),
            (r#"{"a":1,"cache_control":{}}"#, r#"{"a":1}"#),
            (r#"{"a":1,"cache_control":{},"b":2}"#, r#"{"a":1,"b":2}"#),
            (
                r#"{"cache_control":1,"cache_control":"x","a":[1, 2]}"#,
                r#"{"a":[1, 2]}"#,
            ),
            (
                "{\n  \"a\": 1,\n  \"cache_control\": {\n    \"t\": [1]\n  },\n  \"b\": \"x y\"\n}",
                "{\n  \"a\": 1,\n  \"b\": \"x y\"\n}",
            ),
            (
                "{\n  \"cache_control\": null,\n  \"b\": true\n}",
                "{\n  \"b\": true\n}",
            ),
            (
                "{\n  \"b\": {\"x\": 1},\n  \"cache_control\": -1.5e3\n}",
                "{\n  \"b\": {\"x\": 1}\n}",
            ),
            // A value or element that says the name is kept.
            (
                r#"{"text":"cache_control","l":["cache_control"]}"#,
                r#"{"text":"cache_control","l":["cache_control"]}"#,
            ),
            (
                r#"[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}, {"k":"\"cache_control\":1"}]"#,
                r#"[{"type":"text","text":"hi"}, {"k":"\"cache_control\":1"}]"#,
            ),
            (r#""plain string""#, r#""plain string""#),
            (" 12 ", " 12 "),
        ];
        for (input, want) in cases {
            assert_eq!(
                String::from_utf8(fed(input.as_bytes())).unwrap(),
                *want,
                "{input}"
            );
        }
        // Not JSON that closes: the caller falls back to the raw bytes.
        assert!(content(br#"{"a":"x"#, b"cache_control", &mut |_: &[u8]| {}).is_none());
    }

    proptest::proptest! {
        /// Any value with markers anywhere, compact or pretty, feeds what
        /// the same serialiser writes of the value without them.
        #[test]
        fn content_is_the_value_as_written_without_markers(v in any_json()) {
            let marked = with_marker(&v, 0);
            for (text, want) in [
                (serde_json::to_vec(&marked).unwrap(), serde_json::to_vec(&v).unwrap()),
                (
                    serde_json::to_vec_pretty(&marked).unwrap(),
                    serde_json::to_vec_pretty(&v).unwrap(),
                ),
            ] {
                let got = fed(&text);
                proptest::prop_assert_eq!(
                    String::from_utf8_lossy(&got),
                    String::from_utf8_lossy(&want)
                );
            }
        }
    }
}
