//! Per-content calibration: a ratio of real to estimated tokens for each
//! content class (`estimate/classes.rs`), learned from consecutive anchors,
//! so a turn of a kind a lane has not shown yet (a large CJK tool result
//! after logs and JSON) is projected with that kind's ratio, not with
//! whatever the earlier turns taught.
//!
//! # The fit
//!
//! Each pair of consecutive anchors of a lane is a sample: the real growth
//! `dr` and the estimate's growth per class `x_c`. A [`Fit`] solves
//!
//! ```text
//! dr = Σ_c ratio_c · x_c + overhead · sign(Σ_c x_c)
//! ```
//!
//! by weighted least squares regularised toward a prior (a Bayesian linear
//! regression with a Gaussian prior): it minimises
//! `Σ_t λ^age_t · w_t · (dr_t - ratio·x_t - overhead·s_t)²
//!  + Σ_c ((ratio_c - prior_c) / σ_c)² + (overhead / σ_o)²`.
//!
//! - `w_t = 1 / ((ν·|x_t|)² + ε²)`: a sample's noise grows with its size (a
//!   class's ratio strays a little from text to text, ν = 2%) plus a few
//!   tokens of rounding; a 5,000-token tool result and a 12-token turn each
//!   say what they can, neither drowns the other.
//! - `λ` per new sample: recent turns weigh more, and a class not seen for
//!   a while drifts back to its prior. A lane forgets fast ([`LANE_DECAY`]).
//! - Every lane's samples also feed its model's fit, which forgets slowly
//!   ([`MODEL_DECAY`]): pooled over sessions, classes that always arrive
//!   together in one lane (Han and kana in Japanese) come apart. The model's
//!   ratios, with the model fit's own uncertainty, are the prior of every
//!   lane: a class new to a lane starts there.
//! - A class the model has not seen either starts from the ratio of
//!   Latin-script text (the lane's or model's prose, JSON or code ratio,
//!   else the single ratio), raised for the kinds of text tokenizers
//!   disagree on by multiples ([`headroom`]: other scripts, emoji), with a
//!   wide σ so that its first sample moves it at once; a non-Latin script
//!   starts at least where the most expensive script known already is (a
//!   tokenizer that spends much on Han spends much on Hangul and
//!   Cyrillic). It errs high: an agent's gate should fire early, not late.
//!
//! A handful of samples cannot produce absurd ratios: a class the data
//! says little about (one always arriving with a larger one) stays near its
//! prior, the residual going to the class least known, and every ratio is
//! clamped to the plausible range.
//!
//! The state is the decayed normal equations (a packed symmetric matrix and
//! a vector over the unknowns seen), solved when a response is recorded,
//! off the request path; a request's projection reads solved ratios.

use serde::{Deserialize, Serialize};

use super::lane::{MIN_DELTA, RATIO_MAX, RATIO_MIN};
use crate::estimate::{Class, Classes, CLASSES};
use crate::metrics;
use crate::provider::Api;

/// Unknowns of the fit: one ratio per class, then the overhead per delta.
const DIMS: usize = CLASSES + 1;
const OVERHEAD: usize = CLASSES;
/// Entries of the packed upper triangle of the normal matrix.
const PACKED: usize = DIMS * (DIMS + 1) / 2;

/// Relative noise of a sample: how much one text's ratio strays from its class's.
const REL_NOISE: f64 = 0.02;
/// Absolute noise of a sample, in tokens (rounding, a framing token).
const ABS_NOISE: f64 = 6.0;
/// Share of a lane's evidence that survives each new sample.
pub(super) const LANE_DECAY: f64 = 0.8;
/// Share of a model's evidence that survives each new sample, any lane's.
pub(super) const MODEL_DECAY: f64 = 0.98;
/// Least prior uncertainty of a model's ratio, relative to it: sessions of
/// one model differ (one writes Japanese, another Chinese).
const SIGMA_MODEL: f64 = 0.03;
/// Prior uncertainty of the overhead per delta, in tokens.
const SIGMA_OVERHEAD: f64 = 2.0;
/// Largest overhead per delta believed, in tokens.
const OVERHEAD_MAX: f64 = 64.0;
/// A class is reported (`tidemark_class_drift_ratio`) from a sample it is
/// at least this share of, and at least [`MIN_DELTA`] tokens.
const TEACHING_SHARE: f64 = 0.2;

