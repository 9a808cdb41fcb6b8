use kvmesh_core::index::{ExtraKeys, KvEvent, KvGroup, Removed, Stored};
use kvmesh_core::{EngineBlockHash, Medium};
use kvmesh_events::EventError;
use rmpv::Value;

/// Decodes one event; the error says what was wrong, for the batch's skipped list.
pub(crate) fn decode_event(v: &Value) -> Result<KvEvent, EventError> {
    let fields = Fields::of(v)?;
    match fields.tag {
        "BlockStored" => stored(&fields),
        "BlockRemoved" => {
            let block_hashes = hashes(
                fields
                    .get("block_hashes", 1)
                    .ok_or(EventError::Missing { event: "BlockRemoved", field: "block_hashes" })?,
            )?;
            let kv_group = group_idx(fields.get("group_idx", 3))?;
            Ok(KvEvent::Removed(Removed { block_hashes, medium: medium(fields.get("medium", 2))?, kv_group }))
        }
        "AllBlocksCleared" => Ok(KvEvent::Cleared),
        other => Err(EventError::UnknownType(other.to_string())),
    }
}

fn stored(f: &Fields<'_>) -> Result<KvEvent, EventError> {
    let block_hashes =
        hashes(f.get("block_hashes", 1).ok_or(EventError::Missing { event: "BlockStored", field: "block_hashes" })?)?;
    let parent = match f.get("parent_block_hash", 2) {
        None | Some(Value::Nil) => None,
        Some(h) => Some(hash(h)?),
    };
    let token_ids =
        match f.get("token_ids", 3).ok_or(EventError::Missing { event: "BlockStored", field: "token_ids" })? {
            Value::Array(ts) => ts
                .iter()
                .map(|t| match t {
                    Value::Integer(i) => i
                        .as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| out_of_range("token id", i, "a u32")),
                    other => Err(wrong("token id", other, "an integer")),
                })
                .collect::<Result<Vec<u32>, EventError>>()?,
            other => return Err(wrong("token_ids", other, "an array")),
        };
    let block_size =
        match f.get("block_size", 4).ok_or(EventError::Missing { event: "BlockStored", field: "block_size" })? {
            Value::Integer(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()).filter(|&n| n > 0),
            _ => None,
        }
        .ok_or(EventError::BlockSize)?;
    // vLLM ≥ 0.10 sends the adapter's name; older ones only its integer id.
    let lora_name = match (f.get("lora_name", 7), f.get("lora_id", 5)) {
        (Some(Value::String(s)), _) => Some(s.as_str().ok_or(EventError::NotUtf8("lora_name"))?.to_string()),
        (_, Some(Value::Integer(id))) => Some(format!("lora-id:{id}")),
        _ => None,
    };
    let extra_keys = match f.get("extra_keys", 8) {
        None | Some(Value::Nil) => None,
        Some(Value::Array(per_block)) if per_block.len() == block_hashes.len() => {
            extra_keys(per_block, lora_name.as_deref(), parent.is_none())
        }
        Some(Value::Array(per_block)) => {
            return Err(EventError::ExtraKeysLength { keys: per_block.len(), blocks: block_hashes.len() })
        }
        Some(other) => return Err(wrong("extra_keys", other, "an array")),
    };
    let spec_kind = match f.get("kv_cache_spec_kind", 10) {
        None | Some(Value::Nil) => None,
        Some(Value::String(s)) => Some(s.as_str().ok_or(EventError::NotUtf8("kv_cache_spec_kind"))?.to_string()),
        Some(other) => return Err(wrong("kv_cache_spec_kind", other, "a string")),
    };
    let sliding_window = match f.get("kv_cache_spec_sliding_window", 11) {
        None | Some(Value::Nil) => None,
        Some(Value::Integer(n)) => Some(
            n.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| out_of_range("kv_cache_spec_sliding_window", n, "a u32"))?,
        ),
        Some(other) => return Err(wrong("kv_cache_spec_sliding_window", other, "an integer")),
    };
    // An engine with one KV cache group may still send its index (0) or its kind.
    let kv_group = match group_idx(f.get("group_idx", 9))? {
        Some(idx) => Some(KvGroup { idx, kind: spec_kind, sliding_window }),
        None => spec_kind.map(|kind| KvGroup { idx: 0, kind: Some(kind), sliding_window }),
    };
    Ok(KvEvent::Stored(Stored {
        block_hashes,
        parent,
        token_ids,
        block_size,
        medium: medium(f.get("medium", 6))?,
        lora_name,
        extra_keys,
        kv_group,
    }))
}

