//! Block hashing: token ids → full blocks of `block_size` tokens → chained 64-bit [`BlockHash`]es.
//!
//! # Definition
//! For a namespace `ns` (model, LoRA adapter, cache salt; see [`Namespace`]) and tokens
//! `t[0..n]` with block size `B`:
//!
//! ```text
//! base      = xxh3_64(utf8(model) ‖ 0x00)
//! adapted   = base                                                  when adapter is empty
//!           = xxh3_64_with_seed(utf8(adapter), base)                otherwise
//! seed      = adapted                                               when salt is empty
//!           = xxh3_64_with_seed("salt" ‖ 0x00 ‖ utf8(salt), adapted)  otherwise
//! h[-1]     = seed
//! l[i]      = xxh3_64(le_bytes(t[i·B]) ‖ … ‖ le_bytes(t[i·B + B − 1]))
//! h[i]      = mum(h[i−1] ⊕ K0, l[i] ⊕ K1)
//! mum(a, b) = low64(a·b) ⊕ high64(a·b)         (the 128-bit product of two u64)
//! ```
//!
//! for every *full* block `i < ⌊n / B⌋`; each token is 4 little-endian bytes (u32). A trailing
//! partial block is not hashed — engines cache only full blocks (vLLM `kv_cache_utils.py`).
//! Because each block's hash folds in its parent's, equal hashes mean equal whole prefixes,
//! and different namespaces never match (barring a 64-bit collision). xxh3 is
//! [xxHash](https://github.com/Cyan4973/xxHash)'s XXH3-64, via the `xxhash-rust` crate; `mum`
//! is the folded multiply wyhash and rapidhash mix with (`K0`, `K1`: rapidhash's secrets
//! 0 and 1, [`CHAIN_K0`] and [`CHAIN_K1`]). Like any 64-bit mix it collides by chance; a
//! zero factor (`h[i−1] = K0` or `l[i] = K1`, a chance of 2⁻⁶⁴ per block each) makes a link
//! forget its parent, which, like any collision, can only make a chain match where it should
//! not.
//!
//! Why the block's own hash `l[i]` does not take the parent as its seed (as it did before
//! 2026-12-07, `h[i] = xxh3_64_with_seed(block bytes, h[i−1])`): seeded, each block's whole
//! xxh3 waited for the previous one, 5.0 ns a block; here the `l[i]` are independent, so the
//! CPU computes several at once, and only the 3-cycle multiply is chained: 2.7 ns a block, a
//! 4,096-token prompt hashed in 0.70 µs instead of 1.28 µs in a standalone harness (in a fresh
//! decision, `RouteRequest::new` with its allocation and prompt key: ~0.93 µs; BENCHMARKS.md,
//! "The block hash chain redefined").
//! The hashes are kvmesh's own (vLLM's engine hashes are mapped to them from each event's
//! tokens), so no engine or client sees the change; router nodes of one cluster must run the
//! same definition (the booking prefixes they gossip and the hot prefixes replication counts
//! and plans name block hashes: README, upgrades).
//!
//! A block whose engine hash also covers inputs a router cannot see in the prompt's tokens
//! (vLLM's per-block `extra_keys`: multimodal identifiers with their offsets, prompt-embedding
//! digests; vllm/v1/core/kv_cache_utils.py `generate_block_hash_extra_keys`) is hashed
//! `h'[i] = xxh3_64_with_seed(le_bytes(digest), h[i])` ([`BlockHasher::with_extra`]): it and
//! every block after it in its chain never match a request's tokens alone.

use crate::error::Error;
use crate::ids::BlockHash;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The default block size, in tokens (vLLM's default for CUDA).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// What separates caches that must never share blocks even for identical tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Namespace {
    /// The served model name.
    pub model: String,
    /// The LoRA adapter name, empty for the base model.
    pub adapter: String,
    /// vLLM's `cache_salt` (per-tenant isolation), empty when unset.
    pub salt: String,
}

impl Namespace {
    /// The seed of this namespace's hash chain (see the module docs).
    pub fn seed(&self) -> u64 {
        let mut bytes = Vec::with_capacity(self.model.len() + 1);
        bytes.extend_from_slice(self.model.as_bytes());
        bytes.push(0);
        salt_seed(adapter_seed(xxh3_64(&bytes), &self.adapter), &self.salt)
    }
}