/// How much higher than Latin-script text a class starts, when the model
/// has not learned it: tokenizers disagree on other scripts and on emoji by
/// multiples, on code, base64 or quoted JSON by tens of percent either way
/// (a vocabulary without whitespace runs counts indentation dear, one with
/// them cheap), so only the first are raised.
fn headroom(c: Class) -> f64 {
    match c {
        Class::Prose
        | Class::Json
        | Class::Escaped
        | Class::Code
        | Class::Binary
        | Class::Framing
        | Class::Media => 1.0,
        Class::Emoji => 1.25,
        Class::Kana => 1.3,
        Class::Han | Class::Hangul | Class::Script => 1.5,
    }
}

/// How far from Latin-script text a class's ratio may be, relative to it,
/// when the model has not learned it: the prior's σ. Wide where tokenizers
/// differ most, so a class's first samples move it at once.
fn spread(c: Class) -> f64 {
    match c {
        Class::Prose | Class::Json => 0.3,
        Class::Binary => 0.4,
        Class::Escaped | Class::Framing | Class::Media => 0.5,
        Class::Code => 0.6,
        Class::Emoji => 0.8,
        Class::Kana => 0.9,
        Class::Han | Class::Hangul | Class::Script => 1.3,
    }
}

/// The non-Latin scripts.
const SCRIPTS: [Class; 4] = [Class::Han, Class::Kana, Class::Hangul, Class::Script];

/// What a fit knows of each class before its data: what a class with no
/// data is projected with, and the mean and standard deviation its data is
/// regularised toward.
#[derive(Debug, Clone, Copy)]
pub(super) struct Prior {
    /// Where a class with no data stands: errs high.
    pub start: [f64; CLASSES],
    /// The central guess a class's data is weighed against.
    pub ratio: [f64; CLASSES],
    pub sigma: [f64; CLASSES],
}

impl Prior {
    /// `model`'s ratio per class where it has one (σ its own uncertainty,
    /// at least [`SIGMA_MODEL`]). Else a class starts at `base` (the ratio
    /// of Latin-script text) with [`headroom`], a non-Latin script at least
    /// at `scripts` (the highest ratio of a script known), and its data is
    /// weighed against half that headroom (or `scripts`) with the class's
    /// [`spread`]: a class that arrives mixed into other content is neither
    /// left high by a sample that says little about it, nor pushes its
    /// excess onto the Latin text beside it.
    pub fn new(model: &ModelClasses, base: f64, scripts: Option<f64>) -> Prior {
        let mut p = Prior {
            start: [base; CLASSES],
            ratio: [base; CLASSES],
            sigma: [base; CLASSES],
        };
        for c in Class::ALL {
            let i = c as usize;
            match model.ratio[i].filter(|r| r.is_finite() && *r > 0.0) {
                Some(r) => {
                    p.start[i] = r;
                    p.ratio[i] = r;
                    p.sigma[i] = r * f64::from(model.spread[i]).max(SIGMA_MODEL);
                }
                None => {
                    let h = headroom(c);
                    let known = scripts.filter(|_| SCRIPTS.contains(&c));
                    p.start[i] = known.map_or(base * h, |s| s.max(base * h));
                    p.ratio[i] = known.unwrap_or(base * (1.0 + (h - 1.0) / 2.0));
                    p.sigma[i] = base * spread(c);
                }
            }
        }
        p
    }
}

/// A model's ratio per class, learned across sessions: the prior of its lanes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ModelClasses {
    pub ratio: [Option<f64>; CLASSES],
    /// The model fit's uncertainty of each ratio, relative to it (0: unknown).
    pub spread: [f32; CLASSES],
}

impl ModelClasses {
    /// The highest ratio of a non-Latin script the model knows, if any.
    pub(super) fn scripts(&self) -> Option<f64> {
        SCRIPTS
            .iter()
            .filter_map(|c| self.ratio[*c as usize])
            .reduce(f64::max)
    }

