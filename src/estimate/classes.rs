//! Content classes: which kind of text each estimated token came from.
//! Tokenizers disagree far more on some kinds of text than on others (CJK,
//! other scripts, emoji, indentation, random base64), so the session
//! calibrates each kind apart (`session/calibration.rs`).
//!
//! A text is classified by cheap statistics of its bytes, read in the same
//! pass that counts its characters: characters of a non-Latin script, emoji
//! and symbols, and long unbroken runs of base64 or hex are classes of their
//! own wherever they appear; the rest of the text is JSON, code or prose by
//! its punctuation and layout. The text's token count (one tokenizer call
//! for the whole text, as before) is shared among its classes in proportion
//! to how many tokens each part's characters usually cost in the encoding.

use super::tokenizer::Encoding;

/// A kind of content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Class {
    /// Latin-script natural language (and what is not one of the others).
    Prose = 0,
    /// Source code: indented lines, statement punctuation.
    Code,
    /// JSON and other key-value structured data.
    Json,
    /// JSON or code quoted inside a JSON string (a tool's output in a
    /// Gemini function response): its quotes and newlines escaped, which
    /// tokenizers split very differently.
    Escaped,
    /// Base64, hex and other long unbroken runs of a binary alphabet.
    Binary,
    /// Han ideographs, CJK punctuation and full-width forms.
    Han,
    /// Japanese hiragana and katakana.
    Kana,
    /// Korean hangul.
    Hangul,
    /// Any other non-Latin script: Cyrillic, Greek, Arabic, Hebrew, Indic, Thai...
    Script,
    /// Emoji, their joiners and modifiers, and pictographic symbols.
    Emoji,
    /// Images and documents, priced from their size.
    Media,
    /// The estimator's own per-message, per-call and per-request constants
    /// (and role names): the provider's template in the provider's tokens.
    Framing,
}

/// How many classes there are.
pub const CLASSES: usize = 12;

impl Class {
    pub const ALL: [Class; CLASSES] = [
        Class::Prose,
        Class::Code,
        Class::Json,
        Class::Escaped,
        Class::Binary,
        Class::Han,
        Class::Kana,
        Class::Hangul,
        Class::Script,
        Class::Emoji,
        Class::Media,
        Class::Framing,
    ];

    /// The name in `/sessions` and in the `class` label.
    pub const fn name(self) -> &'static str {
        match self {
            Class::Prose => "prose",
            Class::Code => "code",
            Class::Json => "json",
            Class::Escaped => "escaped",
            Class::Binary => "binary",
            Class::Han => "han",
            Class::Kana => "kana",
            Class::Hangul => "hangul",
            Class::Script => "script",
            Class::Emoji => "emoji",
            Class::Media => "media",
            Class::Framing => "framing",
        }
    }

    pub fn from_name(name: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// Tokens per class; an estimate's tokens are their sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Classes(pub [u32; CLASSES]);

impl Classes {
    pub fn get(&self, c: Class) -> u64 {
        u64::from(self.0[c as usize])
    }

    pub fn add(&mut self, c: Class, n: u64) {
        let slot = &mut self.0[c as usize];
        *slot = slot.saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
    }

    pub fn add_all(&mut self, other: &Classes) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a = a.saturating_add(b);
        }
    }

    pub fn sum(&self) -> u64 {
        self.0.iter().map(|&n| u64::from(n)).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&n| n == 0)
    }
}

/// Groups a text's characters fall in before its tokens are shared out:
/// the classes, with Latin text one group whose class the whole text decides.
const LATIN: usize = CLASSES;
const GROUPS: usize = CLASSES + 1;

