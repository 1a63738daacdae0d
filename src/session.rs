//! STUB: sessions, anchors, projection (replaced by the session branch).
use std::time::{Duration, Instant};

use crate::provider::{Api, Usage};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Src {
    Anchored,
    Counted,
    Calibrated,
    Estimate,
    Lost,
}

impl Src {
    pub fn as_str(self) -> &'static str {
        match self {
            Src::Anchored => "anchored",
            Src::Counted => "counted",
            Src::Calibrated => "calibrated",
            Src::Estimate => "estimate",
            Src::Lost => "lost",
        }
    }
}

pub struct SessionConfig {
    pub ttl: Duration,
    pub max_sessions: usize,
}

pub struct RequestFacts {
    pub key: Option<String>,
    pub credential: String,
    pub api: Api,
    pub model: Option<String>,
    pub estimate: u64,
    pub reset: bool,
    pub window: Option<u64>,
    pub counted: Option<u64>,
    pub continues: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Projection {
    pub tokens: u64,
    pub src: Src,
    pub window: Option<u64>,
    pub turns_left: Option<u64>,
}

impl Projection {
    pub fn util(&self) -> Option<f64> {
        self.window
            .filter(|w| *w > 0)
            .map(|w| self.tokens as f64 / w as f64)
    }
    pub fn header_value(&self) -> String {
        format!("{};src={}", self.tokens, self.src.as_str())
    }
}

pub struct Ticket;

pub struct Begun {
    pub projection: Projection,
    pub ticket: Ticket,
    pub spent: u64,
    pub key: Option<String>,
}

pub struct Outcome {
    pub status: u16,
    pub usage: Usage,
    pub response_id: Option<String>,
    pub completed: bool,
}

pub struct Sessions;

impl Sessions {
    pub fn new(_cfg: SessionConfig) -> Self {
        Sessions
    }
    pub fn begin(&self, facts: RequestFacts) -> Begun {
        Begun {
            projection: Projection {
                tokens: facts.estimate,
                src: Src::Estimate,
                window: facts.window,
                turns_left: None,
            },
            ticket: Ticket,
            spent: 0,
            key: facts.key,
        }
    }
    pub fn finish(&self, _ticket: Ticket, _outcome: Outcome) {}
    pub fn sweep(&self, _now: Instant) {}
    pub fn list(&self, _limit: usize) -> serde_json::Value {
        serde_json::json!({"total": 0, "sessions": []})
    }
    pub fn get(&self, _key: &str, _credential: Option<&str>) -> Option<serde_json::Value> {
        None
    }
    pub fn reset(&self, _key: &str) -> bool {
        false
    }
    pub fn len(&self) -> usize {
        0
    }
    pub fn is_empty(&self) -> bool {
        true
    }
}