    /// The ratio of Latin-script text the model knows, if any.
    pub(super) fn latin(&self) -> Option<f64> {
        [Class::Prose, Class::Json, Class::Code]
            .into_iter()
            .find_map(|c| self.ratio[c as usize])
    }
}

/// One sample: the estimate's growth per class (and the overhead's sign),
/// the real growth, and its weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Sample {
    x: [f64; DIMS],
    dr: f64,
    w: f64,
    /// `Σ_c |x_c|`.
    size: f64,
}

impl Sample {
    /// The growth from `from` to `to` whose real growth was `dr`; `None` when
    /// nothing grew or shrank.
    pub fn new(from: &Classes, to: &Classes, dr: f64) -> Option<Sample> {
        let mut x = [0f64; DIMS];
        let (mut size, mut net) = (0.0, 0.0);
        for ((x, t), f) in x.iter_mut().zip(to.0).zip(from.0) {
            *x = f64::from(t) - f64::from(f);
            size += x.abs();
            net += *x;
        }
        if size == 0.0 || !dr.is_finite() {
            return None;
        }
        x[OVERHEAD] = if net >= 0.0 { 1.0 } else { -1.0 };
        let w = 1.0 / ((REL_NOISE * size).powi(2) + ABS_NOISE * ABS_NOISE);
        Some(Sample { x, dr, w, size })
    }
}

/// Decayed, regularised least squares over the classes (see the module doc).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Fit {
    /// Unknowns with evidence, a bit each (bit [`CLASSES`]: the overhead).
    #[serde(default)]
    pub seen: u16,
    /// The decayed normal equations: the packed upper triangle of `Σ w·x·xᵀ`,
    /// then `Σ w·x·dr`. Empty until the first sample.
    #[serde(default)]
    pub eq: Vec<f32>,
    /// Solved ratio per class (meaningful where `seen`).
    #[serde(default)]
    pub ratios: [f32; CLASSES],
    /// Solved overhead per delta, tokens.
    #[serde(default)]
    pub overhead: f32,
    /// Posterior standard deviation of each ratio, relative to it.
    #[serde(default, skip_serializing)]
    pub spread: [f32; CLASSES],
    /// The prior of each class seen, as it was when the class was first
    /// seen: a lane's ratio is its own data's and its own prior's, never
    /// moved by what another lane teaches the model afterwards.
    #[serde(default)]
    pub prior: [f32; CLASSES],
    #[serde(default)]
    pub sigma: [f32; CLASSES],
}

/// Index of `(i, j)`, `i <= j`, in the packed upper triangle.
const fn packed(i: usize, j: usize) -> usize {
    i * DIMS - i * (i + 1) / 2 + j
}

impl Fit {
    fn knows(&self, c: Class) -> bool {
        self.seen & (1 << c as usize) != 0
    }

    /// The ratio of class `c`: the fit's own where it has evidence, else
    /// where the prior starts it.
    pub(super) fn ratio(&self, c: Class, prior: &Prior) -> f64 {
        if self.knows(c) {
            f64::from(self.ratios[c as usize])
        } else {
            prior.start[c as usize]
        }
    }

    /// The highest ratio of a non-Latin script this fit knows, if any.
    fn scripts(&self) -> Option<f64> {
        SCRIPTS
            .iter()
            .filter(|c| self.knows(**c))
            .map(|c| f64::from(self.ratios[*c as usize]))
            .reduce(f64::max)
    }

    /// The ratio of Latin-script text this fit knows, if any.
    fn latin(&self) -> Option<f64> {
        [Class::Prose, Class::Json, Class::Code]
            .into_iter()
            .find(|c| self.knows(*c))
            .map(|c| f64::from(self.ratios[c as usize]))
    }

