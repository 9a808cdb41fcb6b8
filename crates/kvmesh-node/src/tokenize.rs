//! Prompt text → token ids: the model's own tokenizer when configured, else kvmesh's
//! approximate scheme.
//!
//! With `node.tokenizer` set to a Hugging Face `tokenizer.json`, completions are routed on the
//! ids vLLM computes (special tokens added as the tokenizer defines, as vLLM does for
//! `/v1/completions`). Chats are rendered with the model's chat template — the `chat_template`
//! of the `tokenizer_config.json` beside the tokenizer, a Jinja template run with minijinja
//! (Python string methods included) with `messages`, `add_generation_prompt = true`,
//! `bos_token` and `eos_token`, as vLLM's `apply_chat_template` does — and tokenized without
//! adding special tokens (the template carries them). Without a chat template, chats are
//! rendered with kvmesh's own ([`kvmesh_core::prompt::render_chat`]).

use anyhow::Context;
use kvmesh_core::prompt::{approximate_tokens, render_chat};
use std::path::Path;

/// How the node turns text into token ids.
pub enum Tokenizer {
    /// kvmesh's approximate ids (4 UTF-8 bytes per id).
    Approximate,
    /// A Hugging Face tokenizer, and the model's chat template when it has one.
    Model(Box<tokenizers::Tokenizer>, Option<Box<ChatTemplate>>),
}

/// A model's chat template (from `tokenizer_config.json`).
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Reads `chat_template` (a string, or a list of `{name, template}` where `default` is
    /// used), `bos_token` and `eos_token` from a `tokenizer_config.json`. `Ok(None)` when the
    /// file has no template.
    ///
    /// # Errors
    /// The file is not JSON, or the template does not compile.
    pub fn from_config(path: &Path) -> anyhow::Result<Option<Self>> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let config: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let source = match config.get("chat_template") {
            Some(serde_json::Value::String(t)) => t.clone(),
            Some(serde_json::Value::Array(named)) => match named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
            {
                Some(t) => t.to_string(),
                None => return Ok(None),
            },
            _ => return Ok(None),
        };
        let token = |key: &str| match config.get(key) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v) => v.get("content").and_then(|c| c.as_str()).unwrap_or_default().to_string(),
            None => String::new(),
        };
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source)
            .with_context(|| format!("compiling the chat template of {}", path.display()))?;
        Ok(Some(ChatTemplate { env, bos_token: token("bos_token"), eos_token: token("eos_token") }))
    }

    /// The prompt text the template makes of `messages` (`(role, content)`).
    ///
    /// # Errors
    /// The template raised (e.g. roles out of order) or failed.
    pub fn render(&self, messages: &[(&str, &str)]) -> Result<String, minijinja::Error> {
        let messages: Vec<_> = messages.iter().map(|&(r, c)| minijinja::context! { role => r, content => c }).collect();
        self.env.get_template("chat")?.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
    }
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
        let config = path.with_file_name("tokenizer_config.json");
        let template = if config.is_file() { ChatTemplate::from_config(&config)? } else { None };
        if template.is_none() {
            tracing::warn!(tokenizer = %path.display(), "no chat template beside the tokenizer: chats are rendered with kvmesh's own template");
        }
        Ok(Tokenizer::Model(Box::new(t), template.map(Box::new)))
    }

    /// Whether its token counts are the engine's: a model tokenizer, and for a chat its chat
    /// template too (kvmesh's own rendering and the approximate ids are estimates).
    pub fn exact(&self, chat: bool) -> bool {
        matches!(self, Tokenizer::Model(_, template) if !chat || template.is_some())
    }

    /// The token ids of a chat's prompt (`(role, content)` messages; see the module docs).
    pub fn encode_chat(&self, messages: &[(&str, &str)]) -> Vec<u32> {
        if let Tokenizer::Model(t, Some(template)) = self {
            match template.render(messages) {
                Ok(text) => match t.encode(text.as_str(), false) {
                    Ok(e) => return e.get_ids().to_vec(),
                    Err(e) => tracing::warn!(error = %e, "tokenizer failed on a rendered chat"),
                },
                Err(e) => tracing::warn!(error = %e, "chat template failed; using kvmesh's rendering"),
            }
        }
        self.encode(&render_chat(messages.iter().copied()))
    }

    /// The token ids of `text`. A tokenizer error (rare: malformed normalizer input) falls back
    /// to the approximate ids rather than failing the request.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Approximate => approximate_tokens(text),
            Tokenizer::Model(t, _) => match t.encode(text, true) {
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
        "normalizer":null,"pre_tokenizer":{"type":"WhitespaceSplit"},"post_processor":null,"decoder":null,
        "model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1,"world":2,"<user>":3,"<assistant>":4},"unk_token":"[UNK]"}}"#;

    #[test]
    fn a_tokenizer_json_gives_model_ids_and_none_gives_approximate_ids() {
        let dir = std::env::temp_dir().join(format!("kvmesh-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, WORD_LEVEL).unwrap();
        let t = Tokenizer::load(Some(&path)).unwrap();
        assert_eq!(t.encode("hello world again"), vec![1, 2, 0]);
        assert_eq!(Tokenizer::load(None).unwrap().encode("abcd"), vec![u32::from_le_bytes(*b"abcd")]);
        // With a chat template beside it, chats follow the model's template.
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "hello"}, "eos_token": "world",
                "chat_template": "{{ bos_token }} {% for m in messages %}<{{ m.role }}> {{ m.content.strip() }} {% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"}"#,
        )
        .unwrap();
        let t = Tokenizer::load(Some(&path)).unwrap();
        assert_eq!(t.encode_chat(&[("user", "  world hello ")]), vec![1, 3, 2, 1, 4]);
        std::fs::write(&path, "{").unwrap();
        let err = Tokenizer::load(Some(&path)).err().unwrap();
        assert!(format!("{err:#}").starts_with(&format!("loading tokenizer {}", path.display())), "{err:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
