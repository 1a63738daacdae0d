//! Image sizes from the first bytes of a base64 payload (PNG, JPEG, GIF,
//! WebP headers; the pixels are never decoded), and each provider's published
//! formula from size to tokens.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;

/// OpenAI, size unknown (a remote URL or a `file_id`): a 1024x1024 image at
/// `detail: high` (85 + 4 * 170).
pub const OPENAI_DEFAULT: u64 = 765;
/// Anthropic, size unknown: the ~1.15 megapixel ceiling images are scaled to.
pub const ANTHROPIC_DEFAULT: u64 = 1600;
/// Gemini, size unknown: one tile.
pub const GEMINI_DEFAULT: u64 = 258;
/// Ollama models vary (LLaVA: 576, Gemma 3: 256); LLaVA's 24x24 patch grid.
pub const OLLAMA_IMAGE: u64 = 576;
/// A document (PDF) whose pages are not counted: about one page of text and
/// its page image, as Anthropic documents PDF support.
pub const DOCUMENT_DEFAULT: u64 = 1500;

/// Pixel size read from an image header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    pub w: u32,
    pub h: u32,
}

pub use crate::provider::Detail;

/// OpenAI's per-model image costs: (base, per 512px tile) for the tile
/// models, or a multiplier for the 32px-patch models (gpt-4.1-mini/nano,
/// o4-mini), from OpenAI's vision guide.
enum OpenAiRule {
    Tiles { base: u64, tile: u64 },
    Patches { mult: f64 },
}

/// Which of OpenAI's image rules a model follows (part of the cache key,
/// since the same message costs differently under another rule).
pub fn openai_class(model: Option<&str>) -> u64 {
    crate::provider::with_base_name(model.unwrap_or(""), openai_base_class)
}

/// [`openai_class`] of a lowercased name without router prefix.
fn openai_base_class(m: &str) -> u64 {
    if m.starts_with("gpt-4.1-mini") {
        1
    } else if m.starts_with("gpt-4.1-nano") {
        2
    } else if m.starts_with("o4-mini") {
        3
    } else if m.starts_with("gpt-4o-mini") {
        4
    } else if m.starts_with("o1") || m.starts_with("o3") {
        5
    } else if m.starts_with("gpt-5") {
        6
    } else {
        0
    }
}

fn openai_rule(model: Option<&str>) -> OpenAiRule {
    match openai_class(model) {
        1 => OpenAiRule::Patches { mult: 1.62 },
        2 => OpenAiRule::Patches { mult: 2.46 },
        3 => OpenAiRule::Patches { mult: 1.72 },
        4 => OpenAiRule::Tiles {
            base: 2833,
            tile: 5667,
        },
        5 => OpenAiRule::Tiles {
            base: 75,
            tile: 150,
        },
        6 => OpenAiRule::Tiles {
            base: 70,
            tile: 140,
        },
        _ => OpenAiRule::Tiles {
            base: 85,
            tile: 170,
        },
    }
}

/// OpenAI: `low` is the base cost; otherwise fit in 2048x2048, scale the
/// shortest side down to 768, and pay per 512px tile plus the base.
pub fn openai_tokens(size: Option<Size>, detail: Detail, model: Option<&str>) -> u64 {
    match openai_rule(model) {
        OpenAiRule::Tiles { base, tile } => {
            if detail == Detail::Low {
                return base;
            }
            let Some(Size { w, h }) = size else {
                return base + 4 * tile;
            };
            let (mut w, mut h) = (w.max(1) as f64, h.max(1) as f64);
            if w > 2048.0 || h > 2048.0 {
                let s = 2048.0 / w.max(h);
                w *= s;
                h *= s;
            }
            if w.min(h) > 768.0 {
                let s = 768.0 / w.min(h);
                w *= s;
                h *= s;
            }
            let tiles = (w / 512.0).ceil() as u64 * (h / 512.0).ceil() as u64;
            base + tile * tiles
        }
        OpenAiRule::Patches { mult } => {
            let Some(Size { w, h }) = size else {
                return (1536.0 * mult).ceil() as u64;
            };
            let (w, h) = (w.max(1) as f64, h.max(1) as f64);
            let raw = (w / 32.0).ceil() * (h / 32.0).ceil();
            let patches = if raw > 1536.0 {
                // Shrink so the patch grid fits 1536, keeping the aspect ratio.
                let s = (1536.0 * 32.0 * 32.0 / (w * h)).sqrt();
                let (sw, sh) = (w * s, h * s);
                let s2 =
                    s * ((sw / 32.0).floor() / (sw / 32.0)).min((sh / 32.0).floor() / (sh / 32.0));
                ((w * s2) / 32.0).ceil() * ((h * s2) / 32.0).ceil()
            } else {
                raw
            };
            (patches.min(1536.0) * mult).ceil() as u64
        }
    }
}

