//! Sections that are the node's own keys and a core config's keys in one TOML table
//! (`[autoscaler]`: `enabled`, `pool`, … beside `kvmesh_core::autoscale::AutoscaleConfig`'s
//! `interval`, `cold_start`, …), each part strict.
//!
//! Why not `#[serde(flatten)]` for reading: serde does not support `deny_unknown_fields` with
//! it, so a misspelt key would be ignored silently. Here each key goes to the part that reads
//! it, and a key neither reads is serde's usual "unknown field" error, listing both parts'
//! keys (which the misspelling hint reads).

use serde::de::{self, DeserializeOwned, Deserializer, Visitor};
use serde::Deserialize;

/// Reads one table into its two parts.
///
/// # Errors
/// A key neither part reads, or either part's own error (a bad value).
pub(super) fn two<'de, D, A, B>(d: D) -> Result<(A, B), D::Error>
where
    D: Deserializer<'de>,
    A: DeserializeOwned,
    B: DeserializeOwned,
{
    let table = toml::Table::deserialize(d)?;
    let (ka, kb) = (keys::<A>(), keys::<B>());
    let (mut ta, mut tb) = (toml::Table::new(), toml::Table::new());
    for (k, v) in table {
        if ka.contains(&k.as_str()) {
            ta.insert(k, v);
        } else if kb.contains(&k.as_str()) {
            tb.insert(k, v);
        } else {
            let expected: Vec<String> = ka.iter().chain(kb).map(|k| format!("`{k}`")).collect();
            return Err(de::Error::custom(format!("unknown field `{k}`, expected one of {}", expected.join(", "))));
        }
    }
    Ok((part(ta)?, part(tb)?))
}

/// One part from its keys; an error names the key whose value it is about (the table's own
/// error points at the section, not the key).
fn part<T: DeserializeOwned, E: de::Error>(table: toml::Table) -> Result<T, E> {
    toml::Value::Table(table.clone()).try_into().map_err(|e: toml::de::Error| {
        // Every key has a default, so the key whose value fails alone is the bad one; in a
        // table of its own (`sketch = { … }`), the sub-key whose value fails alone there.
        let fails = |one: toml::Table| toml::Value::Table(one).try_into::<T>().is_err();
        let alone = |k: &String, v: &toml::Value| toml::Table::from_iter([(k.clone(), v.clone())]);
        let culprit = table.iter().find(|(k, v)| fails(alone(k, v)));
        match culprit {
            Some((k, toml::Value::Table(inner))) => {
                let sub = inner.iter().find(|(s, v)| fails(alone(k, &toml::Value::Table(alone(s, v)))));
                let path = sub.map_or(k.clone(), |(s, _)| format!("{k}.{s}"));
                E::custom(format!("`{path}`: {}", e.message()))
            }
            Some((k, _)) => E::custom(format!("`{k}`: {}", e.message())),
            None => E::custom(e.message()),
        }
    })
}

/// The keys `T`'s derived `Deserialize` reads (renames applied, skipped fields left out):
/// the field list serde hands to `deserialize_struct`, caught by a deserializer that stops
/// there. Empty for a type that is not a struct.
pub(super) fn keys<T: DeserializeOwned>() -> &'static [&'static str] {
    let mut caught: &'static [&'static str] = &[];
    let _ = T::deserialize(Catch(&mut caught));
    caught
}

struct Catch<'a>(&'a mut &'static [&'static str]);

#[derive(Debug)]
struct Stop;

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped after reading the field list")
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<M: std::fmt::Display>(_: M) -> Self {
        Stop
    }
}

impl<'de> Deserializer<'de> for Catch<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        Err(Stop)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Stop> {
        *self.0 = fields;
        Err(Stop)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option
        unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize, Debug, PartialEq, Default)]
    #[serde(default, deny_unknown_fields)]
    struct Own {
        enabled: bool,
    }

    #[derive(Deserialize, Debug, PartialEq, Default)]
    #[serde(default, deny_unknown_fields)]
    struct Core {
        #[serde(rename = "interval")]
        interval_s: u32,
        #[serde(skip)]
        hidden: u32,
    }

    #[derive(Debug, PartialEq)]
    struct Section(Own, Core);

    impl<'de> Deserialize<'de> for Section {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            two(d).map(|(a, b)| Section(a, b))
        }
    }

    #[test]
    fn keys_are_the_serde_names() {
        assert_eq!(keys::<Core>(), ["interval"]);
        assert_eq!(keys::<Own>(), ["enabled"]);
        assert!(keys::<u32>().is_empty());
    }

    #[test]
    fn each_key_goes_to_its_part_and_an_unknown_one_is_refused() {
        let s: Section = toml::from_str("enabled = true\ninterval = 3").unwrap();
        assert_eq!(s, Section(Own { enabled: true }, Core { interval_s: 3, hidden: 0 }));
        let e = toml::from_str::<Section>("enabled = true\nintervall = 3").unwrap_err().to_string();
        assert!(e.contains("unknown field `intervall`, expected one of `enabled`, `interval`"), "{e}");
        // A skipped field is not a key.
        assert!(toml::from_str::<Section>("hidden = 1").is_err());
        let e = toml::from_str::<Section>("enabled = true\ninterval = \"x\"").unwrap_err().to_string();
        assert!(e.contains("`interval`: invalid type: string \"x\""), "{e}");
    }
}