/// Which served model a replica runs or a request asks for: xxh3 of the model name (vLLM's
/// `--served-model-name`, the OpenAI API's `model`). Requests go only to replicas of their
/// model ([`crate::FleetView::takes`]); the hash chain's namespace separates their blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelKey(pub u64);

impl ModelKey {
    /// Any model: a request whose model is not known (a gateway's request with no body)
    /// may go to a replica of any model.
    pub const ANY: ModelKey = ModelKey(0);

    /// The key of model `name`.
    pub fn of(name: &str) -> Self {
        ModelKey(xxh3_64(name.as_bytes()))
    }
}

/// Hashes token sequences into chained block hashes for one block size and namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: u32,
    seed: u64,
    model: ModelKey,
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens in `namespace`.
    ///
    /// # Errors
    /// [`Error::ZeroBlockSize`] when `block_size` is 0.
    pub fn new(block_size: u32, namespace: &Namespace) -> Result<Self, Error> {
        if block_size == 0 {
            return Err(Error::ZeroBlockSize);
        }
        Ok(BlockHasher { block_size, seed: namespace.seed(), model: ModelKey::of(&namespace.model) })
    }

    /// The hasher for LoRA adapter `adapter` in this hasher's namespace (itself when
    /// `adapter` is empty): equal to `BlockHasher::new` of the namespace with that adapter, when
    /// this hasher's namespace has none.
    pub fn for_adapter(&self, adapter: &str) -> BlockHasher {
        BlockHasher { block_size: self.block_size, seed: adapter_seed(self.seed, adapter), model: self.model }
    }

    /// The hasher for vLLM's `cache_salt` `salt` (a tenant's own cache) in this hasher's
    /// namespace (itself when `salt` is empty): equal to `BlockHasher::new` of the namespace
    /// with that salt, when this hasher's namespace has none.
    pub fn for_salt(&self, salt: &str) -> BlockHasher {
        BlockHasher { seed: salt_seed(self.seed, salt), ..*self }
    }

    /// `block`'s hash once its engine hash also covered inputs the tokens do not show, whose
    /// digest is `extra` (see the module docs): the hash the chain continues from.
    #[inline]
    pub fn with_extra(block: BlockHash, extra: u64) -> BlockHash {
        BlockHash(xxh3_64_with_seed(&extra.to_le_bytes(), block.0))
    }

    /// The model of this hasher's namespace (an adapter's hasher keeps its base model's).
    pub fn model(&self) -> ModelKey {
        self.model
    }

    /// The block size, in tokens.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The chain's seed: the parent "hash" of the first block.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Number of full blocks in `n_tokens` tokens.
    pub fn full_blocks(&self, n_tokens: usize) -> usize {
        n_tokens / self.block_size as usize
    }

    /// The hash of one block of exactly `block_size` tokens whose parent hashes to `parent`
    /// (`None` for the first block of a sequence).
    #[inline]
    pub fn hash_block(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        debug_assert_eq!(tokens.len(), self.block_size as usize);
        BlockHash(chain(parent.map_or(self.seed, |p| p.0), xxh3_64(&le_bytes(tokens))))
    }

    /// Hashes of every full block of `tokens`, in order, chained from `parent` (`None` = start
    /// of a sequence). A trailing partial block is ignored.
    pub fn hash_blocks_from(&self, parent: Option<BlockHash>, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(self.full_blocks(tokens.len()));
        self.extend_hashes(parent, tokens, &mut out);
        out
    }

    /// Hashes of every full block of `tokens` from the start of a sequence.
    pub fn hash_blocks(&self, tokens: &[u32]) -> Vec<BlockHash> {
        self.hash_blocks_from(None, tokens)
    }

    /// Appends the chained hashes of `tokens`' full blocks to `out` (reuses its allocation).
    pub fn extend_hashes(&self, parent: Option<BlockHash>, tokens: &[u32], out: &mut Vec<BlockHash>) {
        out.reserve(self.full_blocks(tokens.len()));
        // The blocks' own hashes do not depend on the chain, so the CPU runs ahead on them.
        let mut prev = parent.map_or(self.seed, |p| p.0);
        for block in tokens.chunks_exact(self.block_size as usize) {
            prev = chain(prev, xxh3_64(&le_bytes(block)));
            out.push(BlockHash(prev));
        }
    }

    /// A 64-bit key for the whole token sequence, partial block included (a session key's
    /// tokens, say).
    pub fn sequence_key(&self, tokens: &[u32]) -> u64 {
        xxh3_64_with_seed(&le_bytes(tokens), self.seed)
    }

    /// A 64-bit key for the whole prompt `tokens`, partial last block included, from its full
    /// blocks' chained hashes `hashes` (as [`BlockHasher::hash_blocks`] gives them):
    ///
    /// ```text
    /// key = xxh3_64_with_seed(le_bytes(u64 length) ‖ 0xFF, seed = last full block's hash, else the chain seed)
    /// key = xxh3_64_with_seed(le_bytes(tokens after the last full block), seed = key)   when any
    /// ```
    ///
    /// Equal keys mean equal prompts (barring a 64-bit collision), as a hash of all the tokens
    /// would, but it reads only the partial block: hashing a 4,096-token prompt again whole was
    /// ~0.5 µs of the 1.9 µs its hashing took (BENCHMARKS.md). A key is an xxh3 of 9 bytes
    /// (the length and a tag byte, never a whole number of tokens), a block hash a folded
    /// multiply: different derivations, equal only by a 64-bit collision, so both may share
    /// one key space (llm-d's scorer, whose last partial block is this key).
    pub fn prompt_key(&self, hashes: &[BlockHash], tokens: &[u32]) -> u64 {
        let key = length_key(tokens.len() as u64, hashes.last().map_or(self.seed, |h| h.0));
        let tail = tokens.get(hashes.len() * self.block_size as usize..).unwrap_or(&[]);
        if tail.is_empty() {
            key
        } else {
            xxh3_64_with_seed(&le_bytes(tail), key)
        }
    }
}

