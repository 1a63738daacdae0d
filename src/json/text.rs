//! Small JSON helpers over borrowed raw text: read one level of an object
//! or array, and re-serialize a value compactly the way
//! a provider's own serializer would (no whitespace, no `\u` escapes for
//! printable characters).

use std::borrow::Cow;

use serde_json::value::RawValue;

use super::{skip_ws, string_end};

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
                let Some((end, escaped)) = string_end(b, i) else {
                    out.push_str(&raw[copied..]);
                    return out;
                };
                let lit = &raw[i..end];
                if escaped {
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
