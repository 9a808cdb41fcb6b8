//! Token ids for trace requests that carry only lengths and prefix-block ids.
//!
//! Each block id stands for `block_tokens` fixed pseudo-random tokens (splitmix64 of the id and
//! the position), so requests with equal leading ids get equal leading tokens and different ids
//! give different tokens; the prompt is the concatenation, cut to `input_tokens`. Requests
//! without block ids (Azure traces) get tokens unique to the request. Token values stay below
//! 2^17, a realistic vocabulary size.

use crate::trace::TraceRequest;

/// splitmix64 (Steele, Lea, Flood, "Fast splittable pseudorandom number generators", 2014).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The prompt tokens of `req` (request number `index` in its trace).
pub fn prompt_tokens(req: &TraceRequest, index: u64, block_tokens: Option<u32>) -> Vec<u32> {
    let n = req.input_tokens.max(1) as usize;
    let mut out = Vec::with_capacity(n);
    match block_tokens {
        Some(bt) if !req.block_ids.is_empty() => {
            'ids: for &id in &req.block_ids {
                let base = mix(id ^ 0x6B76_6D65_7368);
                for j in 0..bt as u64 {
                    if out.len() == n {
                        break 'ids;
                    }
                    out.push((mix(base.wrapping_add(j)) & 0x1_FFFF) as u32);
                }
            }
            // Prompts longer than their ids cover (malformed traces) continue uniquely.
            let tail = mix(index ^ 0x7461_696C);
            while out.len() < n {
                out.push((mix(tail.wrapping_add(out.len() as u64)) & 0x1_FFFF) as u32);
            }
        }
        _ => {
            let base = mix(index.wrapping_mul(0x1000_0000_01B3));
            out.extend((0..n as u64).map(|j| (mix(base.wrapping_add(j)) & 0x1_FFFF) as u32));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(ids: &[u64], input: u32) -> TraceRequest {
        TraceRequest {
            arrival_s: 0.0,
            input_tokens: input,
            output_tokens: 1,
            block_ids: ids.to_vec(),
            max_tokens: None,
            group: None,
        }
    }

    #[test]
    fn equal_leading_ids_give_equal_leading_tokens() {
        let a = prompt_tokens(&r(&[0, 1, 2], 1200), 0, Some(512));
        let b = prompt_tokens(&r(&[0, 1, 3], 1100), 1, Some(512));
        assert_eq!((a.len(), b.len()), (1200, 1100));
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1100], b[1024..1100]);
        assert_eq!(a, prompt_tokens(&r(&[0, 1, 2], 1200), 0, Some(512)), "deterministic");
        assert!(a.iter().all(|&t| t < 1 << 17));
    }

    #[test]
    fn requests_without_ids_share_nothing() {
        let a = prompt_tokens(&r(&[], 64), 0, None);
        let b = prompt_tokens(&r(&[], 64), 1, None);
        assert_ne!(a[..16], b[..16]);
    }
}
