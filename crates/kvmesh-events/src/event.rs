//! One msgpack event → [`KvEvent`].
//!
//! vLLM's event classes (`vllm/distributed/kv_events.py`) are msgspec structs with
//! `tag=True, omit_defaults=True`. Newer vLLM (≥ 0.24) and SGLang encode them as maps whose
//! `"type"` key holds the tag; older vLLM encodes them `array_like`, as arrays led by the tag
//! with fields in declaration order:
//!
//! ```text
//! BlockStored      [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, …]
//! BlockRemoved     [tag, block_hashes, medium, …]
//! AllBlocksCleared [tag, …]
//! ```
//!
//! Unknown map keys and trailing array elements are ignored (engines add fields often, case
//! C06); fields left out because they hold their default (`omit_defaults`) take it: no parent,
//! no LoRA, medium GPU. Block hashes may be msgpack uint64 (vLLM, often ≥ 2^63) or negative
//! int64 (SGLang): the same 64 bits are the same block (case C05). A hash sent as bytes (vLLM's
//! `ExternalBlockHash` may be `bytes`) is reduced to 64 bits with xxh3; ids stay opaque either way.
//! Of a key repeated within an event the first counts (as the tree decoder before this one
//! looked fields up), where a batch's own fields keep the last ([`crate::batch`]).

use crate::cursor::{Cursor, Int, Item};
use crate::error::EventError;
use kvmesh_core::index::{ExtraKeys, KvEvent, KvGroup, Removed, Stored};
use kvmesh_core::{EngineBlockHash, Medium};
use rmpv::Value;

/// Decodes the event at `cur`, leaving `cur` after it whether it decodes or not; the error
/// says what was wrong, for the batch's skipped list.
pub(crate) fn decode_event(cur: &mut Cursor<'_>) -> Result<KvEvent, EventError> {
    let fields = Fields::of(cur)?;
    match fields.tag {
        "BlockStored" => stored(&fields),
        "BlockRemoved" => {
            let block_hashes = hashes(
                fields
                    .get(BLOCK_HASHES, 1)
                    .ok_or(EventError::Missing { event: "BlockRemoved", field: "block_hashes" })?,
            )?;
            let kv_group = group_idx(fields.get(GROUP_IDX, 3))?;
            Ok(KvEvent::Removed(Removed { block_hashes, medium: medium(fields.get(MEDIUM, 2))?, kv_group }))
        }
        "AllBlocksCleared" => Ok(KvEvent::Cleared),
        other => Err(EventError::UnknownType(other.to_string())),
    }
}

