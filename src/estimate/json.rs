//! Small JSON helpers over borrowed raw text: split an array into its
//! elements without parsing them (the hot path of a cached estimate), read
//! one level of an object or array, and re-serialize a value compactly the way
//! a provider's own serializer would (no whitespace, no `\u` escapes for
//! printable characters).

use std::borrow::Cow;

use serde_json::value::RawValue;

/// The elements of a JSON array as raw slices of `s`, found by scanning
/// brackets and strings. `s` must already be valid JSON (it comes from a
/// parsed request view); `None` when it is not an array.
pub fn split_array(s: &str) -> Option<Vec<&str>> {
    let mut it = elements(s)?;
    let v: Vec<&str> = it.by_ref().collect();
    it.closed.then_some(v)
}

/// [`split_array`] one element at a time, for callers that stop early.
pub fn elements(s: &str) -> Option<Elements<'_>> {
    let b = s.as_bytes();
    let i = skip_ws(b, 0);
    (b.get(i) == Some(&b'[')).then_some(Elements {
        s,
        i: i + 1,
        closed: false,
        failed: false,
    })
}

pub struct Elements<'a> {
    s: &'a str,
    i: usize,
    /// The closing bracket was reached.
    closed: bool,
    failed: bool,
}

impl Elements<'_> {
    /// The closing bracket was reached: every element was seen.
    pub fn closed(&self) -> bool {
        self.closed
    }
}

impl<'a> Iterator for Elements<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        if self.closed || self.failed {
            return None;
        }
        let (s, b) = (self.s, self.s.as_bytes());
        let mut i = self.i;
        let mut depth = 0usize;
        let mut start: Option<usize> = None;
        let mut end = i;
        while i < b.len() {
            match b[i] {
                b'"' => {
                    start.get_or_insert(i);
                    let Some(e) = string_end(b, i) else {
                        break;
                    };
                    i = e;
                    end = i;
                    continue;
                }
                b'{' | b'[' => {
                    start.get_or_insert(i);
                    depth += 1;
                }
                b'}' | b']' => {
                    if depth == 0 {
                        self.closed = true;
                        return start.map(|st| &s[st..end]);
                    }
                    depth -= 1;
                }
                b',' if depth == 0 => {
                    self.i = i + 1;
                    match start {
                        Some(st) => return Some(&s[st..end]),
                        None => {
                            i += 1;
                            continue;
                        }
                    }
                }
                b' ' | b'\t' | b'\n' | b'\r' => {
                    i += 1;
                    continue;
                }
                _ => {
                    start.get_or_insert(i);
                }
            }
            i += 1;
            end = i;
        }
        self.failed = true;
        None
    }
}

/// Index just past the closing quote of the string opening at `i`.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        // Jump from quote to quote; a quote preceded by an odd run of
        // backslashes is escaped (escapes other than `\"` cost nothing).
        let q = j + memchr::memchr(b'"', b.get(j..)?)?;
        let run = b[i + 1..q]
            .iter()
            .rev()
            .take_while(|&&c| c == b'\\')
            .count();
        if run % 2 == 0 {
            return Some(q + 1);
        }
        j = q + 1;
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// First significant byte of a raw value: `"` string, `{` object, `[` array.
pub fn kind(raw: &str) -> u8 {
    let b = raw.as_bytes();
    b.get(skip_ws(b, 0)).copied().unwrap_or(0)
}

pub fn raw(s: &str) -> Option<&RawValue> {
    serde_json::from_str(s).ok()
}

/// Object members in order; `None` if not an object.
pub fn object(raw: &str) -> Option<Vec<(Cow<'_, str>, &RawValue)>> {
    if kind(raw) != b'{' {
        return None;
    }
    struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);
    impl<'de> serde::Deserialize<'de> for Members<'de> {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Members<'de>;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("an object")
                }
                fn visit_map<M: serde::de::MapAccess<'de>>(
                    self,
                    mut m: M,
                ) -> Result<Members<'de>, M::Error> {
                    let mut v = Vec::new();
                    while let Some(k) = m.next_key::<Cow<'de, str>>()? {
                        let r: &'de RawValue = m.next_value()?;
                        v.push((k, r));
                    }
                    Ok(Members(v))
                }
            }
            d.deserialize_map(V)
        }
    }
    serde_json::from_str::<Members<'_>>(raw).ok().map(|m| m.0)
}

