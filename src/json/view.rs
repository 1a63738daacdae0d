//! Read a request body once into a borrowed view: the top-level fields as raw
//! JSON slices, so that a 400 KB history is scanned, not copied, and each
//! message can be hashed by its exact bytes.

use std::borrow::Cow;
use std::ops::Range;

use serde::de::DeserializeOwned;

use super::simd::{Block, Native};

/// The raw JSON text of one value, a slice of the body it came from,
/// checked as valid JSON when the body was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Raw<'a>(&'a str);

impl<'a> Raw<'a> {
    /// The value's text, exactly as it is in the body.
    pub fn get(self) -> &'a str {
        self.0
    }
}

/// A JSON object request body, its top-level members kept as raw slices of
/// `body` in their original order, and the elements of those that are
/// arrays (a history's messages), found by the same scan.
pub struct RequestView<'a> {
    pub body: &'a [u8],
    fields: Vec<Member<'a>>,
    /// Every top-level array's elements, member after member.
    elements: Vec<Raw<'a>>,
}

/// One top-level member.
struct Member<'a> {
    name: Cow<'a, str>,
    value: Raw<'a>,
    /// Its elements in `RequestView::elements`, when it is an array.
    elements: Option<(u32, u32)>,
}

/// A member name, borrowed from the body unless it has escapes (serde's own
/// `Cow<str>` always copies).
struct Key<'a>(Cow<'a, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a member name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

impl<'a> RequestView<'a> {
    /// `None` when the body is not a JSON object: such a request is forwarded
    /// untouched and carries no projection.
    pub fn parse(body: &'a [u8]) -> Option<Self> {
        // UTF-8 checked once for the whole body (SIMD), then the JSON by
        // its grammar alone (see [`members`]).
        let text = simdutf8::basic::from_utf8(body).ok()?;
        let mut elements = Vec::with_capacity(8);
        let fields = members(text, &mut elements)?;
        Some(RequestView {
            body,
            fields,
            elements,
        })
    }

    fn member(&self, name: &str) -> Option<&Member<'a>> {
        // The last one, if repeated, as serde does.
        self.fields.iter().rev().find(|m| m.name == name)
    }

    /// The raw JSON of a top-level member (the last one, if repeated, as serde does).
    pub fn raw(&self, name: &str) -> Option<Raw<'a>> {
        self.member(name).map(|m| m.value)
    }

    /// The elements of a top-level array member, as raw slices; `None` when
    /// the member is absent or not an array.
    pub fn elements(&self, name: &str) -> Option<&[Raw<'a>]> {
        let (from, to) = self.member(name)?.elements?;
        Some(&self.elements[from as usize..to as usize])
    }

    /// A top-level member parsed into `T`; `None` if absent or of another type.
    pub fn get<T: DeserializeOwned>(&self, name: &str) -> Option<T> {
        serde_json::from_str(self.raw(name)?.get()).ok()
    }

    /// A string member, borrowed when it has no escapes.
    pub fn str(&self, name: &str) -> Option<Cow<'a, str>> {
        let raw = self.raw(name)?;
        serde_json::from_str::<Key<'a>>(raw.get()).ok().map(|k| k.0)
    }

    /// Top-level members in order.
    pub fn fields(&self) -> impl Iterator<Item = (&str, Raw<'a>)> + '_ {
        self.fields.iter().map(|m| (m.name.as_ref(), m.value))
    }

    /// Byte range of a raw slice within `body`.
    pub fn span(&self, raw: Raw<'_>) -> Range<usize> {
        let start = raw.get().as_ptr() as usize - self.body.as_ptr() as usize;
        start..start + raw.get().len()
    }
}