/// Anthropic: `w*h/750` after scaling the long edge down to 1568, capped at
/// the ~1600 tokens images are scaled down to.
pub fn anthropic_tokens(size: Option<Size>) -> u64 {
    let Some(Size { w, h }) = size else {
        return ANTHROPIC_DEFAULT;
    };
    let (mut w, mut h) = (w.max(1) as f64, h.max(1) as f64);
    let long = w.max(h);
    if long > 1568.0 {
        let s = 1568.0 / long;
        w = (w * s).round().max(1.0);
        h = (h * s).round().max(1.0);
    }
    ((w * h / 750.0).ceil() as u64).clamp(1, ANTHROPIC_DEFAULT)
}

/// Gemini: 258 when both sides are at most 384; otherwise 258 per tile, the
/// tile side being two thirds of the shorter side, kept within 256..=768.
pub fn gemini_tokens(size: Option<Size>) -> u64 {
    let Some(Size { w, h }) = size else {
        return GEMINI_DEFAULT;
    };
    let (w, h) = (u64::from(w.max(1)), u64::from(h.max(1)));
    if w <= 384 && h <= 384 {
        return GEMINI_DEFAULT;
    }
    let unit = (w.min(h) * 2 / 3).clamp(256, 768);
    w.div_ceil(unit) * h.div_ceil(unit) * GEMINI_DEFAULT
}

/// The base64 payload of a `data:` URL, if it is one.
pub fn data_url_payload(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("data:")?;
    let (meta, data) = rest.split_once(',')?;
    meta.ends_with(";base64").then_some(data)
}

/// Random access into base64 text: decode only the bytes asked for.
struct B64<'a> {
    text: &'a [u8],
}

impl B64<'_> {
    /// Bytes `[off, off+len)` of the decoded payload (fewer at the end).
    fn read(&self, off: usize, len: usize) -> Option<Vec<u8>> {
        let q0 = off / 3;
        let q1 = (off + len).div_ceil(3);
        let c0 = q0.checked_mul(4)?;
        if c0 >= self.text.len() {
            return None;
        }
        let c1 = q1.saturating_mul(4).min(self.text.len());
        let chunk = &self.text[c0..c1];
        // A chunk cut mid-quantum (the payload's end without padding) decodes
        // through the no-padding path.
        let bytes = STANDARD
            .decode(chunk)
            .or_else(|_| {
                base64::engine::general_purpose::STANDARD_NO_PAD.decode(
                    chunk
                        .strip_suffix(b"==")
                        .or(chunk.strip_suffix(b"="))
                        .unwrap_or(chunk),
                )
            })
            .ok()?;
        let skip = off - q0 * 3;
        let end = (skip + len).min(bytes.len());
        (skip <= end).then(|| bytes[skip..end].to_vec())
    }
}

/// Size of a base64-encoded PNG, JPEG, GIF or WebP from its header. URL-safe
/// base64 and embedded whitespace are normalised on the small prefix only.
pub fn sniff_base64(b64: &str) -> Option<Size> {
    let t = b64.trim_start().as_bytes();
    let clean = !t
        .iter()
        .take(4096)
        .any(|c| matches!(c, b'\n' | b'\r' | b' ' | b'-' | b'_'));
    if clean {
        return sniff(&B64 { text: t });
    }
    // Rare: wrapped or URL-safe base64. Normalise a bounded prefix.
    let norm: Vec<u8> = t
        .iter()
        .take(128 * 1024)
        .filter(|c| !c.is_ascii_whitespace())
        .map(|&c| match c {
            b'-' => b'+',
            b'_' => b'/',
            c => c,
        })
        .collect();
    sniff(&B64 { text: &norm })
}