/// Which group a non-ASCII character belongs to.
fn group_of(cp: u32) -> usize {
    match cp {
        // Latin-1, Latin extended, IPA, spacing and combining marks.
        0x80..=0x36F | 0x1E00..=0x1EFF => LATIN,
        // General punctuation (dashes, curly quotes, ellipsis) is prose's,
        // but the zero-width joiner glues emoji together.
        0x200D => Class::Emoji as usize,
        0x2000..=0x206F => LATIN,
        0x3040..=0x30FF | 0x31F0..=0x31FF | 0xFF66..=0xFF9F => Class::Kana as usize,
        0x1100..=0x11FF | 0x3130..=0x318F | 0xA960..=0xA97F | 0xAC00..=0xD7FF => {
            Class::Hangul as usize
        }
        0x2E80..=0x303F
        | 0x3190..=0x31EF
        | 0x3200..=0x9FFF
        | 0xF900..=0xFAFF
        | 0xFE30..=0xFE4F
        | 0xFF00..=0xFF65
        | 0xFFA0..=0xFFEF
        | 0x20000..=0x3FFFF => Class::Han as usize,
        // Letterlike symbols, arrows, maths, technical, box drawing,
        // dingbats, misc symbols; variation selectors; the pictographs;
        // tag characters (flags).
        0x2070..=0x2BFF | 0xFE00..=0xFE0F | 0x1F000..=0x1FAFF | 0xE0000..=0xE007F => {
            Class::Emoji as usize
        }
        _ => Class::Script as usize,
    }
}

/// Usual tokens per thousand characters of each group in an encoding: how a
/// mixed text's count is shared out (a JSON record with a CJK note gives
/// most of its tokens to the note). Measured on samples of each kind.
fn weights(enc: Encoding) -> &'static [u32; CLASSES] {
    // prose code json escaped binary han kana hangul script emoji media framing
    const O200K: [u32; CLASSES] = [200, 290, 400, 450, 680, 700, 830, 520, 300, 1460, 0, 0];
    const CL100K: [u32; CLASSES] = [200, 290, 400, 450, 720, 1070, 1060, 780, 600, 2330, 0, 0];
    match enc {
        Encoding::O200kBase => &O200K,
        Encoding::Cl100kBase => &CL100K,
    }
}

/// Shortest unbroken run of base64 or hex characters that counts as binary:
/// longer than any word, shorter than any key or blob worth the name.
const BINARY_RUN: u64 = 32;

/// What one pass over a text found.
#[derive(Default)]
struct Scan {
    chars: u64,
    /// Characters per group, whitespace left out (Latin ones first counted
    /// all as Latin; a long binary run is moved to `Binary` when it ends).
    groups: [u64; GROUPS],
    /// Latin characters that are not whitespace.
    solid: u64,
    lines: u64,
    indented: u64,
    /// `"` followed (after spaces) by `:`: a JSON key.
    keys: u64,
    quotes: u64,
    /// `;`, `(`, `)`, `{`, `}`, `=`, `<`, `>`.
    code_punct: u64,
    /// A backslash escaping a quote, a newline, a tab or a backslash.
    escapes: u64,
    first: u8,
}

/// Bit flags of an ASCII byte.
const B64: u8 = 1;
const WS: u8 = 2;
const CODE: u8 = 4;

const fn ascii_table() -> [u8; 128] {
    let mut t = [0u8; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        if c.is_ascii_alphanumeric()
            || c == b'+'
            || c == b'/'
            || c == b'='
            || c == b'-'
            || c == b'_'
        {
            t[b] |= B64;
        }
        if c == b' ' || c == b'\t' || c == b'\n' || c == b'\r' {
            t[b] |= WS;
        }
        if matches!(c, b';' | b'(' | b')' | b'{' | b'}' | b'=' | b'<' | b'>') {
            t[b] |= CODE;
        }
        b += 1;
    }
    t
}
static ASCII: [u8; 128] = ascii_table();

/// The unbroken run of base64 or hex characters being read.
#[derive(Default)]
struct Run {
    len: u64,
    digit: bool,
    alpha: bool,
}

impl Run {
    /// The run ends: a long one of digits and letters moves from Latin to binary.
    fn end(&mut self, sc: &mut Scan) {
        if self.len >= BINARY_RUN && self.digit && self.alpha {
            sc.groups[LATIN] -= self.len;
            sc.groups[Class::Binary as usize] += self.len;
        }
        *self = Run::default();
    }
}