/// A prompt of `length` tokens whose last full block hashes to `last`: the first step of
/// [`BlockHasher::prompt_key`], and the whole key of a request built from block hashes
/// ([`crate::RouteRequest::from_hashes`]). The length's 8 bytes and a tag byte: 9 bytes, never
/// a block's input.
pub(crate) fn length_key(length: u64, last: u64) -> u64 {
    let mut bytes = [0xFF; 9];
    bytes[..8].copy_from_slice(&length.to_le_bytes());
    xxh3_64_with_seed(&bytes, last)
}

/// rapidhash's secret 0 (github.com/Nicoshev/rapidhash, `rapidhash.h` `RAPID_SECRET`): what
/// the parent hash is masked with before the chain's multiply.
pub const CHAIN_K0: u64 = 0x2d35_8dcc_aa6c_78a5;
/// rapidhash's secret 1: what a block's own hash is masked with before the chain's multiply.
pub const CHAIN_K1: u64 = 0x8bb8_4b93_962e_acc9;

/// One link of the chain: the block whose own xxh3 is `local`, after the block hashed
/// `parent` (see the module docs).
#[inline(always)]
fn chain(parent: u64, local: u64) -> u64 {
    let m = u128::from(parent ^ CHAIN_K0) * u128::from(local ^ CHAIN_K1);
    (m as u64) ^ ((m >> 64) as u64)
}

/// Mixes a LoRA adapter name into a chain seed.
fn adapter_seed(base: u64, adapter: &str) -> u64 {
    if adapter.is_empty() {
        base
    } else {
        xxh3_64_with_seed(adapter.as_bytes(), base)
    }
}

/// Mixes vLLM's `cache_salt` into a chain seed.
fn salt_seed(seed: u64, salt: &str) -> u64 {
    if salt.is_empty() {
        return seed;
    }
    let mut bytes = Vec::with_capacity(salt.len() + 5);
    bytes.extend_from_slice(b"salt\0");
    bytes.extend_from_slice(salt.as_bytes());
    xxh3_64_with_seed(&bytes, seed)
}

