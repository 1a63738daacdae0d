//! Context window sizes: `--context-window PATTERN=N` rules first, then a
//! built-in table of published windows (tests/fixtures/README.md §8).
pub mod learned;

use crate::config::WindowRule;

/// Published windows, most specific pattern first; the first match wins.
/// Patterns are lower-case globs where `*` matches any run of characters;
/// model names are compared lower-cased, and a provider prefix such as
/// `models/` (Gemini) or `openai/` (routers) is ignored.
///
/// Where a family has a long-context beta (Claude 1M), the table holds the
/// default window; `--context-window` overrides it.
const BUILTIN: &[(&str, u64)] = &[
    // OpenAI
    ("gpt-4o-2024-05-13*", 128_000),
    ("gpt-4o*", 128_000),
    ("chatgpt-4o*", 128_000),
    ("gpt-4.1*", 1_047_576),
    ("gpt-4-turbo*", 128_000),
    ("gpt-4-32k*", 32_768),
    ("gpt-4", 8_192),
    ("gpt-4-0*", 8_192),
    ("gpt-3.5-turbo*", 16_385),
    ("gpt-5*", 400_000),
    ("o1-mini*", 128_000),
    ("o1*", 200_000),
    ("o3*", 200_000),
    ("o4-mini*", 200_000),
    ("gpt-oss*", 131_072),
    // Anthropic: 200K by default (1M only behind a beta header), except the
    // models published with 1M as their window.
    ("claude-sonnet-4-6*", 1_000_000),
    ("claude-opus-4-6*", 1_000_000),
    ("claude-*", 200_000),
    // Google
    ("gemini-1.5-pro*", 2_097_152),
    ("gemini-1.5*", 1_048_576),
    ("gemini-2*", 1_048_576),
    ("gemini-3*", 1_048_576),
    ("gemma-3*", 131_072),
    ("gemma-2*", 8_192),
    // Open models, as named by Ollama and most OpenAI-compatible servers.
    ("llama3.1*", 131_072),
    ("llama-3.1*", 131_072),
    ("llama3.2*", 131_072),
    ("llama-3.2*", 131_072),
    ("llama3.3*", 131_072),
    ("llama-3.3*", 131_072),
    ("llama3*", 8_192),
    ("llama-3*", 8_192),
    ("qwen2.5*", 32_768),
    ("qwen3*", 40_960),
    ("mistral-large*", 131_072),
    ("mistral-nemo*", 131_072),
    ("mistral*", 32_768),
    ("mixtral*", 32_768),
    ("deepseek-r1*", 131_072),
    ("deepseek-v3*", 131_072),
    ("deepseek-chat*", 131_072),
    ("phi3*", 131_072),
    ("phi4*", 16_384),
];

/// The context window of `model`: the first matching user rule, else the
/// built-in table, else unknown. (What an upstream taught sits between the
/// two: `window/learned.rs`.)
pub fn window_for(rules: &[WindowRule], model: &str) -> Option<u64> {
    flag_window(rules, model).or_else(|| table_window(model))
}

/// The window the first matching `--context-window` rule gives `model`.
pub fn flag_window(rules: &[WindowRule], model: &str) -> Option<u64> {
    rules
        .iter()
        .find(|r| glob_match(&r.glob, model))
        .map(|r| r.tokens)
}

/// The built-in table's window of `model`.
pub fn table_window(model: &str) -> Option<u64> {
    with_base_name(model.trim(), |name| {
        BUILTIN
            .iter()
            .find(|(g, _)| glob_match(g, name))
            .map(|(_, n)| *n)
    })
}

pub use crate::provider::with_base_name;