fn scan(s: &str) -> Scan {
    let b = s.as_bytes();
    let mut sc = Scan {
        lines: 1,
        ..Scan::default()
    };
    let mut run = Run::default();
    let mut after_quote = false;
    let mut line_start = true;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c < 0x80 {
            sc.chars += 1;
            let f = ASCII[c as usize];
            // Whitespace is no group's: a space usually opens the next
            // word's token, whatever its script.
            if f & WS == 0 {
                sc.groups[LATIN] += 1;
            }
            if f & B64 != 0 {
                run.len += 1;
                run.digit |= c.is_ascii_digit();
                run.alpha |= c.is_ascii_alphabetic();
            } else {
                run.end(&mut sc);
            }
            if f & WS != 0 {
                if c == b'\n' {
                    sc.lines += 1;
                    line_start = true;
                } else if line_start && (c == b'\t' || b.get(i + 1) == Some(&b' ')) {
                    sc.indented += 1;
                    line_start = false;
                }
                i += 1;
                continue;
            }
            line_start = false;
            if sc.first == 0 {
                sc.first = c;
            }
            sc.solid += 1;
            if f & CODE != 0 {
                sc.code_punct += 1;
            }
            if c == b'\\' && matches!(b.get(i + 1), Some(b'"' | b'n' | b't' | b'\\')) {
                sc.escapes += 1;
            }
            if c == b'"' {
                sc.quotes += 1;
                after_quote = true;
            } else {
                if c == b':' && after_quote {
                    sc.keys += 1;
                }
                after_quote = false;
            }
            i += 1;
            continue;
        }
        // A multi-byte character (the text is valid UTF-8): decode it.
        let (cp, len) = decode(b, i);
        run.end(&mut sc);
        after_quote = false;
        line_start = false;
        sc.chars += 1;
        let g = group_of(cp);
        sc.groups[g] += 1;
        if g == LATIN {
            sc.solid += 1;
        }
        if sc.first == 0 {
            sc.first = 0x80;
        }
        i += len;
    }
    run.end(&mut sc);
    sc
}