    /// Take in one sample, the evidence so far decayed by `decay`, and re-solve.
    pub(super) fn add(&mut self, s: &Sample, decay: f64, prior: &Prior) {
        if self.eq.len() != PACKED + DIMS {
            self.eq = vec![0.0; PACKED + DIMS];
        }
        for v in self.eq.iter_mut() {
            *v = (f64::from(*v) * decay) as f32;
        }
        let x = &s.x;
        for i in 0..DIMS {
            if x[i] == 0.0 {
                continue;
            }
            if i < CLASSES && self.seen & (1 << i) == 0 {
                self.prior[i] = prior.ratio[i] as f32;
                self.sigma[i] = prior.sigma[i] as f32;
            }
            self.seen |= 1 << i;
            for j in i..DIMS {
                if x[j] != 0.0 {
                    let k = packed(i, j);
                    self.eq[k] = (f64::from(self.eq[k]) + s.w * x[i] * x[j]) as f32;
                }
            }
            let k = PACKED + i;
            self.eq[k] = (f64::from(self.eq[k]) + s.w * x[i] * s.dr) as f32;
        }
        self.solve();
    }

    /// Solve the regularised normal equations over the unknowns seen.
    fn solve(&mut self) {
        let dims: Vec<usize> = (0..DIMS).filter(|i| self.seen & (1 << i) != 0).collect();
        let n = dims.len();
        if n == 0 || self.eq.len() != PACKED + DIMS {
            return;
        }
        let prior_of = |i: usize| -> (f64, f64) {
            if i == OVERHEAD {
                (0.0, SIGMA_OVERHEAD)
            } else {
                (f64::from(self.prior[i]), f64::from(self.sigma[i]).max(1e-6))
            }
        };
        // M = A + diag(1/σ²), rhs = b + p/σ², over the unknowns seen.
        let mut m = vec![0f64; n * n];
        let mut rhs = vec![0f64; n];
        for (r, &i) in dims.iter().enumerate() {
            for (c, &j) in dims.iter().enumerate() {
                let (a, b) = if i <= j { (i, j) } else { (j, i) };
                m[r * n + c] = f64::from(self.eq[packed(a, b)]);
            }
            let (pi, si) = prior_of(i);
            m[r * n + r] += 1.0 / (si * si);
            rhs[r] = f64::from(self.eq[PACKED + i]) + pi / (si * si);
        }
        if !cholesky(&mut m, n) {
            return;
        }
        let sol = cholesky_solve(&m, &rhs, n);
        for (r, &i) in dims.iter().enumerate() {
            let v = sol[r];
            if i == OVERHEAD {
                self.overhead = if v.is_finite() {
                    v.clamp(-OVERHEAD_MAX, OVERHEAD_MAX) as f32
                } else {
                    0.0
                };
                continue;
            }
            let v = if v.is_finite() {
                v
            } else {
                f64::from(self.prior[i])
            };
            let v = v.clamp(RATIO_MIN, RATIO_MAX);
            self.ratios[i] = v as f32;
            // The posterior variance is the diagonal of M⁻¹: its column r.
            let mut e = vec![0f64; n];
            e[r] = 1.0;
            let var = cholesky_solve(&m, &e, n)[r];
            self.spread[i] = (var.max(0.0).sqrt() / v) as f32;
        }
    }

    /// The ratios the fit has learned, by class name, for `/sessions`.
    pub fn render(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for c in Class::ALL.into_iter().filter(|c| self.knows(*c)) {
            let r = (f64::from(self.ratios[c as usize]) * 10_000.0).round() / 10_000.0;
            m.insert(c.name().into(), r.into());
        }
        serde_json::Value::Object(m)
    }

    /// The model's ratios as its lanes' prior.
    pub(super) fn model_classes(&self) -> ModelClasses {
        let mut mc = ModelClasses::default();
        for c in Class::ALL.into_iter().filter(|c| self.knows(*c)) {
            mc.ratio[c as usize] = Some(f64::from(self.ratios[c as usize]));
            mc.spread[c as usize] = self.spread[c as usize];
        }
        mc
    }
}