/// vLLM's per-block `extra_keys` (each `nil` or a tuple of keys: the LoRA name, multimodal
/// `(identifier, offset)` pairs, the `cache_salt` on a sequence's first block, prompt-embedding
/// digests; vllm/v1/core/kv_cache_utils.py `generate_block_hash_extra_keys`) as the index
/// uses them: the LoRA name is the event's `lora_name` already; a further string on the first
/// block of a store that starts its sequence is the salt; everything else is digested (xxh3
/// of its msgpack bytes) per block, a router having no way to check it against a request.
/// `None` when no block has a key beyond the LoRA name.
fn extra_keys(per_block: &[Value], lora_name: Option<&str>, starts: bool) -> Option<ExtraKeys> {
    let mut out = ExtraKeys::default();
    let mut any = false;
    for (k, entry) in per_block.iter().enumerate() {
        let Value::Array(keys) = entry else {
            out.unverifiable.push(match entry {
                Value::Nil => 0,
                other => digest(std::slice::from_ref(other)),
            });
            continue;
        };
        let mut lora_seen = false;
        let mut rest: Vec<Value> = Vec::new();
        for key in keys {
            match key.as_str() {
                Some(s) if !lora_seen && Some(s) == lora_name => lora_seen = true,
                Some(s) if k == 0 && starts && out.cache_salt.is_none() => out.cache_salt = Some(s.to_string()),
                _ => rest.push(key.clone()),
            }
        }
        let d = if rest.is_empty() { 0 } else { digest(&rest) };
        out.unverifiable.push(d);
    }
    any |= out.cache_salt.is_some();
    if out.unverifiable.iter().all(|&d| d == 0) {
        out.unverifiable.clear();
    } else {
        any = true;
    }
    any.then_some(out)
}

/// A nonzero 64-bit digest of `keys`.
fn digest(keys: &[Value]) -> u64 {
    let mut bytes = Vec::new();
    let _ = rmpv::encode::write_value(&mut bytes, &Value::Array(keys.to_vec()));
    xxhash_rust::xxh3::xxh3_64(&bytes).max(1)
}

fn wrong(field: &'static str, found: &Value, expected: &'static str) -> EventError {
    EventError::WrongType { field, found: kind(found), expected }
}

fn out_of_range(field: &'static str, value: impl std::fmt::Display, expected: &'static str) -> EventError {
    EventError::OutOfRange { field, value: value.to_string(), expected }
}

/// An event's tag and fields, by name (map form) or position (array form).
struct Fields<'a> {
    tag: &'a str,
    map: Option<&'a [(Value, Value)]>,
    array: &'a [Value],
}

impl<'a> Fields<'a> {
    fn of(v: &'a Value) -> Result<Self, EventError> {
        match v {
            Value::Map(kv) => {
                let tag = kv
                    .iter()
                    .find(|(k, _)| k.as_str() == Some("type"))
                    .and_then(|(_, t)| t.as_str())
                    .ok_or(EventError::NoTag("event map without a string \"type\""))?;
                Ok(Fields { tag, map: Some(kv), array: &[] })
            }
            Value::Array(a) => {
                let tag = a
                    .first()
                    .and_then(Value::as_str)
                    .ok_or(EventError::NoTag("event array not led by a string tag"))?;
                Ok(Fields { tag, map: None, array: a })
            }
            other => Err(wrong("event", other, "a map or an array")),
        }
    }

    fn get(&self, name: &str, position: usize) -> Option<&'a Value> {
        match self.map {
            Some(kv) => kv.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v),
            None => self.array.get(position),
        }
    }
}

fn hashes(v: &Value) -> Result<Vec<EngineBlockHash>, EventError> {
    match v {
        Value::Array(hs) => hs.iter().map(hash).collect(),
        other => Err(wrong("block_hashes", other, "an array")),
    }
}

fn hash(v: &Value) -> Result<EngineBlockHash, EventError> {
    match v {
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(EngineBlockHash::from(u)),
            (None, Some(s)) => Ok(EngineBlockHash::from(s)),
            _ => Err(out_of_range("block hash", i, "a 64-bit integer")),
        },
        Value::Binary(b) => Ok(EngineBlockHash(xxhash_rust::xxh3::xxh3_64(b))),
        other => Err(wrong("block hash", other, "an integer or bytes")),
    }
}

/// vLLM's `group_idx` (a hybrid model's KV cache group), when sent.
fn group_idx(v: Option<&Value>) -> Result<Option<u32>, EventError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::Integer(i)) => i
            .as_u64()
            .and_then(|g| u32::try_from(g).ok())
            .map(Some)
            .ok_or_else(|| out_of_range("group_idx", i, "a u32")),
        Some(other) => Err(wrong("group_idx", other, "an integer")),
    }
}

fn medium(v: Option<&Value>) -> Result<Medium, EventError> {
    match v {
        None | Some(Value::Nil) => Ok(Medium::Gpu),
        Some(Value::String(s)) => match s.as_str() {
            Some(m) if m.eq_ignore_ascii_case("gpu") => Ok(Medium::Gpu),
            Some(m) if m.eq_ignore_ascii_case("cpu") => Ok(Medium::Cpu),
            Some(m) => Err(EventError::UnsupportedMedium(m.to_string())),
            None => Err(EventError::NotUtf8("medium")),
        },
        Some(other) => Err(wrong("medium", other, "a string")),
    }
}

/// A msgpack value's type, for error messages.
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "a boolean",
        Value::Integer(_) => "an integer",
        Value::F32(_) | Value::F64(_) => "a float",
        Value::String(_) => "a string",
        Value::Binary(_) => "binary",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        Value::Ext(..) => "an extension",
    }
}
