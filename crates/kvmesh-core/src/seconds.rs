//! Serde for settings the core keeps as `f64` seconds (its arithmetic is in seconds), written
//! in config files as human-readable durations: `"250ms"`, `"2s"`, `"1m 30s"` (the `humantime`
//! crate's grammar). Use as `#[serde(with = "kvmesh_core::seconds")]`.

use serde::ser::Error as _;
use serde::{Deserializer, Serializer};
use std::time::Duration;

/// Writes `secs` as a duration (`0.25` → `"250ms"`).
///
/// # Errors
/// `secs` is negative, not finite or too large for a [`Duration`].
pub fn serialize<S: Serializer>(secs: &f64, s: S) -> Result<S::Ok, S::Error> {
    let d = Duration::try_from_secs_f64(*secs).map_err(|_| S::Error::custom(format!("{secs} s is not a duration")))?;
    s.collect_str(&humantime::format_duration(d))
}

/// Reads a duration as seconds (`"1m 30s"` → `90.0`).
///
/// # Errors
/// Not a string, or not a duration in humantime's grammar; the message quotes the text and
/// gives examples.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    d.deserialize_str(Text)
}

struct Text;

impl serde::de::Visitor<'_> for Text {
    type Value = f64;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a duration as text, like \"250ms\" or \"2s\"")
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<f64, E> {
        parse(text).map_err(E::custom)
    }
}

/// `text` as seconds.
///
/// # Errors
/// A message quoting `text` when it is not a duration in humantime's grammar.
pub fn parse(text: &str) -> Result<f64, String> {
    humantime::parse_duration(text).map(|d| d.as_secs_f64()).map_err(|e| {
        // humantime lists every unit it reads (months, years…); the caller's hint lists the
        // ones worth writing, once.
        let e = e.to_string();
        let why = e.split(", supported units").next().unwrap_or(&e);
        format!("{text:?} is not a duration ({why}); write one like \"250ms\", \"2s\" or \"1m 30s\"")
    })
}

#[cfg(test)]
mod tests {
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct S {
        #[serde(with = "super")]
        t: f64,
    }

    #[test]
    fn durations_read_and_write_as_text() {
        let s: S = serde_json::from_str(r#"{"t": "1m 30s"}"#).unwrap();
        assert_eq!(s.t, 90.0);
        assert_eq!(serde_json::to_string(&S { t: 0.25 }).unwrap(), r#"{"t":"250ms"}"#);
        assert_eq!(serde_json::to_string(&S { t: 0.0 }).unwrap(), r#"{"t":"0s"}"#);
        let back: S = serde_json::from_str(&serde_json::to_string(&S { t: 0.1 }).unwrap()).unwrap();
        assert_eq!(back.t, 0.1);
        let e = serde_json::from_str::<S>(r#"{"t": "2 fortnights"}"#).unwrap_err().to_string();
        assert!(e.contains("\"2 fortnights\" is not a duration (unknown time unit \"fortnights\"); write"), "{e}");
        assert!(serde_json::from_str::<S>(r#"{"t": 2}"#).is_err());
        assert!(serde_json::to_string(&S { t: -1.0 }).is_err());
    }
}