/// Factor a symmetric positive definite `n × n` matrix in place into its
/// lower Cholesky factor; false if it is not positive definite.
fn cholesky(m: &mut [f64], n: usize) -> bool {
    for j in 0..n {
        let mut d = m[j * n + j];
        for k in 0..j {
            d -= m[j * n + k] * m[j * n + k];
        }
        if d.is_nan() || d <= 0.0 {
            return false;
        }
        let d = d.sqrt();
        m[j * n + j] = d;
        for i in j + 1..n {
            let mut s = m[i * n + j];
            for k in 0..j {
                s -= m[i * n + k] * m[j * n + k];
            }
            m[i * n + j] = s / d;
        }
    }
    true
}

/// Solve `L·Lᵀ·x = rhs` with the factor [`cholesky`] left in `m`.
fn cholesky_solve(m: &[f64], rhs: &[f64], n: usize) -> Vec<f64> {
    let mut y = rhs.to_vec();
    for i in 0..n {
        let mut s = y[i];
        for k in 0..i {
            s -= m[i * n + k] * y[k];
        }
        y[i] = s / m[i * n + i];
    }
    for i in (0..n).rev() {
        let mut s = y[i];
        for k in i + 1..n {
            s -= m[k * n + i] * y[k];
        }
        y[i] = s / m[i * n + i];
    }
    y
}

/// A lane's per-class calibration: its fit and where its samples start.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClassCal {
    /// Per-class estimate of the lane's reference point (its last anchor):
    /// where the next sample's growth, and a projection's delta, start.
    #[serde(default)]
    pub at: Classes,
    /// The reference's total estimate (`at` belongs to an anchor of this estimate).
    #[serde(default)]
    pub at_total: u64,
    #[serde(default)]
    pub fit: Fit,
}

/// What one sample of a lane taught.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Taught {
    /// The sample, for the model's fit.
    pub sample: Option<Sample>,
    /// The lane's ratio of each class the sample was mostly made of (the
    /// `tidemark_class_drift_ratio` gauge).
    pub classes: [Option<f64>; CLASSES],
}

impl ClassCal {
    /// The reference moved to an anchor of estimate `total` with these classes.
    pub fn rebase(&mut self, classes: Classes, total: u64) {
        self.at = classes;
        self.at_total = total;
    }

    /// Whether `at` is the reference of estimate `total`.
    pub fn based_at(&self, total: u64) -> bool {
        self.at_total == total && !self.at.is_empty()
    }

    /// The prior of this lane's classes: the model's ratios, else Latin
    /// text's ratio (the lane's own first, then the model's, then `single`)
    /// with headroom.
    pub(super) fn prior(&self, model: &ModelClasses, single: f64) -> Prior {
        let base = self.fit.latin().or(model.latin()).unwrap_or(single);
        let scripts = match (self.fit.scripts(), model.scripts()) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        Prior::new(model, base, scripts)
    }

    /// The ruler that projects class by class from the reference of
    /// estimate `base`, if the lane knows that reference's classes: each
    /// class's own ratio, else the model's, else a start above `single`.
    pub(super) fn ruler_at(
        &self,
        base: u64,
        model: &ModelClasses,
        single: f64,
    ) -> Option<ClassRuler> {
        self.based_at(base)
            .then(|| self.ruler(&self.prior(model, single)))
    }

    /// The ruler that projects from the reference, class by class.
    pub(super) fn ruler(&self, prior: &Prior) -> ClassRuler {
        let mut ratios = [0f32; CLASSES];
        for c in Class::ALL {
            ratios[c as usize] = self.fit.ratio(c, prior) as f32;
        }
        let overhead = if self.fit.seen & (1 << OVERHEAD) != 0 {
            self.fit.overhead
        } else {
            0.0
        };
        ClassRuler {
            base: self.at,
            ratios,
            overhead,
        }
    }

    /// A new anchor of estimate `now` followed the reference of estimate
    /// `from`, `dr` real tokens apart: learn from it if the lane knows the
    /// classes of both, against the model's ratios (and `single`, the
    /// lane's single ratio), and export what it taught
    /// (`tidemark_class_drift_ratio` of `(api, model)`).
    pub(super) fn learn_anchor(
        &mut self,
        (from, now): (u64, &Classes),
        dr: f64,
        (model, single): (&ModelClasses, f64),
        (api, name): (Api, Option<&str>),
    ) -> Taught {
        if !self.based_at(from) || now.is_empty() {
            return Taught::default();
        }
        let prior = self.prior(model, single);
        let taught = self.learn(now, dr, &prior);
        if taught.classes.iter().any(Option::is_some) {
            let m = metrics::get();
            let label = m.model_label(name);
            for c in Class::ALL {
                if let Some(r) = taught.classes[c as usize] {
                    m.class_drift
                        .with_label_values(&[api.as_str(), &label, c.name()])
                        .set(r);
                }
            }
        }
        taught
    }

