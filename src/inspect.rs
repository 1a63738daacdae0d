//! Read a request body once into a borrowed view: the top-level fields as raw
//! JSON slices, so that a 400 KB history is scanned, not copied, and each
//! message can be hashed by its exact bytes.

use std::borrow::Cow;
use std::ops::Range;

use serde::de::DeserializeOwned;
use serde_json::value::RawValue;

/// A JSON object request body, its top-level members kept as raw slices of
/// `body` in their original order.
pub struct RequestView<'a> {
    pub body: &'a [u8],
    fields: Vec<(Cow<'a, str>, &'a RawValue)>,
}

/// Top-level members in order; a `Vec` keeps duplicate keys visible and order intact.
struct Fields<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for Fields<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = Fields<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(
                self,
                mut m: M,
            ) -> Result<Fields<'a>, M::Error> {
                let mut v = Vec::with_capacity(16);
                while let Some(Key(k)) = m.next_key::<Key<'de>>()? {
                    let raw: &'de RawValue = m.next_value()?;
                    v.push((k, raw));
                }
                Ok(Fields(v))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
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
        // UTF-8 checked once for the whole body (SIMD), then parsed as a
        // `&str`: serde_json would otherwise check each raw member again
        // with std's slower check after skipping it.
        let text = simdutf8::basic::from_utf8(body).ok()?;
        let fields: Fields<'a> = serde_json::from_str(text).ok()?;
        Some(RequestView {
            body,
            fields: fields.0,
        })
    }

    /// The raw JSON of a top-level member (the last one, if repeated, as serde does).
    pub fn raw(&self, name: &str) -> Option<&'a RawValue> {
        self.fields
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| *v)
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

    /// The elements of an array member as raw slices.
    pub fn array(&self, name: &str) -> Option<Vec<&'a RawValue>> {
        serde_json::from_str(self.raw(name)?.get()).ok()
    }

    /// Top-level members in order.
    pub fn fields(&self) -> impl Iterator<Item = (&str, &'a RawValue)> + '_ {
        self.fields.iter().map(|(k, v)| (k.as_ref(), *v))
    }

    /// Byte range of a raw slice within `body`.
    pub fn span(&self, raw: &RawValue) -> Range<usize> {
        span_in(self.body, raw)
    }
}

/// Byte range of `raw` (which must borrow from `body`) within `body`.
pub fn span_in(body: &[u8], raw: &RawValue) -> Range<usize> {
    let start = raw.get().as_ptr() as usize - body.as_ptr() as usize;
    start..start + raw.get().len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn view_keeps_raw_slices_and_order() {
        let body = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}, {"role":"assistant","content":"yo"}],"stream":true}"#;
        let v = RequestView::parse(body).unwrap();
        assert_eq!(v.str("model").as_deref(), Some("gpt-4o"));
        assert_eq!(v.get::<bool>("stream"), Some(true));
        let msgs = v.array("messages").unwrap();
        assert_eq!(msgs.len(), 2);
        assert_eq!(msgs[1].get(), r#"{"role":"assistant","content":"yo"}"#);
        let r = v.span(msgs[1]);
        assert_eq!(&body[r], msgs[1].get().as_bytes());
        let keys: Vec<_> = v.fields().map(|(k, _)| k.to_string()).collect();
        assert_eq!(keys, ["model", "messages", "stream"]);
    }

    #[test]
    fn names_and_strings_are_borrowed_unless_escaped() {
        let body = br#"{"mo\u0064el":"gpt-\u0034o","user":"plain"}"#;
        let v = RequestView::parse(body).unwrap();
        let keys: Vec<_> = v.fields().map(|(k, _)| k.to_string()).collect();
        assert_eq!(keys, ["model", "user"]);
        assert!(matches!(v.fields[0].0, Cow::Owned(_)));
        assert!(matches!(v.fields[1].0, Cow::Borrowed(_)));
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