fn sniff(b: &B64<'_>) -> Option<Size> {
    let head = b.read(0, 32)?;
    if head.starts_with(b"\x89PNG\r\n\x1a\n") && head.len() >= 24 && &head[12..16] == b"IHDR" {
        return size(be32(&head[16..20]), be32(&head[20..24]));
    }
    if (head.starts_with(b"GIF87a") || head.starts_with(b"GIF89a")) && head.len() >= 10 {
        return size(le16(&head[6..8]) as u32, le16(&head[8..10]) as u32);
    }
    if head.len() >= 30 && &head[0..4] == b"RIFF" && &head[8..12] == b"WEBP" {
        return match &head[12..16] {
            b"VP8 " if head[23..26] == [0x9d, 0x01, 0x2a] => size(
                (le16(&head[26..28]) & 0x3fff) as u32,
                (le16(&head[28..30]) & 0x3fff) as u32,
            ),
            b"VP8L" if head[20] == 0x2f => {
                let v = u32::from_le_bytes([head[21], head[22], head[23], head[24]]);
                size((v & 0x3fff) + 1, ((v >> 14) & 0x3fff) + 1)
            }
            b"VP8X" => size(le24(&head[24..27]) + 1, le24(&head[27..30]) + 1),
            _ => None,
        };
    }
    if head.starts_with(&[0xff, 0xd8]) {
        return jpeg(b);
    }
    None
}

/// Walk JPEG segments to the first start-of-frame, reading only the few bytes
/// of each segment header (EXIF blocks are skipped by their length).
fn jpeg(b: &B64<'_>) -> Option<Size> {
    let mut off = 2usize;
    for _ in 0..64 {
        let h = b.read(off, 10)?;
        if h.len() < 4 || h[0] != 0xff {
            return None;
        }
        let marker = h[1];
        match marker {
            // Fill byte: markers may be preceded by any number of 0xff.
            0xff => {
                off += 1;
                continue;
            }
            // Stand-alone markers without a length.
            0x01 | 0xd0..=0xd7 => {
                off += 2;
                continue;
            }
            0xc0..=0xc3 | 0xc5..=0xc7 | 0xc9..=0xcb | 0xcd..=0xcf => {
                if h.len() < 9 {
                    return None;
                }
                let hgt = u16::from_be_bytes([h[5], h[6]]) as u32;
                let wid = u16::from_be_bytes([h[7], h[8]]) as u32;
                return size(wid, hgt);
            }
            0xd9 | 0xda => return None,
            _ => {
                let len = u16::from_be_bytes([h[2], h[3]]) as usize;
                if len < 2 {
                    return None;
                }
                off += 2 + len;
            }
        }
    }
    None
}

fn size(w: u32, h: u32) -> Option<Size> {
    (w > 0 && h > 0).then_some(Size { w, h })
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn le16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}
fn le24(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], 0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_documented_examples() {
        let s = |w, h| Some(Size { w, h });
        // OpenAI's vision guide: 1024x1024 high = 765; 2048x4096 high = 1105;
        // low = 85 whatever the size.
        assert_eq!(
            openai_tokens(s(1024, 1024), Detail::High, Some("gpt-4o")),
            765
        );
        assert_eq!(
            openai_tokens(s(2048, 4096), Detail::High, Some("gpt-4o")),
            1105
        );
        assert_eq!(
            openai_tokens(s(4096, 8192), Detail::Low, Some("gpt-4o")),
            85
        );
        assert_eq!(openai_tokens(s(512, 512), Detail::High, None), 255);
        assert_eq!(openai_tokens(None, Detail::High, None), OPENAI_DEFAULT);
        // Patch models: 1024x1024 -> 1024 patches; 1800x2400 -> 1452 patches.
        assert_eq!(
            openai_tokens(s(1024, 1024), Detail::High, Some("gpt-4.1-mini")),
            (1024.0f64 * 1.62).ceil() as u64
        );
        assert_eq!(
            openai_tokens(s(1800, 2400), Detail::High, Some("gpt-4.1-mini")),
            (1452.0f64 * 1.62).ceil() as u64
        );
    }

    #[test]
    fn anthropic_and_gemini() {
        let s = |w, h| Some(Size { w, h });
        assert_eq!(anthropic_tokens(s(200, 200)), 54);
        assert_eq!(anthropic_tokens(s(1000, 1000)), 1334);
        assert_eq!(anthropic_tokens(s(4000, 3000)), 1600);
        assert_eq!(anthropic_tokens(None), 1600);
        assert_eq!(gemini_tokens(s(300, 200)), 258);
        assert_eq!(gemini_tokens(s(1024, 1024)), 4 * 258);
        assert_eq!(gemini_tokens(None), 258);
    }
}