/// The code point starting at `b[i]` (a leading byte of valid UTF-8) and its length.
#[inline]
fn decode(b: &[u8], i: usize) -> (u32, usize) {
    let c = u32::from(b[i]);
    let cont = |k: usize| u32::from(b.get(i + k).copied().unwrap_or(0x80) & 0x3F);
    if c < 0xE0 {
        (((c & 0x1F) << 6) | cont(1), 2)
    } else if c < 0xF0 {
        (((c & 0x0F) << 12) | (cont(1) << 6) | cont(2), 3)
    } else {
        (
            ((c & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3),
            4,
        )
    }
}

/// The class of a text's Latin part, from its punctuation and layout.
fn latin_class(sc: &Scan) -> Class {
    let solid = sc.solid.max(1);
    // Structure quoted inside a string: escapes throughout.
    if sc.escapes >= 4 && sc.escapes * 25 >= solid {
        return Class::Escaped;
    }
    // JSON: an object or array of quoted strings, or keys throughout.
    let opens = matches!(sc.first, b'{' | b'[');
    if (opens && sc.quotes * 12 >= solid) || (sc.keys >= 3 && sc.keys * 40 >= solid) {
        return Class::Json;
    }
    // Code: most lines indented, or statement punctuation throughout.
    if (sc.lines >= 3 && sc.indented * 3 >= sc.lines) || sc.code_punct * 14 >= solid {
        return Class::Code;
    }
    Class::Prose
}

/// Share `tokens` (the count of `s` in `enc`) among the classes of `s`'s
/// characters, into `out`; returns the number of characters.
pub fn attribute(enc: Encoding, s: &str, tokens: u64, out: &mut Classes) -> u64 {
    let sc = scan(s);
    if tokens == 0 {
        return sc.chars;
    }
    let w = weights(enc);
    let latin = latin_class(&sc);
    let mut by_class = [0u64; CLASSES];
    for (g, &n) in sc.groups.iter().enumerate() {
        let class = if g == LATIN { latin as usize } else { g };
        by_class[class] += n * u64::from(w[class]);
    }
    let total: u64 = by_class.iter().sum();
    if total == 0 {
        out.add(latin, tokens);
        return sc.chars;
    }
    // Shares rounded down; what rounding leaves goes to the largest part.
    let mut given = 0;
    let mut largest = (0, latin as usize);
    for (c, &part) in by_class.iter().enumerate() {
        if part == 0 {
            continue;
        }
        let n = tokens * part / total;
        out.add(Class::ALL[c], n);
        given += n;
        if part > largest.0 {
            largest = (part, c);
        }
    }
    out.add(Class::ALL[largest.1], tokens - given);
    sc.chars
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classes(s: &str) -> Vec<(&'static str, u64)> {
        let enc = Encoding::O200kBase;
        let n = enc.count(s) as u64;
        let mut out = Classes::default();
        let chars = attribute(enc, s, n, &mut out);
        assert_eq!(chars, s.chars().count() as u64, "{s}");
        assert_eq!(out.sum(), n, "every token attributed: {s}");
        Class::ALL
            .iter()
            .filter(|c| out.get(**c) > 0)
            .map(|c| (c.name(), out.get(*c)))
            .collect()
    }

    fn only(s: &str) -> &'static str {
        let c = classes(s);
        assert_eq!(c.len(), 1, "{s}: {c:?}");
        c[0].0
    }

    #[test]
    fn pure_texts_are_one_class() {
        assert_eq!(
            only("The proxy reads the provider's own count off every response — and keeps it."),
            "prose"
        );
        assert_eq!(
            only("2025-11-03T14:22:08Z INFO gateway status=200 latency_ms=182 path=/v1/chat\n2025-11-03T14:22:09Z WARN retry attempt=2 error=\"reset\"\n"),
            "prose"
        );
        assert_eq!(
            only("fn step(input: &[u8]) -> Result<Vec<u32>, Error> {\n    let mut out = Vec::new();\n    for c in input {\n        out.push(*c as u32);\n    }\n    Ok(out)\n}\n"),
            "code"
        );
        assert_eq!(
            only(
                "def handler(event):\n    items = [x for x in event if x]\n    return len(items)\n"
            ),
            "code"
        );
        assert_eq!(
            only(
                r#"[{"id":48213,"sku":"X-3fa9c1","qty":3,"ok":true,"tags":["cache","retry"],"price":412.55}]"#
            ),
            "json"
        );
        assert_eq!(
            only(r#"{"city": "Paris", "days": 3, "units": "metric"}"#),
            "json"
        );
        assert_eq!(
            only(
                r#"{"content":"[{\"id\":48213,\"sku\":\"X-3fa9c1\",\"ok\":true},{\"id\":3,\"ok\":false}]"}"#
            ),
            "escaped"
        );
        assert_eq!(
            only("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="),
            "binary"
        );
        assert_eq!(
            only("3fa85f6457174562b3fc2c963f66afa63fa85f6457174562"),
            "binary"
        );
        assert_eq!(
            only("这个函数返回一个包含所有结果的列表，并且不会修改输入。"),
            "han"
        );
        assert_eq!(only("ひらがなとカタカナ"), "kana");
        assert_eq!(only("한국어 문장도 토큰화 방식에 따라"), "hangul");
        assert_eq!(only("Размер контекстного окна"), "script");
        assert_eq!(only("🚀🔥✅👩‍💻🇯🇵"), "emoji");
    }

    #[test]
    fn mixed_texts_share_their_tokens() {
        // A JSON record with a CJK note: both, the note's share the larger per character.
        let c = classes(
            r#"{"id":1,"sku":"X-1","qty":3,"note":"上下文窗口的大小决定了模型一次能看到多少内容"}"#,
        );
        let names: Vec<_> = c.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["json", "han"], "{c:?}");
        // Prose with emoji; Japanese is Han and kana.
        let c = classes("deploy 🚀 window 🔥 tokens ✅ anchor 🧪 session 📦");
        assert_eq!(
            c.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            ["prose", "emoji"]
        );
        let c = classes("日本語のテキストはトークン数が多くなりがちです。");
        assert_eq!(
            c.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            ["han", "kana"]
        );
        // A base64 field inside JSON: the blob is binary, the rest JSON.
        let c = classes(
            r#"{"name":"logo.png","mime":"image/png","data":"iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"}"#,
        );
        assert_eq!(
            c.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            ["json", "binary"]
        );
        // A long identifier without digits is no blob.
        assert_eq!(
            only("call the function named compute_the_projection_for_every_lane_now please"),
            "prose"
        );
    }

    #[test]
    fn names_round_trip() {
        for c in Class::ALL {
            assert_eq!(Class::from_name(c.name()), Some(c));
            assert_eq!(Class::ALL[c as usize], c);
        }
    }
}