/// The tokens as little-endian bytes: a free reinterpretation on little-endian hosts (all
/// that kvmesh targets), a copy elsewhere.
#[inline]
fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(tokens))
    } else {
        std::borrow::Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(model: &str) -> Namespace {
        Namespace { model: model.into(), ..Namespace::default() }
    }

    #[test]
    fn salted_and_adapted_hashers_agree_with_their_namespaces() {
        let plain = BlockHasher::new(2, &ns("m")).unwrap();
        let full = Namespace { model: "m".into(), adapter: "sql".into(), salt: "tenant-1".into() };
        assert_eq!(plain.for_adapter("sql").for_salt("tenant-1"), BlockHasher::new(2, &full).unwrap());
        assert_eq!(plain.for_salt(""), plain);
        let salted = Namespace { salt: "tenant-1".into(), ..ns("m") };
        let want = xxh3_64_with_seed(b"salt\0tenant-1", xxh3_64(b"m\0"));
        assert_eq!(BlockHasher::new(2, &salted).unwrap().seed(), want);
        // A block with extra keys continues its chain from the mixed hash.
        let b0 = plain.hash_blocks(&[1, 2])[0];
        assert_eq!(BlockHasher::with_extra(b0, 7), BlockHash(xxh3_64_with_seed(&7u64.to_le_bytes(), b0.0)));
        assert_ne!(BlockHasher::with_extra(b0, 7), b0);
    }

    #[test]
    fn zero_block_size_is_an_error() {
        assert_eq!(BlockHasher::new(0, &ns("m")), Err(Error::ZeroBlockSize));
    }

    #[test]
    fn partial_block_is_not_hashed() {
        let h = BlockHasher::new(4, &ns("m")).unwrap();
        assert_eq!(h.hash_blocks(&[1, 2, 3]).len(), 0);
        assert_eq!(h.hash_blocks(&[1, 2, 3, 4, 5, 6, 7]).len(), 1);
        assert_eq!(h.hash_blocks(&[1, 2, 3, 4, 5, 6, 7, 8]).len(), 2);
    }

    #[test]
    fn chain_is_the_documented_definition() {
        let n = ns("llama");
        let h = BlockHasher::new(2, &n).unwrap();
        let seed = xxh3_64(b"llama\0");
        assert_eq!(h.seed(), seed);
        let mum = |a: u64, b: u64| {
            let m = u128::from(a) * u128::from(b);
            (m as u64) ^ ((m >> 64) as u64)
        };
        let b0 = mum(seed ^ 0x2d35_8dcc_aa6c_78a5, xxh3_64(&[1, 0, 0, 0, 2, 0, 0, 0]) ^ 0x8bb8_4b93_962e_acc9);
        let b1 = mum(b0 ^ 0x2d35_8dcc_aa6c_78a5, xxh3_64(&[3, 0, 0, 0, 4, 0, 0, 0]) ^ 0x8bb8_4b93_962e_acc9);
        assert_eq!(h.hash_blocks(&[1, 2, 3, 4, 5]), vec![BlockHash(b0), BlockHash(b1)]);
        // One block at a time gives the same chain.
        assert_eq!(h.hash_block(Some(BlockHash(b0)), &[3, 4]), BlockHash(b1));
    }

    #[test]
    fn a_prompt_key_is_its_length_then_its_partial_block_on_the_last_hash() {
        let h = BlockHasher::new(2, &ns("m")).unwrap();
        let toks = [1, 2, 3, 4, 5];
        let hashes = h.hash_blocks(&toks);
        let length = |n: u8| [n, 0, 0, 0, 0, 0, 0, 0, 0xFF];
        let by_length = xxh3_64_with_seed(&length(5), hashes[1].0);
        assert_eq!(h.prompt_key(&hashes, &toks), xxh3_64_with_seed(&[5, 0, 0, 0], by_length));
        // Block-aligned: the length on the last hash alone; shorter than a block: on the seed.
        assert_eq!(h.prompt_key(&hashes, &toks[..4]), xxh3_64_with_seed(&length(4), hashes[1].0));
        let seeded = xxh3_64_with_seed(&length(1), h.seed());
        assert_eq!(h.prompt_key(&[], &toks[..1]), xxh3_64_with_seed(&[1, 0, 0, 0], seeded));
        // A request built from the same block hashes gets the same key.
        let from = crate::RouteRequest::from_hashes(4, hashes.clone(), None);
        assert_eq!(from.prompt_key, h.prompt_key(&hashes, &toks[..4]));
        // Never a block's hash: with 2-token blocks a block is 8 bytes, as a bare length would be.
        let next = h.hash_blocks(&[1, 2, 3, 4, 4, 0]);
        assert_ne!(h.prompt_key(&hashes, &toks[..4]), next[2].0);
        // Any token of the prompt changes it, in a full block or the partial one.
        for changed in [[9, 2, 3, 4, 5], [1, 2, 3, 4, 9]] {
            assert_ne!(h.prompt_key(&h.hash_blocks(&changed), &changed), h.prompt_key(&hashes, &toks));
        }
    }

    #[test]
    fn equal_hash_means_equal_prefix() {
        let h = BlockHasher::new(2, &ns("m")).unwrap();
        let a = h.hash_blocks(&[1, 2, 3, 4]);
        let b = h.hash_blocks(&[9, 9, 3, 4]);
        // Same second block tokens, different first block: the chain makes them differ.
        assert_ne!(a[1], b[1]);
        let c = h.hash_blocks(&[1, 2, 3, 4, 7, 7]);
        assert_eq!(&c[..2], &a[..]);
    }

    #[test]
    fn namespaces_never_match() {
        let toks: Vec<u32> = (0..64).collect();
        let base = BlockHasher::new(16, &ns("m")).unwrap().hash_blocks(&toks);
        for other in [
            ns("m2"),
            Namespace { model: "m".into(), adapter: "lora-a".into(), salt: String::new() },
            Namespace { model: "m".into(), adapter: String::new(), salt: "tenant-1".into() },
        ] {
            let hs = BlockHasher::new(16, &other).unwrap().hash_blocks(&toks);
            assert!(hs.iter().all(|h| !base.contains(h)), "{other:?} shares a block");
        }
    }

    #[test]
    fn adapter_hashers_agree_with_adapter_namespaces() {
        let base = BlockHasher::new(4, &ns("m")).unwrap();
        let with = Namespace { model: "m".into(), adapter: "lora-a".into(), salt: String::new() };
        assert_eq!(base.for_adapter("lora-a"), BlockHasher::new(4, &with).unwrap());
        assert_eq!(base.for_adapter(""), base);
        assert_ne!(base.for_adapter("lora-a").seed(), base.for_adapter("lora-b").seed());
    }

    #[test]
    fn continuing_from_a_parent_equals_hashing_the_whole() {
        let h = BlockHasher::new(3, &ns("m")).unwrap();
        let toks: Vec<u32> = (100..112).collect();
        let whole = h.hash_blocks(&toks);
        let tail = h.hash_blocks_from(Some(whole[1]), &toks[6..]);
        assert_eq!(&whole[2..], &tail[..]);
    }

    proptest::proptest! {
        /// Hashing is a pure function of (namespace, block size, tokens), and a sequence's
        /// hashes extend those of every block-aligned prefix of it.
        #[test]
        fn deterministic_and_prefix_closed(
            a in proptest::collection::vec(proptest::num::u32::ANY, 0..80),
            b in proptest::collection::vec(proptest::num::u32::ANY, 0..80),
            bs in 1u32..9,
        ) {
            let h = BlockHasher::new(bs, &ns("m")).unwrap();
            let aligned = &a[..a.len() / bs as usize * bs as usize];
            let joined: Vec<u32> = aligned.iter().chain(&b).copied().collect();
            let whole = h.hash_blocks(&joined);
            proptest::prop_assert_eq!(&whole, &BlockHasher::new(bs, &ns("m")).unwrap().hash_blocks(&joined));
            proptest::prop_assert_eq!(&whole[..aligned.len() / bs as usize], &h.hash_blocks(aligned)[..]);
            proptest::prop_assert_eq!(whole.len(), joined.len() / bs as usize);
        }
    }
}