    /// Learn from the growth from the reference to `now` (per class) whose
    /// real growth was `dr`.
    pub(super) fn learn(&mut self, now: &Classes, dr: f64, prior: &Prior) -> Taught {
        let Some(s) = Sample::new(&self.at, now, dr) else {
            return Taught::default();
        };
        self.fit.add(&s, LANE_DECAY, prior);
        let mut taught = Taught {
            sample: Some(s),
            ..Taught::default()
        };
        for c in Class::ALL {
            let xi = s.x[c as usize].abs();
            if xi >= MIN_DELTA as f64 && xi >= TEACHING_SHARE * s.size {
                taught.classes[c as usize] = Some(f64::from(self.fit.ratios[c as usize]));
            }
        }
        taught
    }

    /// The ratios the lane has learned, by class name, for `/sessions`.
    pub fn render(&self) -> serde_json::Value {
        self.fit.render()
    }
}

/// How a projection measures a request class by class from a reference:
/// `base_real + Σ_c ratio_c · (estimate_c - base_c) + overhead`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClassRuler {
    /// The reference's estimate per class.
    pub base: Classes,
    pub ratios: [f32; CLASSES],
    /// Added once to a delta that grows (taken off one that shrinks).
    pub overhead: f32,
}

impl ClassRuler {
    /// The projected real growth from the reference to `classes`.
    pub fn delta(&self, classes: &Classes) -> f64 {
        let mut d = 0.0;
        let mut net = 0.0;
        for i in 0..CLASSES {
            let x = f64::from(classes.0[i]) - f64::from(self.base.0[i]);
            d += f64::from(self.ratios[i]) * x;
            net += x;
        }
        if net > 0.0 {
            d += f64::from(self.overhead);
        } else if net < 0.0 {
            d -= f64::from(self.overhead);
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classes(pairs: &[(Class, u32)]) -> Classes {
        let mut c = Classes::default();
        for (k, n) in pairs {
            c.0[*k as usize] = *n;
        }
        c
    }

    fn model(pairs: &[(Class, f64)]) -> ModelClasses {
        let mut m = ModelClasses::default();
        for (c, r) in pairs {
            m.ratio[*c as usize] = Some(*r);
        }
        m
    }

    /// Two classes of different ratios, arriving in changing mixes: the fit
    /// finds each, where one ratio for all cannot.
    #[test]
    fn separates_classes_that_arrive_mixed() {
        let (prose, han) = (1.05, 1.9);
        let mut cal = ClassCal::default();
        let mut at = Classes::default();
        let none = ModelClasses::default();
        for t in 0..8u32 {
            let now = classes(&[
                (Class::Prose, at.0[0] + 400 + 97 * (t % 3)),
                (Class::Han, at.0[Class::Han as usize] + 50 + 180 * (t % 2)),
            ]);
            let h = Class::Han as usize;
            let dr = prose * f64::from(now.0[0] - at.0[0]) + han * f64::from(now.0[h] - at.0[h]);
            let p = cal.prior(&none, 1.1);
            cal.learn(&now, dr, &p);
            cal.rebase(now, now.sum());
            at = now;
        }
        let p = cal.prior(&none, 1.1);
        assert!(
            (cal.fit.ratio(Class::Prose, &p) - prose).abs() < 0.02,
            "{cal:?}"
        );
        assert!(
            (cal.fit.ratio(Class::Han, &p) - han).abs() < 0.05,
            "{cal:?}"
        );
    }

    /// One sample of a class arriving with a larger one barely moves the
    /// large one's well-known ratio: the residual goes to the one the lane
    /// knows least about. A tiny sample teaches next to nothing.
    #[test]
    fn a_handful_of_samples_never_gives_absurd_ratios() {
        let p = Prior::new(&model(&[(Class::Json, 1.0)]), 1.0, None);
        let mut cal = ClassCal::default();
        let now = classes(&[(Class::Json, 400), (Class::Han, 60)]);
        cal.learn(&now, 400.0 + 1.6 * 60.0, &p);
        let json = cal.fit.ratio(Class::Json, &p);
        let han = cal.fit.ratio(Class::Han, &p);
        assert!((json - 1.0).abs() < 0.03, "json {json}");
        assert!(han > 1.3 && han < 2.0, "han {han}");
        let mut cal = ClassCal::default();
        let now = classes(&[(Class::Emoji, 3)]);
        cal.learn(&now, 40.0, &p);
        let e = cal.fit.ratio(Class::Emoji, &p);
        assert!(e < 3.0, "emoji {e}");
    }

    #[test]
    fn unseen_classes_start_from_the_model_or_above_latin_text() {
        let p = ClassCal::default().prior(&model(&[(Class::Han, 1.42)]), 1.1);
        let f = Fit::default();
        assert_eq!(f.ratio(Class::Han, &p), 1.42);
        assert_eq!(f.ratio(Class::Prose, &p), 1.1);
        for c in Class::ALL {
            assert!(f.ratio(c, &p) >= 1.1, "{c:?} never below Latin text");
        }
        // Latin text's ratio, not the single ratio a CJK-heavy lane learned.
        let p = ClassCal::default().prior(&model(&[(Class::Prose, 1.0)]), 2.5);
        assert_eq!(f.ratio(Class::Binary, &p), 1.0);
        assert_eq!(f.ratio(Class::Emoji, &p), 1.25);
        assert_eq!(f.ratio(Class::Hangul, &p), 1.5);
        // A script new to the model starts at least where the dearest known one is.
        let p = ClassCal::default().prior(&model(&[(Class::Prose, 1.0), (Class::Han, 2.9)]), 1.0);
        assert_eq!(f.ratio(Class::Hangul, &p), 2.9);
        assert_eq!(f.ratio(Class::Emoji, &p), 1.25, "not a script");
    }

    /// The model pools every lane's samples: Han and kana, always together
    /// in one lane's Japanese, come apart against another lane's Chinese.
    #[test]
    fn the_model_pools_lanes() {
        let (han, kana) = (2.0, 0.9);
        let none = ModelClasses::default();
        let mut m = Fit::default();
        for (h, k) in [(600u32, 400u32), (900, 0), (500, 420), (1000, 10)] {
            let s = Sample::new(
                &Classes::default(),
                &classes(&[(Class::Han, h), (Class::Kana, k)]),
                han * f64::from(h) + kana * f64::from(k),
            )
            .unwrap();
            m.add(&s, MODEL_DECAY, &Prior::new(&none, 1.0, None));
        }
        let mc = m.model_classes();
        let (h, k) = (
            mc.ratio[Class::Han as usize].unwrap(),
            mc.ratio[Class::Kana as usize].unwrap(),
        );
        assert!((h - han).abs() < 0.03 && (k - kana).abs() < 0.05, "{h} {k}");
        assert!(mc.spread[Class::Han as usize] < 0.05, "{mc:?}");
    }

    #[test]
    fn the_ruler_projects_class_by_class() {
        let base = classes(&[(Class::Prose, 1000), (Class::Han, 100)]);
        let mut ratios = [1.0f32; CLASSES];
        ratios[Class::Han as usize] = 2.0;
        let r = ClassRuler {
            base,
            ratios,
            overhead: 3.0,
        };
        let now = classes(&[(Class::Prose, 1100), (Class::Han, 600)]);
        assert_eq!(r.delta(&now), 100.0 + 1000.0 + 3.0);
        assert_eq!(r.delta(&base), 0.0);
        let less = classes(&[(Class::Prose, 900), (Class::Han, 100)]);
        assert_eq!(r.delta(&less), -100.0 - 3.0);
    }
}
