//! Errors inside a table read through a tag (`kind = "..."`) that name the key at fault.
//!
//! serde reads an internally tagged enum from a buffered copy of its table, so an error in one
//! of the variant's values (`keep = "all"`, `width = -1`) says what was wrong but not where:
//! TOML points at the whole `[positional]` table. [`deserialize_naming_key`] buffers the table
//! as a [`toml::Value`] (which keeps NaN and infinities for the checks that refuse them), reads
//! it, and on an error finds the one key without which the table reads, and names it.

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};

/// Reads a `T` from `deserializer` with `read` (the type's derived deserializer, from a
/// buffered table); an error in one key's value names the key: `key `width`: invalid value ...`.
pub fn deserialize_naming_key<'de, D, T>(
    deserializer: D,
    read: impl Fn(toml::Value) -> Result<T, toml::de::Error>,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
{
    let value = deserializer
        .deserialize_any(Buffer)?
        .unwrap_or_else(|| toml::Value::Table(Default::default()));
    read(value.clone()).map_err(|e| {
        let message = e.message().trim().to_string();
        match culprit(&value, &read) {
            Some(key) => de::Error::custom(format!("key `{key}`: {message}")),
            None => de::Error::custom(message),
        }
    })
}

/// The key of `value` (a table) without which `read` succeeds.
fn culprit<T>(
    value: &toml::Value,
    read: &impl Fn(toml::Value) -> Result<T, toml::de::Error>,
) -> Option<String> {
    let toml::Value::Table(table) = value else {
        return None;
    };
    table.keys().find_map(|key| {
        let mut without = table.clone();
        without.remove(key);
        read(toml::Value::Table(without)).ok().map(|_| key.clone())
    })
}

/// Any self-describing value as a TOML value; a null (JSON's, for an absent option) is left
/// out of its table or list.
struct Buffer;

impl<'de> Visitor<'de> for Buffer {
    type Value = Option<toml::Value>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Some(toml::Value::Boolean(v)))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Some(toml::Value::Integer(v)))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(match i64::try_from(v) {
            Ok(i) => toml::Value::Integer(i),
            Err(_) => toml::Value::Float(v as f64),
        }))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Some(toml::Value::Float(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Some(toml::Value::String(v.to_string())))
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(Buffer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Seed)? {
            items.extend(item);
        }
        Ok(Some(toml::Value::Array(items)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut table = toml::Table::new();
        while let Some(key) = map.next_key::<String>()? {
            if let Some(value) = map.next_value_seed(Seed)? {
                table.insert(key, value);
            }
        }
        Ok(Some(toml::Value::Table(table)))
    }
}

/// [`Buffer`] as a seed, for the elements of lists and tables.
struct Seed;

impl<'de> de::DeserializeSeed<'de> for Seed {
    type Value = Option<toml::Value>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(Buffer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Options {
        #[serde(default)]
        width: usize,
        #[serde(default)]
        keep: f64,
    }

    fn read(text: &str) -> Result<Options, String> {
        struct W(Options);
        impl<'de> serde::Deserialize<'de> for W {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                deserialize_naming_key(d, Options::deserialize).map(W)
            }
        }
        serde_json::from_str::<W>(text)
            .map(|w| w.0)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_bad_value_names_its_key_and_nulls_are_absent() {
        assert_eq!(
            read(r#"{"width": 3, "keep": null}"#).unwrap(),
            Options {
                width: 3,
                keep: 0.0
            }
        );
        let e = read(r#"{"width": -1, "keep": 0.5}"#).unwrap_err();
        assert!(
            e.starts_with("key `width`: invalid value: integer `-1`"),
            "{e}"
        );
        let e = read(r#"{"width": 1, "keep": "all"}"#).unwrap_err();
        assert!(
            e.starts_with("key `keep`: invalid type: string \"all\""),
            "{e}"
        );
        let e = read(r#"{"wide": 1}"#).unwrap_err();
        assert!(e.starts_with("key `wide`: unknown field `wide`"), "{e}");
        // Non-finite floats survive the buffer, for the checks that refuse them by name.
        let nan: toml::Value = toml::from_str("x = nan").unwrap();
        let buffered = nan.deserialize_any(Buffer).unwrap().unwrap();
        assert!(buffered["x"].as_float().unwrap().is_nan());
    }
}
