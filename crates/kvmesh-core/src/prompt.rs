//! Prompts without a tokenizer: a documented, prefix-stable stand-in for token ids.
//!
//! Routing on KV overlap needs the engine's token ids. With the model's `tokenizer.json` a
//! router computes them exactly; without one it uses this scheme, which keeps what routing
//! needs — equal leading text gives equal leading ids — and nothing else:
//!
//! - text → UTF-8 bytes → one id per [`BYTES_PER_TOKEN`] bytes (`u32::from_le_bytes`, the last
//!   chunk zero-padded), so a prompt of `n` bytes counts `⌈n/4⌉` tokens (English averages about
//!   four characters per token, so load estimates stay in the right range);
//! - a chat is rendered as `<|role|>\n{content}\n` per message plus `<|assistant|>\n`, so a
//!   conversation's next turn starts with the previous turn's whole rendered prompt.
//!
//! Its ids match a real engine's only when the engine uses the same scheme (kvmesh's
//! `kvmesh-engine-sim` does); against vLLM, configure the tokenizer.

/// Bytes of text per approximate token.
pub const BYTES_PER_TOKEN: usize = 4;

/// Approximate token ids of `text` (see the module docs).
pub fn approximate_tokens(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(BYTES_PER_TOKEN)
        .map(|c| {
            let mut b = [0u8; BYTES_PER_TOKEN];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

/// Renders chat messages `(role, content)` as one prompt (see the module docs).
pub fn render_chat<'a>(messages: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut out = String::new();
    for (role, content) in messages {
        out.push_str("<|");
        out.push_str(role);
        out.push_str("|>\n");
        out.push_str(content);
        out.push('\n');
    }
    out.push_str("<|assistant|>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_bytes_per_token_little_endian_zero_padded() {
        assert_eq!(approximate_tokens(""), Vec::<u32>::new());
        assert_eq!(approximate_tokens("abcde"), vec![u32::from_le_bytes(*b"abcd"), 0x65]);
        assert_eq!(approximate_tokens("é").len(), 1, "2 UTF-8 bytes");
    }

    #[test]
    fn a_next_turn_extends_the_previous_prompt() {
        let first = render_chat([("system", "Be brief."), ("user", "Hi")]);
        assert_eq!(first, "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n");
        let second = render_chat([("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", "Bye")]);
        assert!(second.starts_with(&first));
        let (a, b) = (approximate_tokens(&first), approximate_tokens(&second));
        // Every whole 4-byte chunk of the first prompt is a leading id of the second.
        let whole = first.len() / BYTES_PER_TOKEN;
        assert_eq!(a[..whole], b[..whole]);
    }
}