/// Whole-string glob match where `*` matches any run (possibly empty) of
/// characters and everything else matches itself.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p = pattern.as_bytes();
    let t = text.as_bytes();
    let (mut pi, mut ti) = (0usize, 0usize);
    // Where the last `*` was and which text position it is trying to cover.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(glob: &str, tokens: u64) -> WindowRule {
        WindowRule {
            glob: glob.to_string(),
            tokens,
        }
    }

    #[test]
    fn base_name_is_lowercased_without_its_router_prefix() {
        let base = |m: &str| with_base_name(m, str::to_string);
        assert_eq!(base("OpenAI/GPT-4o"), "gpt-4o");
        assert_eq!(base("models/Gemini-2.5-Pro"), "gemini-2.5-pro");
        assert_eq!(base("Claude-Ünïcode"), "claude-Ünïcode");
        // Past the stack buffer, the same answer from the heap.
        let long = format!("Router/{}", "AbC".repeat(60));
        assert_eq!(base(&long), "abc".repeat(60));
        assert_eq!(base(""), "");
    }

    #[test]
    fn glob() {
        assert!(glob_match("*", ""));
        assert!(glob_match("*", "anything"));
        assert!(glob_match("gpt-4o*", "gpt-4o"));
        assert!(glob_match("gpt-4o*", "gpt-4o-mini"));
        assert!(!glob_match("gpt-4o*", "gpt-4"));
        assert!(glob_match("claude-*-4*", "claude-sonnet-4-5"));
        assert!(!glob_match("claude-*-4*", "claude-3-opus"));
        assert!(glob_match("a*b*c", "aXXbYYc"));
        assert!(!glob_match("a*b*c", "aXXbYYcd"));
        assert!(glob_match("exact", "exact"));
        assert!(!glob_match("exact", "exactly"));
        assert!(glob_match("*mini", "o4-mini"));
    }

    #[test]
    fn builtin_table() {
        let none: &[WindowRule] = &[];
        assert_eq!(window_for(none, "gpt-4o"), Some(128_000));
        assert_eq!(window_for(none, "gpt-4o-2024-08-06"), Some(128_000));
        assert_eq!(window_for(none, "gpt-4o-mini"), Some(128_000));
        assert_eq!(window_for(none, "gpt-4.1"), Some(1_047_576));
        assert_eq!(window_for(none, "gpt-4.1-mini"), Some(1_047_576));
        assert_eq!(window_for(none, "gpt-5"), Some(400_000));
        assert_eq!(window_for(none, "gpt-5-mini"), Some(400_000));
        assert_eq!(window_for(none, "o3"), Some(200_000));
        assert_eq!(window_for(none, "o4-mini"), Some(200_000));
        assert_eq!(
            window_for(none, "claude-sonnet-4-5-20250929"),
            Some(200_000)
        );
        assert_eq!(window_for(none, "claude-3-5-haiku-latest"), Some(200_000));
        assert_eq!(window_for(none, "claude-opus-4-6"), Some(1_000_000));
        assert_eq!(window_for(none, "gemini-2.5-pro"), Some(1_048_576));
        assert_eq!(window_for(none, "models/gemini-2.0-flash"), Some(1_048_576));
        assert_eq!(window_for(none, "gemini-1.5-flash"), Some(1_048_576));
        assert_eq!(window_for(none, "llama3.1:8b"), Some(131_072));
        assert_eq!(window_for(none, "llama3:8b"), Some(8_192));
        assert_eq!(window_for(none, "GPT-4o"), Some(128_000));
        assert_eq!(window_for(none, "openai/gpt-4o"), Some(128_000));
        assert_eq!(window_for(none, "some-private-model"), None);
        assert_eq!(window_for(none, ""), None);
    }

    #[test]
    fn user_rules_win_in_order() {
        let rules = [rule("claude-*", 1_000_000), rule("*", 32_000)];
        assert_eq!(window_for(&rules, "claude-sonnet-4-5"), Some(1_000_000));
        assert_eq!(window_for(&rules, "gpt-4o"), Some(32_000));
        assert_eq!(window_for(&rules, "my-model"), Some(32_000));
        let rules = [rule("my-model", 65_536)];
        assert_eq!(window_for(&rules, "my-model"), Some(65_536));
        assert_eq!(window_for(&rules, "my-model-2"), None);
        assert_eq!(window_for(&rules, "gpt-4o"), Some(128_000));
    }
}
