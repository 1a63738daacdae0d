//! The estimator's side of the message walk: a provider walks one unit of
//! its request (`Provider::walk`, in its own file) and reports to a
//! [`Ctx`], which tokenizes the text, attributes it to classes and prices
//! images and documents by the API's rule.

use super::classes::{self, Class, Classes};
use super::images::{self, Detail, Size};
use super::tokenizer::Encoding;
use crate::provider::{Api, Count, ImagePricing};

/// A running count for one unit.
pub struct Ctx<'m> {
    pub enc: Encoding,
    pub api: Api,
    pub model: Option<&'m str>,
    /// Tokens by class; the unit's tokens are their sum.
    pub classes: Classes,
    pub chars: u64,
    /// Bytes handed to the tokenizer (what the incremental test watches).
    pub tokenized: u64,
}

impl Ctx<'_> {
    /// An image of `size` (`None`: unknown) by the API's rule.
    fn image(&mut self, pricing: ImagePricing, size: Option<Size>, detail: Detail) {
        let n = match pricing {
            ImagePricing::Anthropic => images::anthropic_tokens(size),
            ImagePricing::Gemini => images::gemini_tokens(size),
            ImagePricing::Flat => images::OLLAMA_IMAGE,
            ImagePricing::OpenAi => images::openai_tokens(size, detail, self.model),
        };
        self.classes.add(Class::Media, n);
    }
}

impl Count for Ctx<'_> {
    fn text(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        let n = self.enc.count(s) as u64;
        self.chars += classes::attribute(self.enc, s, n, &mut self.classes);
        self.tokenized += s.len() as u64;
    }

    fn framing_text(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        self.classes.add(Class::Framing, self.enc.count(s) as u64);
        self.chars += s.chars().count() as u64;
        self.tokenized += s.len() as u64;
    }

    fn framing(&mut self, n: u64) {
        self.classes.add(Class::Framing, n);
    }

    fn image_url(&mut self, url: &str, detail: Detail) {
        let pricing = self.api.provider().image_pricing();
        let size = match pricing {
            // A flat price needs no size.
            ImagePricing::Flat => None,
            _ => images::data_url_payload(url).and_then(images::sniff_base64),
        };
        self.image(pricing, size, detail);
    }

    fn image_data(&mut self, base64: Option<&str>) {
        let pricing = self.api.provider().image_pricing();
        let size = match pricing {
            ImagePricing::Flat => None,
            _ => base64.and_then(images::sniff_base64),
        };
        self.image(pricing, size, Detail::High);
    }

    fn document(&mut self) {
        self.classes.add(Class::Media, images::DOCUMENT_DEFAULT);
    }
}