/// A member of an already split object (the last one if repeated).
pub fn get<'a>(obj: &[(Cow<'_, str>, &'a RawValue)], key: &str) -> Option<&'a RawValue> {
    obj.iter().rev().find(|(k, _)| k == key).map(|(_, v)| *v)
}

/// Elements of an array; `None` if not an array.
pub fn array(raw: &str) -> Option<Vec<&RawValue>> {
    if kind(raw) != b'[' {
        return None;
    }
    serde_json::from_str(raw).ok()
}

/// A decoded string value; `None` if not a string.
pub fn string(raw: &str) -> Option<Cow<'_, str>> {
    if kind(raw) != b'"' {
        return None;
    }
    serde_json::from_str(raw).ok()
}

/// `raw` re-serialized without whitespace between tokens and with string
/// escapes reduced to what JSON requires (`\u65e5` becomes `日`).
pub fn compact(raw: &str) -> String {
    let b = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    let mut copied = 0;
    while i < b.len() {
        match b[i] {
            b'"' => {
                let Some(end) = string_end(b, i) else {
                    out.push_str(&raw[copied..]);
                    return out;
                };
                let lit = &raw[i..end];
                if lit.as_bytes().contains(&b'\\') {
                    out.push_str(&raw[copied..i]);
                    match serde_json::from_str::<String>(lit)
                        .ok()
                        .and_then(|s| serde_json::to_string(&s).ok())
                    {
                        Some(s) => out.push_str(&s),
                        None => out.push_str(lit),
                    }
                    copied = end;
                }
                i = end;
            }
            b' ' | b'\t' | b'\n' | b'\r' => {
                out.push_str(&raw[copied..i]);
                i += 1;
                copied = i;
            }
            _ => i += 1,
        }
    }
    out.push_str(&raw[copied..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_one_at_a_time() {
        let s = r#"[ 1, {"a":[2,"]"]} , "x,]" ]"#;
        let mut it = elements(s).unwrap();
        assert_eq!(it.next(), Some("1"));
        assert_eq!(it.next(), Some(r#"{"a":[2,"]"]}"#));
        assert_eq!(it.next(), Some(r#""x,]""#));
        assert_eq!(it.next(), None);
        assert!(elements(r#"{"a":1}"#).is_none());
        assert_eq!(elements("[\"open").unwrap().next(), None);
    }

    #[test]
    fn split_matches_serde() {
        let s = r#" [ {"a":"x,]}\"y"} , [1,[2]] ,"s\\" , 3, true ,null,{} ] "#;
        let got = split_array(s).unwrap();
        let want: Vec<&RawValue> = serde_json::from_str(s).unwrap();
        let want: Vec<&str> = want.iter().map(|r| r.get()).collect();
        assert_eq!(got, want);
        assert_eq!(split_array("[]").unwrap(), Vec::<&str>::new());
        assert_eq!(split_array(" [ ] ").unwrap(), Vec::<&str>::new());
        assert!(split_array("{}").is_none());
        assert!(split_array("[\"unterminated").is_none());
    }

    #[test]
    fn compact_drops_whitespace_and_escapes() {
        assert_eq!(
            compact("{ \"a\" : [1, 2],\n \"b\": \"\\u65e5 \\\"q\\\"\" }"),
            "{\"a\":[1,2],\"b\":\"日 \\\"q\\\"\"}"
        );
        assert_eq!(compact("\"x y\""), "\"x y\"");
    }

    #[test]
    fn readers() {
        let o = object(r#"{"t":"a\nb","n":[1,2]}"#).unwrap();
        assert_eq!(string(get(&o, "t").unwrap().get()).unwrap(), "a\nb");
        assert_eq!(array(get(&o, "n").unwrap().get()).unwrap().len(), 2);
        assert!(object("[1]").is_none());
        assert!(string("1").is_none());
    }
}