/// The members of the JSON object `text`, each value's raw slice kept
/// (and each element of an array value, into `elements`), or `None` when
/// `text` is not one. It accepts exactly what serde_json accepted when it
/// read the body into `&RawValue` members (the tests below hold it to
/// that), in one scan that also finds a history's messages: validating
/// and splitting a long history had been two passes over it. Strings are
/// searched eight bytes at a time for a quote, backslash or control
/// character, and nesting is kept on a stack of its own, unbounded as
/// serde's is inside a raw value.
fn members<'a>(text: &'a str, elements: &mut Vec<Raw<'a>>) -> Option<Vec<Member<'a>>> {
    let mut s = Scan {
        text,
        b: text.as_bytes(),
        i: 0,
        open: Vec::with_capacity(16),
    };
    let mut out = Vec::with_capacity(16);
    s.ws();
    s.eat(b'{')?;
    s.ws();
    if s.b.get(s.i) == Some(&b'}') {
        s.i += 1;
    } else {
        loop {
            s.ws();
            let at = s.i;
            if s.b.get(at) != Some(&b'"') {
                return None;
            }
            let escaped = s.string()?;
            let name = match escaped {
                // An escaped name is decoded as serde decodes a `&str` (a
                // lone surrogate is an error there, unlike in a value).
                true => Cow::Owned(serde_json::from_str::<String>(&text[at..s.i]).ok()?),
                false => Cow::Borrowed(&text[at + 1..s.i - 1]),
            };
            s.ws();
            s.eat(b':')?;
            s.ws();
            let start = s.i;
            let from = elements.len() as u32;
            let array = s.b.get(start) == Some(&b'[');
            s.value(array.then_some(&mut *elements))?;
            out.push(Member {
                name,
                value: Raw(&text[start..s.i]),
                elements: array.then_some((from, elements.len() as u32)),
            });
            s.ws();
            match *s.b.get(s.i)? {
                b',' => s.i += 1,
                b'}' => {
                    s.i += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    s.ws();
    (s.i == s.b.len()).then_some(out)
}

/// A strict JSON scanner over a body already known to be UTF-8.
struct Scan<'a> {
    text: &'a str,
    b: &'a [u8],
    i: usize,
    /// Brackets open around the value being read (`{` or `[`).
    open: Vec<u8>,
}

impl<'a> Scan<'a> {
    fn ws(&mut self) {
        self.i = super::skip_ws(self.b, self.i);
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.b.get(self.i) == Some(&c)).then(|| self.i += 1)
    }

    /// One value, nested to any depth, without recursion. `elements`: the
    /// value is an array whose elements are wanted there.
    fn value(&mut self, mut elements: Option<&mut Vec<Raw<'a>>>) -> Option<()> {
        self.open.clear();
        let mut element = 0;
        loop {
            // A value starts here.
            self.ws();
            if self.open.len() == 1 {
                element = self.i;
            }
            match *self.b.get(self.i)? {
                c @ (b'{' | b'[') => {
                    self.i += 1;
                    self.ws();
                    let close = if c == b'{' { b'}' } else { b']' };
                    if self.b.get(self.i) == Some(&close) {
                        self.i += 1;
                    } else {
                        self.open.push(c);
                        if c == b'{' {
                            self.member_name()?;
                        }
                        continue;
                    }
                }
                b'"' => {
                    self.string()?;
                }
                b't' => self.literal(b"true")?,
                b'f' => self.literal(b"false")?,
                b'n' => self.literal(b"null")?,
                b'-' | b'0'..=b'9' => self.number()?,
                _ => return None,
            }
            // A value ended: close what it ends, or go on to the next.
            loop {
                if self.open.len() == 1 {
                    if let Some(e) = elements.as_deref_mut() {
                        e.push(Raw(&self.text[element..self.i]));
                    }
                }
                let Some(&top) = self.open.last() else {
                    return Some(());
                };
                self.ws();
                match (*self.b.get(self.i)?, top) {
                    (b',', _) => {
                        self.i += 1;
                        if top == b'{' {
                            self.ws();
                            self.member_name()?;
                        }
                        break;
                    }
                    (b']', b'[') | (b'}', b'{') => {
                        self.i += 1;
                        self.open.pop();
                    }
                    _ => return None,
                }
            }
        }
    }

    /// A member name inside a value and its colon.
    fn member_name(&mut self) -> Option<()> {
        if self.b.get(self.i) != Some(&b'"') {
            return None;
        }
        self.string()?;
        self.ws();
        self.eat(b':')
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.i + word.len();
        (self.b.get(self.i..end)? == word).then(|| self.i = end)
    }

    fn number(&mut self) -> Option<()> {
        self.i = super::number_end(self.b, self.i)?.0;
        Some(())
    }

    /// A string from its opening quote: no raw control characters, only
    /// JSON's escapes (`\u` with four hex digits, which a raw value does
    /// not decode). Returns whether it had an escape.
    fn string(&mut self) -> Option<bool> {
        self.string_in::<Native>()
    }

    /// [`Scan::string`] a block of `B::W` bytes at a time.
    fn string_in<B: Block>(&mut self) -> Option<bool> {
        let b = self.b;
        let mut i = self.i + 1;
        let mut escaped = false;
        'blocks: loop {
            let Some(w) = b.get(i..i + B::W) else {
                return self.string_tail(i, escaped);
            };
            // Every special byte of this block from one mask: an
            // escape-dense string (code, JSON tool output) has several.
            let mut m = B::marks(w);
            while m != 0 {
                let k = (m.trailing_zeros() >> B::SHIFT) as usize;
                let q = i + k;
                match b[q] {
                    b'"' => {
                        self.i = q + 1;
                        return Some(escaped);
                    }
                    b'\\' => {}
                    c if c < 0x20 => return None,
                    // A false mark above a true one already handled.
                    _ => {
                        m &= !(B::FIELD << (k << B::SHIFT));
                        continue;
                    }
                }
                escaped = true;
                // `escape_end`, spelled out so the common escapes stay in
                // the block loop; a `\u` leaves it.
                match *b.get(q + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                    _ => {
                        i = escape_end(b, q)?;
                        continue 'blocks;
                    }
                }
                // Past the escaped byte: the rest of this block, or the next.
                if k + 2 >= B::W {
                    i = q + 2;
                    continue 'blocks;
                }
                m &= !0u64 << ((k + 2) << B::SHIFT);
            }
            i += B::W;
        }
    }

    /// [`Scan::string`] over the last bytes of the body, one at a time.
    fn string_tail(&mut self, mut i: usize, mut escaped: bool) -> Option<bool> {
        let b = self.b;
        loop {
            match *b.get(i)? {
                b'"' => {
                    self.i = i + 1;
                    return Some(escaped);
                }
                b'\\' => {
                    escaped = true;
                    i = escape_end(b, i)?;
                }
                c if c < 0x20 => return None,
                _ => i += 1,
            }
        }
    }
}

/// The index just past the escape whose backslash is at `q`: JSON's
/// escapes only, `\u` with four hex digits (which a raw value does not
/// decode further).
fn escape_end(b: &[u8], q: usize) -> Option<usize> {
    match *b.get(q + 1)? {
        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(q + 2),
        b'u' => b
            .get(q + 2..q + 6)?
            .iter()
            .all(u8::is_ascii_hexdigit)
            .then_some(q + 6),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "x86_64")]
    use crate::json::simd::Sse2;
    use crate::json::simd::Swar;

    #[test]
    fn view_keeps_raw_slices_and_order() {
        let body = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}, {"role":"assistant","content":"yo"}],"stream":true}"#;
        let v = RequestView::parse(body).unwrap();
        assert_eq!(v.str("model").as_deref(), Some("gpt-4o"));
        assert_eq!(v.get::<bool>("stream"), Some(true));
        let msgs = v.raw("messages").unwrap();
        assert_eq!(
            msgs.get(),
            r#"[{"role":"user","content":"hi"}, {"role":"assistant","content":"yo"}]"#
        );
        let r = v.span(msgs);
        assert_eq!(&body[r], msgs.get().as_bytes());
        let keys: Vec<_> = v.fields().map(|(k, _)| k.to_string()).collect();
        assert_eq!(keys, ["model", "messages", "stream"]);
    }

    /// The reference: what the view read before, serde_json's parse of the
    /// body into `&RawValue` members.
    fn serde_members(text: &str) -> Option<Vec<(String, String)>> {
        use serde_json::value::RawValue;
        struct Fields(Vec<(String, String)>);
        impl<'de> serde::Deserialize<'de> for Fields {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> serde::de::Visitor<'de> for V {
                    type Value = Fields;
                    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                        f.write_str("a JSON object")
                    }
                    fn visit_map<M: serde::de::MapAccess<'de>>(
                        self,
                        mut m: M,
                    ) -> Result<Fields, M::Error> {
                        let mut v = Vec::new();
                        while let Some(Key(k)) = m.next_key::<Key<'de>>()? {
                            let raw: &'de RawValue = m.next_value()?;
                            v.push((k.into_owned(), raw.get().to_owned()));
                        }
                        Ok(Fields(v))
                    }
                }
                d.deserialize_map(V)
            }
        }
        serde_json::from_str::<Fields>(text).ok().map(|f| f.0)
    }

    /// A view as plain strings: each member's name, raw text, and the raw
    /// text of its elements when it is an array.
    type Plain = Vec<(String, String, Option<Vec<String>>)>;

    fn scanned(text: &str) -> Option<Plain> {
        let v = RequestView::parse(text.as_bytes())?;
        Some(
            v.fields
                .iter()
                .map(|m| {
                    let els = m.elements.map(|(a, b)| {
                        v.elements[a as usize..b as usize]
                            .iter()
                            .map(|r| r.get().to_owned())
                            .collect()
                    });
                    (m.name.to_string(), m.value.get().to_owned(), els)
                })
                .collect(),
        )
    }

    /// The reference view: serde's members, and serde's split of each array.
    fn serde_view(text: &str) -> Option<Plain> {
        use serde_json::value::RawValue;
        let members = serde_members(text)?;
        Some(
            members
                .into_iter()
                .map(|(k, raw)| {
                    let els = raw.starts_with('[').then(|| {
                        serde_json::from_str::<Vec<&RawValue>>(&raw)
                            .unwrap()
                            .iter()
                            .map(|r| r.get().to_owned())
                            .collect()
                    });
                    (k, raw, els)
                })
                .collect(),
        )
    }

    #[test]
    fn the_scan_accepts_what_serde_accepts() {
        for text in [
            r#"{}"#,
            r#" { "a" : 1 , "b":[ ] ,"c":{ } } "#,
            r#"{"a":-0.5e+3,"b":0,"c":-0,"d":1E9,"e":"\u00e9\n\"","f":[true,false,null]}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"k\u0041":"\ud800"}"#,
            r#"{"\ud800":1}"#,
            r#"{"a":01}"#,
            r#"{"a":1.}"#,
            r#"{"a":.5}"#,
            r#"{"a":-}"#,
            r#"{"a":1e}"#,
            r#"{"a":[1,]}"#,
            r#"{"a":[,1]}"#,
            r#"{"a":{"b":1,}}"#,
            r#"{"a":{,}}"#,
            r#"{"a":{"b"}}"#,
            r#"{"a":{1:2}}"#,
            r#"{"a":"\x"}"#,
            r#"{"a":"\u12g4"}"#,
            "{\"a\":\"tab\there\"}",
            "{\"a\":\"nul\u{0}\"}",
            r#"{"a":tru}"#,
            r#"{"a":nulll}"#,
            r#"{"a":1}x"#,
            r#"{"a":1"#,
            r#"{"a":[}"#,
            r#"{"a":[1}"#,
            r#"{"a":{]}"#,
            r#"[1]"#,
            r#""a""#,
            "",
            "   ",
            r#"{"a" 1}"#,
            r#"{"a":1 "b":2}"#,
            r#"{a:1}"#,
            "{\"a\":\"caf\u{e9} \u{1F600}\"}",
            r#"{"m":[ 1, {"a":[2,"]"]} , "x,]" ]}"#,
            r#"{"m": [ {"a":"x,]}\"y"} , [1,[2]] ,"s\\" , 3, true ,null,{} ] ,"n":[ ]}"#,
            r#"{"m":["open]}"#,
        ] {
            assert_eq!(scanned(text), serde_view(text), "{text:?}");
        }
        // No depth limit inside a member (serde's raw value has none), and
        // no recursion to overflow.
        let deep = format!("{{\"x\":{}1{}}}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(scanned(&deep), serde_view(&deep));
        assert!(scanned(&deep).is_some());
        let open = format!("{{\"x\":{}1{}}}", "[".repeat(100_000), "]".repeat(99_999));
        assert_eq!(scanned(&open), None);
    }

    #[test]
    fn every_fixture_request_scans_as_serde_reads_it() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let mut seen = 0;
        let mut stack = vec![dir];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(d).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if let Ok(text) = std::fs::read_to_string(&p) {
                    if text.trim_start().starts_with('{') {
                        assert_eq!(scanned(&text), serde_view(&text), "{p:?}");
                        seen += 1;
                    }
                }
            }
        }
        assert!(seen > 20, "{seen} JSON files");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
        /// Any object of any JSON members (names repeated, escaped), compact
        /// or pretty: scanned as serde reads it; cut short: refused; any one
        /// byte changed: accepted exactly when serde accepts it, read the same.
        #[test]
        fn any_object_scans_as_serde_reads_it(
            members in proptest::collection::vec(
                ("[a-z\"\\\\\u{1}\u{e9} ]{0,6}", crate::json::pick::tests::any_json()),
                0..6,
            ),
            pretty in proptest::prelude::any::<bool>(),
            cut in proptest::prelude::any::<proptest::sample::Index>(),
            at in proptest::prelude::any::<proptest::sample::Index>(),
            byte in proptest::prelude::any::<u8>(),
        ) {
            let sep = if pretty { ",\n  " } else { "," };
            let body: Vec<String> = members
                .iter()
                .map(|(k, v)| {
                    let v = if pretty {
                        serde_json::to_string_pretty(v).unwrap()
                    } else {
                        serde_json::to_string(v).unwrap()
                    };
                    format!("{}:{v}", serde_json::to_string(k).unwrap())
                })
                .collect();
            let text = format!("{{{}}}", body.join(sep));
            let want = serde_view(&text);
            proptest::prop_assert!(want.is_some());
            proptest::prop_assert_eq!(scanned(&text), want);
            let short = &text.as_bytes()[..cut.index(text.len())];
            if let Ok(short) = std::str::from_utf8(short) {
                proptest::prop_assert_eq!(scanned(short), None);
            }
            let mut changed = text.into_bytes();
            let i = at.index(changed.len());
            changed[i] = byte;
            if let Ok(changed) = std::str::from_utf8(&changed) {
                proptest::prop_assert_eq!(scanned(changed), serde_view(changed));
            }
        }
    }

    /// Where a string opening at byte 0 of `text` ends, and whether it had
    /// an escape, as serde reads it (`None`: refused).
    fn serde_string(text: &str) -> Option<(usize, bool)> {
        let mut it =
            serde_json::Deserializer::from_str(text).into_iter::<&serde_json::value::RawValue>();
        let raw = it.next()?.ok()?;
        Some((it.byte_offset(), raw.get().contains('\\')))
    }

    fn string_with<B: Block>(text: &str) -> Option<(usize, bool)> {
        let mut s = Scan {
            text,
            b: text.as_bytes(),
            i: 0,
            open: Vec::new(),
        };
        s.string_in::<B>().map(|e| (s.i, e))
    }

    /// What a string may hold between plain runs: non-ASCII, JSON's
    /// escapes, and what may not be in a string (bad escapes, a lone
    /// backslash, raw control characters, a raw quote that ends it early).
    const PIECES: [&str; 17] = [
        "\u{e9}\u{65e5}\u{1F600}",
        "\\\"",
        "\\\\",
        "\\\\\\\"",
        "\\n",
        "\\u00e9",
        "\\uD83D\\uDE00",
        "\\x",
        "\\u12",
        "\\u12G4",
        "\\",
        "\u{1}",
        "\u{1f}",
        "\t",
        "\u{7f}",
        "\"",
        "\u{e9}",
    ];

    fn piece() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        prop_oneof![
            "[a-z ]{1,40}",
            proptest::sample::select(&PIECES[..]).prop_map(str::to_string),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]
        /// Any string, long enough to cross blocks with its escapes at every
        /// offset: both block searches end it where serde does, or refuse it
        /// with serde.
        #[test]
        fn any_string_ends_where_serde_ends_it(
            pieces in proptest::collection::vec(piece(), 0..24),
            lead in 0usize..40,
            tail in "[,:\\]}\" a-z]{0,40}",
        ) {
            let text = format!("\"{}{}\"{tail}", "a".repeat(lead), pieces.concat());
            let want = serde_string(&text);
            proptest::prop_assert_eq!(string_with::<Swar>(&text), want);
            #[cfg(target_arch = "x86_64")]
            proptest::prop_assert_eq!(string_with::<Sse2>(&text), want);
        }
    }

    /// Every piece, escapes good and bad, at every offset across the first
    /// blocks of both searches, the string ending within the body's last block or
    /// past it (where the block search hands over to the byte-wise tail).
    #[test]
    fn escapes_read_alike_at_every_offset() {
        for lead in 0..140 {
            for e in PIECES {
                for tail in ["", "\"", "a\"", "\"}", &format!("b\"{}", "c".repeat(70))] {
                    let text = format!("\"{}{e}{tail}", "a".repeat(lead));
                    let want = serde_string(&text);
                    assert_eq!(string_with::<Swar>(&text), want, "{text:?}");
                    #[cfg(target_arch = "x86_64")]
                    assert_eq!(string_with::<Sse2>(&text), want, "{text:?}");
                }
            }
        }
    }

    #[test]
    fn names_and_strings_are_borrowed_unless_escaped() {
        let body = br#"{"mo\u0064el":"gpt-\u0034o","user":"plain"}"#;
        let v = RequestView::parse(body).unwrap();
        let keys: Vec<_> = v.fields().map(|(k, _)| k.to_string()).collect();
        assert_eq!(keys, ["model", "user"]);
        assert!(matches!(v.fields[0].name, Cow::Owned(_)));
        assert!(matches!(v.fields[1].name, Cow::Borrowed(_)));
        assert_eq!(v.str("model").as_deref(), Some("gpt-4o"));
        assert!(matches!(v.str("user"), Some(Cow::Borrowed("plain"))));
        assert!(v.str("nothing").is_none());
    }

    #[test]
    fn non_objects_are_none() {
        assert!(RequestView::parse(b"[1,2]").is_none());
        assert!(RequestView::parse(b"{\"a\":").is_none());
        assert!(RequestView::parse(b"\xff\xfe").is_none());
    }
}
