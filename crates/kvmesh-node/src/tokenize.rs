//! Prompt text → token ids: the model's own tokenizer when configured, else kvmesh's
//! approximate scheme.
//!
//! With `node.tokenizer` set to a Hugging Face `tokenizer.json`, completions are routed on the
//! ids vLLM computes (special tokens added as the tokenizer defines, as vLLM does for
//! `/v1/completions`). Chats are rendered with kvmesh's own template
//! ([`kvmesh_core::prompt::render_chat`]), not the model's chat template, so their ids
//! match the engine's only in the messages' content; routing still follows the conversation
//! prefix, but KV-event overlaps for chats are approximate.

use anyhow::Context;
use kvmesh_core::prompt::approximate_tokens;
use std::path::Path;

/// How the node turns text into token ids.
pub enum Tokenizer {
    /// kvmesh's approximate ids (4 UTF-8 bytes per id).
    Approximate,
    /// A Hugging Face tokenizer.
    Model(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// Loads `path`, or the approximate scheme when `None`.
    ///
    /// # Errors
    /// The file cannot be read or is not a `tokenizer.json`.
    pub fn load(path: Option<&Path>) -> anyhow::Result<Self> {
        let Some(path) = path else { return Ok(Tokenizer::Approximate) };
        let t = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("loading tokenizer {}", path.display()))?;
        Ok(Tokenizer::Model(Box::new(t)))
    }

    /// The token ids of `text`. A tokenizer error (rare: malformed normalizer input) falls back
    /// to the approximate ids rather than failing the request.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Approximate => approximate_tokens(text),
            Tokenizer::Model(t) => match t.encode(text, true) {
                Ok(e) => e.get_ids().to_vec(),
                Err(e) => {
                    tracing::warn!(error = %e, "tokenizer failed; routing on approximate ids");
                    approximate_tokens(text)
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer in Hugging Face's JSON format.
    const WORD_LEVEL: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
        "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
        "model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1,"world":2},"unk_token":"[UNK]"}}"#;

    #[test]
    fn a_tokenizer_json_gives_model_ids_and_none_gives_approximate_ids() {
        let dir = std::env::temp_dir().join(format!("kvmesh-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, WORD_LEVEL).unwrap();
        let t = Tokenizer::load(Some(&path)).unwrap();
        assert_eq!(t.encode("hello world again"), vec![1, 2, 0]);
        assert_eq!(Tokenizer::load(None).unwrap().encode("abcd"), vec![u32::from_le_bytes(*b"abcd")]);
        std::fs::write(&path, "{").unwrap();
        let err = Tokenizer::load(Some(&path)).err().unwrap();
        assert!(format!("{err:#}").starts_with(&format!("loading tokenizer {}", path.display())), "{err:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
