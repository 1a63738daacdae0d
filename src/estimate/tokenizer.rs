//! Which public BPE vocabulary stands in for a model's tokenizer, and the one
//! shared instance of each (built on first use, then reused by every thread).
//!
//! Counting goes through `bpe-openai`, which produces exactly tiktoken's
//! tokens and measured several times faster than `tiktoken-rs` on the same
//! text (`cargo run --release --example estimate_bench` prints both).

use crate::provider::{Api, Vocabulary};

/// A public tokenizer vocabulary.
///
/// Choice per family (models whose tokenizer is not public get the closest
/// public one; the session's calibration corrects the rest):
/// - `o200k_base`: gpt-4o, gpt-4.1, gpt-4.5, gpt-5, o1/o3/o4, gpt-oss, codex;
///   Gemini (a 256k SentencePiece vocabulary: o200k's large multilingual
///   vocabulary is the nearer density, CJK in particular).
/// - `cl100k_base`: gpt-4, gpt-3.5, text-embedding-3/ada; Claude (its
///   tokenizer is not public and counts more tokens than o200k on the same
///   text, closer to cl100k); Llama 3 (a 128k tiktoken vocabulary that is
///   cl100k plus 28k tokens), Qwen, Mistral, DeepSeek and anything unknown
///   served through Ollama.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    O200kBase,
    Cl100kBase,
}

impl From<Vocabulary> for Encoding {
    fn from(v: Vocabulary) -> Encoding {
        match v {
            Vocabulary::O200kBase => Encoding::O200kBase,
            Vocabulary::Cl100kBase => Encoding::Cl100kBase,
        }
    }
}

impl Encoding {
    /// The vocabulary for a model (`None`: the API's usual family).
    pub fn for_model(api: Api, model: Option<&str>) -> Encoding {
        let Some(model) = model else {
            return api.provider().default_vocabulary().into();
        };
        // Router prefixes such as `openai/gpt-4o` or `models/gemini-2.5-pro`.
        crate::provider::with_base_name(model, |m| Encoding::for_base_name(api, m))
    }

    /// [`Encoding::for_model`] of a lowercased name without router prefix.
    fn for_base_name(api: Api, m: &str) -> Encoding {
        let o200k = [
            "gpt-4o",
            "gpt-4.1",
            "gpt-4.5",
            "gpt-5",
            "gpt-oss",
            "chatgpt-4o",
            "o1",
            "o3",
            "o4",
            "codex",
            "computer-use",
            "gemini",
            "gemma",
        ];
        if o200k.iter().any(|p| m.starts_with(p)) {
            return Encoding::O200kBase;
        }
        let cl100k = ["gpt-4", "gpt-3.5", "gpt-35", "text-embedding", "claude"];
        if cl100k.iter().any(|p| m.starts_with(p)) {
            return Encoding::Cl100kBase;
        }
        api.provider().default_vocabulary().into()
    }

    pub const fn name(self) -> &'static str {
        match self {
            Encoding::O200kBase => "o200k_base",
            Encoding::Cl100kBase => "cl100k_base",
        }
    }

    /// Stable small id, part of every cache key.
    pub(crate) const fn id(self) -> u64 {
        match self {
            Encoding::O200kBase => 1,
            Encoding::Cl100kBase => 2,
        }
    }

    /// Tokens in `text` as tiktoken's `encode_ordinary` would produce them
    /// (special-token text is ordinary text here, as the provider treats
    /// user content).
    pub fn count(self, text: &str) -> usize {
        if text.is_empty() {
            return 0;
        }
        match self {
            Encoding::O200kBase => bpe_openai::o200k_base().count(text),
            Encoding::Cl100kBase => bpe_openai::cl100k_base().count(text),
        }
    }

    /// Build the shared tokenizer now rather than on the first request.
    pub fn warm(self) {
        self.count("warm");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families() {
        let f = |api, m| Encoding::for_model(api, Some(m));
        assert_eq!(f(Api::OpenAiChat, "gpt-4o-mini"), Encoding::O200kBase);
        assert_eq!(f(Api::OpenAiChat, "gpt-4.1"), Encoding::O200kBase);
        assert_eq!(f(Api::OpenAiChat, "o3-mini"), Encoding::O200kBase);
        assert_eq!(f(Api::OpenAiResponses, "gpt-5-codex"), Encoding::O200kBase);
        assert_eq!(f(Api::OpenAiChat, "gpt-4-0613"), Encoding::Cl100kBase);
        assert_eq!(f(Api::OpenAiChat, "gpt-4-turbo"), Encoding::Cl100kBase);
        assert_eq!(f(Api::OpenAiChat, "gpt-3.5-turbo"), Encoding::Cl100kBase);
        assert_eq!(f(Api::OpenAiChat, "openai/gpt-4o"), Encoding::O200kBase);
        assert_eq!(f(Api::Anthropic, "claude-sonnet-4-5"), Encoding::Cl100kBase);
        assert_eq!(f(Api::Gemini, "gemini-2.5-pro"), Encoding::O200kBase);
        assert_eq!(f(Api::Ollama, "llama3.1:8b"), Encoding::Cl100kBase);
        assert_eq!(Encoding::for_model(Api::Gemini, None), Encoding::O200kBase);
    }
}
