//! How a record writes a floating-point figure, NaN and infinities included.
//!
//! JSON has no NaN and no infinity. A diverged run still has a loss (NaN) and an overflowing
//! perplexity (+∞), and its records must say so and read back. Every `f64` of a record is
//! therefore written as:
//!
//! | value | JSON |
//! |-------|------|
//! | finite | a number (`0.25`, `-1e300`) |
//! | NaN | the string `"NaN"` |
//! | +∞ | the string `"Infinity"` |
//! | −∞ | the string `"-Infinity"` |
//!
//! These are the spellings of the protobuf (proto3) JSON mapping, which JavaScript's
//! `Number(…)` and Python's `float(…)` also parse. A NaN's sign and payload are not kept (a
//! NaN reads back as the canonical `f64::NAN`).
//!
//! Reading accepts a number, one of the three strings, or `null`. `null` is what earlier
//! trainers wrote for a value that was not finite: an optional figure (`Option<f64>`) reads
//! it as `None` ("not known"), a plain one (a phase time) as NaN. Any other string is an
//! error naming the accepted spellings.
//!
//! Finite values go through `serde_json`'s shortest round-trip formatting; its default
//! parser may read the last digit of a 17-digit mantissa one unit in the last place off
//! (its `float_roundtrip` feature makes that exact, at twice the parsing cost).
//!
//! Use with `#[serde(with = "dtrain_records::float::num")]` on an `f64` field and `…::opt`
//! on an `Option<f64>` one.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserializer, Serializer};

/// The JSON string of NaN.
pub const NAN: &str = "NaN";
/// The JSON string of +∞.
pub const INFINITY: &str = "Infinity";
/// The JSON string of −∞.
pub const NEG_INFINITY: &str = "-Infinity";

/// The string written for a non-finite `x`, or `None` when `x` is finite (written as a
/// number).
pub fn non_finite_name(x: f64) -> Option<&'static str> {
    if x.is_nan() {
        Some(NAN)
    } else if x == f64::INFINITY {
        Some(INFINITY)
    } else if x == f64::NEG_INFINITY {
        Some(NEG_INFINITY)
    } else {
        None
    }
}

/// The value of one of the three spellings.
pub fn parse_non_finite(s: &str) -> Option<f64> {
    match s {
        NAN => Some(f64::NAN),
        INFINITY => Some(f64::INFINITY),
        NEG_INFINITY => Some(f64::NEG_INFINITY),
        _ => None,
    }
}

fn write<S: Serializer>(x: f64, s: S) -> Result<S::Ok, S::Error> {
    match non_finite_name(x) {
        Some(name) => s.serialize_str(name),
        None => s.serialize_f64(x),
    }
}

/// What a figure read as: a value, or `null`.
struct Figure;

impl<'de> Visitor<'de> for Figure {
    type Value = Option<f64>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "a number, \"{NAN}\", \"{INFINITY}\", \"{NEG_INFINITY}\" or null"
        )
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Some(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Some(v as f64))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(v as f64))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        parse_non_finite(v)
            .map(Some)
            .ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(Figure)
    }
}

/// An `f64` field (`null` reads as NaN).
pub mod num {
    use super::*;

    /// Writes `x` (see the [module](super) table).
    pub fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
        write(*x, s)
    }

    /// Reads a number, a non-finite spelling, or `null` (NaN).
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(d.deserialize_any(Figure)?.unwrap_or(f64::NAN))
    }
}

/// An `Option<f64>` field (`None` is written as `null`, and `null` reads as `None`).
pub mod opt {
    use super::*;

    /// Writes `x` (see the [module](super) table), `None` as `null`.
    pub fn serialize<S: Serializer>(x: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        match x {
            Some(x) => write(*x, s),
            None => s.serialize_none(),
        }
    }

    /// Reads a number, a non-finite spelling, or `null` (`None`).
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        d.deserialize_option(Figure)
    }
}