fn stored(f: &Fields<'_>) -> Result<KvEvent, EventError> {
    let block_hashes =
        hashes(f.get(BLOCK_HASHES, 1).ok_or(EventError::Missing { event: "BlockStored", field: "block_hashes" })?)?;
    let parent = match f.get(PARENT_BLOCK_HASH, 2).map(Cursor::new) {
        None => None,
        Some(mut c) => match c.item() {
            Item::Nil => None,
            h => Some(hash(h)?),
        },
    };
    let token_ids =
        token_ids(f.get(TOKEN_IDS, 3).ok_or(EventError::Missing { event: "BlockStored", field: "token_ids" })?)?;
    let block_size = match f.get(BLOCK_SIZE, 4).map(Cursor::first) {
        None => return Err(EventError::Missing { event: "BlockStored", field: "block_size" }),
        Some(Item::Int(n)) => n.as_u64().and_then(|n| u32::try_from(n).ok()).filter(|&n| n > 0),
        Some(_) => None,
    }
    .ok_or(EventError::BlockSize)?;
    // vLLM ≥ 0.10 sends the adapter's name; older ones only its integer id.
    let lora_name = match (f.get(LORA_NAME, 7).map(Cursor::first), f.get(LORA_ID, 5).map(Cursor::first)) {
        (Some(Item::Str(s)), _) => Some(utf8(s, "lora_name")?.to_string()),
        (_, Some(Item::Int(id))) => Some(format!("lora-id:{id}")),
        _ => None,
    };
    let extra_keys = match f.get(EXTRA_KEYS, 8) {
        None => None,
        Some(raw) => match Cursor::first(raw) {
            Item::Nil => None,
            Item::Array(n) if n == block_hashes.len() => {
                // Rare (multimodal inputs, salts, LoRA): read as a tree, the digests being of
                // the keys' msgpack encoding. (rmpv's reader recurses: safe because the budget
                // check has bounded the payload's nesting before any of this runs.)
                let Ok(Value::Array(per_block)) = rmpv::decode::read_value(&mut &raw[..]) else {
                    return Err(EventError::WrongType {
                        field: "extra_keys",
                        found: "cut short",
                        expected: "an array",
                    });
                };
                extra_keys(&per_block, lora_name.as_deref(), parent.is_none())
            }
            Item::Array(keys) => return Err(EventError::ExtraKeysLength { keys, blocks: block_hashes.len() }),
            other => return Err(wrong("extra_keys", other, "an array")),
        },
    };
    let spec_kind = match f.get(KV_CACHE_SPEC_KIND, 10).map(Cursor::first) {
        None | Some(Item::Nil) => None,
        Some(Item::Str(s)) => Some(utf8(s, "kv_cache_spec_kind")?.to_string()),
        Some(other) => return Err(wrong("kv_cache_spec_kind", other, "a string")),
    };
    let sliding_window = match f.get(KV_CACHE_SPEC_SLIDING_WINDOW, 11).map(Cursor::first) {
        None | Some(Item::Nil) => None,
        Some(Item::Int(n)) => Some(u32_of(n, "kv_cache_spec_sliding_window")?),
        Some(other) => return Err(wrong("kv_cache_spec_sliding_window", other, "an integer")),
    };
    // An engine with one KV cache group may still send its index (0) or its kind.
    let kv_group = match group_idx(f.get(GROUP_IDX, 9))? {
        Some(idx) => Some(KvGroup { idx, kind: spec_kind, sliding_window }),
        None => spec_kind.map(|kind| KvGroup { idx: 0, kind: Some(kind), sliding_window }),
    };
    Ok(KvEvent::Stored(Stored {
        block_hashes,
        parent,
        token_ids,
        block_size,
        medium: medium(f.get(MEDIUM, 6))?,
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

fn wrong(field: &'static str, found: Item<'_>, expected: &'static str) -> EventError {
    EventError::WrongType { field, found: found.kind(), expected }
}

fn out_of_range(field: &'static str, value: impl std::fmt::Display, expected: &'static str) -> EventError {
    EventError::OutOfRange { field, value: value.to_string(), expected }
}

fn utf8<'a>(bytes: &'a [u8], field: &'static str) -> Result<&'a str, EventError> {
    std::str::from_utf8(bytes).map_err(|_| EventError::NotUtf8(field))
}

fn u32_of(n: Int, field: &'static str) -> Result<u32, EventError> {
    n.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| out_of_range(field, n, "a u32"))
}

// Every field an event may carry, by name (the map form); the array form has them by position.
const BLOCK_HASHES: usize = 0;
const PARENT_BLOCK_HASH: usize = 1;
const TOKEN_IDS: usize = 2;
const BLOCK_SIZE: usize = 3;
const LORA_ID: usize = 4;
const MEDIUM: usize = 5;
const LORA_NAME: usize = 6;
const EXTRA_KEYS: usize = 7;
const GROUP_IDX: usize = 8;
const KV_CACHE_SPEC_KIND: usize = 9;
const KV_CACHE_SPEC_SLIDING_WINDOW: usize = 10;
/// Fields known by name.
const NAMES: usize = 11;

/// The slot of a field known by name (the map form).
fn slot(name: &[u8]) -> Option<usize> {
    Some(match name {
        b"block_hashes" => BLOCK_HASHES,
        b"parent_block_hash" => PARENT_BLOCK_HASH,
        b"token_ids" => TOKEN_IDS,
        b"block_size" => BLOCK_SIZE,
        b"lora_id" => LORA_ID,
        b"medium" => MEDIUM,
        b"lora_name" => LORA_NAME,
        b"extra_keys" => EXTRA_KEYS,
        b"group_idx" => GROUP_IDX,
        b"kv_cache_spec_kind" => KV_CACHE_SPEC_KIND,
        b"kv_cache_spec_sliding_window" => KV_CACHE_SPEC_SLIDING_WINDOW,
        _ => return None,
    })
}
/// Positions read from the array form: the tag and `BlockStored`'s eleven fields.
const POSITIONS: usize = 12;

/// An event's tag and the bytes of its fields: by name (map form, the first of a repeated key
/// kept) or by position (array form).
struct Fields<'a> {
    tag: &'a str,
    by_name: Option<[Option<&'a [u8]>; NAMES]>,
    by_position: [Option<&'a [u8]>; POSITIONS],
}

impl<'a> Fields<'a> {
    /// Reads the event at `cur` whole.
    fn of(cur: &mut Cursor<'a>) -> Result<Self, EventError> {
        let at = *cur;
        let mut fields = Fields { tag: "", by_name: None, by_position: [None; POSITIONS] };
        match cur.item() {
            Item::Map(n) => {
                let mut by_name = [None; NAMES];
                let mut tag = None;
                for _ in 0..cur.at_most(n) {
                    let (key, value) = (cur.value().unwrap_or_default(), cur.value());
                    let Item::Str(key) = Cursor::first(key) else { continue };
                    if key == b"type" {
                        tag = tag.or(Some(value));
                    } else if let Some(slot) = slot(key) {
                        by_name[slot] = by_name[slot].or(value);
                    }
                }
                fields.tag = match tag.flatten().map(Cursor::first) {
                    Some(Item::Str(t)) => std::str::from_utf8(t).ok(),
                    _ => None,
                }
                .ok_or(EventError::NoTag("event map without a string \"type\""))?;
                fields.by_name = Some(by_name);
            }
            Item::Array(n) => {
                for slot in fields.by_position.iter_mut().take(n) {
                    *slot = cur.value();
                }
                for _ in 0..cur.at_most(n.saturating_sub(POSITIONS)) {
                    cur.value();
                }
                fields.tag = match fields.by_position[0].map(Cursor::first) {
                    Some(Item::Str(t)) => std::str::from_utf8(t).ok(),
                    _ => None,
                }
                .ok_or(EventError::NoTag("event array not led by a string tag"))?;
            }
            other => {
                *cur = at;
                cur.value();
                return Err(wrong("event", other, "a map or an array"));
            }
        }
        Ok(fields)
    }

    /// The bytes of field `name` (one of the constants above), or of the array form's element
    /// at `position`.
    fn get(&self, name: usize, position: usize) -> Option<&'a [u8]> {
        match &self.by_name {
            Some(by_name) => by_name[name],
            None => self.by_position.get(position).copied().flatten(),
        }
    }
}

fn hashes(raw: &[u8]) -> Result<Vec<EngineBlockHash>, EventError> {
    let mut cur = Cursor::new(raw);
    match cur.item() {
        Item::Array(n) => (0..cur.at_most(n)).map(|_| hash(cur.item())).collect(),
        other => Err(wrong("block_hashes", other, "an array")),
    }
}

fn hash(h: Item<'_>) -> Result<EngineBlockHash, EventError> {
    match h {
        Item::Int(Int::Pos(u)) => Ok(EngineBlockHash::from(u)),
        Item::Int(Int::Neg(s)) => Ok(EngineBlockHash::from(s)),
        Item::Bin(b) => Ok(EngineBlockHash(xxhash_rust::xxh3::xxh3_64(b))),
        other => Err(wrong("block hash", other, "an integer or bytes")),
    }
}

fn token_ids(raw: &[u8]) -> Result<Vec<u32>, EventError> {
    let mut cur = Cursor::new(raw);
    let n = match cur.item() {
        Item::Array(n) => n,
        other => return Err(wrong("token_ids", other, "an array")),
    };
    let mut ids = Vec::with_capacity(cur.at_most(n));
    for _ in 0..cur.at_most(n) {
        match cur.item() {
            Item::Int(Int::Pos(t)) if t <= u64::from(u32::MAX) => ids.push(t as u32),
            Item::Int(t) => return Err(out_of_range("token id", t, "a u32")),
            // Named by its type, not printed: a value of any size may stand here.
            other => return Err(wrong("token id", other, "an integer")),
        }
    }
    Ok(ids)
}

/// vLLM's `group_idx` (a hybrid model's KV cache group), when sent.
fn group_idx(raw: Option<&[u8]>) -> Result<Option<u32>, EventError> {
    match raw.map(Cursor::first) {
        None | Some(Item::Nil) => Ok(None),
        Some(Item::Int(i)) => u32_of(i, "group_idx").map(Some),
        Some(other) => Err(wrong("group_idx", other, "an integer")),
    }
}

fn medium(raw: Option<&[u8]>) -> Result<Medium, EventError> {
    match raw.map(Cursor::first) {
        None | Some(Item::Nil) => Ok(Medium::Gpu),
        Some(Item::Str(s)) => match utf8(s, "medium")? {
            m if m.eq_ignore_ascii_case("gpu") => Ok(Medium::Gpu),
            m if m.eq_ignore_ascii_case("cpu") => Ok(Medium::Cpu),
            m => Err(EventError::UnsupportedMedium(m.to_string())),
        },
        Some(other) => Err(wrong("medium", other, "a string")),
    }
}
