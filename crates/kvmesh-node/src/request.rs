//! An OpenAI request as the router reads it: its body parsed (completions or chat), its
//! model and adapter selected, its prompt tokenized and hashed, its output-length hint; and a
//! refusal in the client's terms ([`Rejected`]). Shared by the proxy, the disaggregated flow
//! and the endpoint picker, below all three.

use crate::state::Shared;
use axum::body::Bytes;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use serde::Deserialize;
use std::borrow::Cow;
use std::sync::Arc;

/// The client's output-length hint: the [`HINT_HEADER`] header as a positive whole number of
/// tokens, if sent.
///
/// # Errors
/// A message for a 400 when the header is not a number from 1 to 4,294,967,295.
fn expected_output_tokens(headers: &HeaderMap) -> Result<Option<u32>, String> {
    let Some(v) = headers.get(HINT_HEADER) else { return Ok(None) };
    match v.to_str().ok().and_then(|s| s.trim().parse::<u32>().ok()).filter(|&n| n > 0) {
        Some(n) => Ok(Some(n)),
        None => Err(format!("{HINT_HEADER} must be a whole number of tokens from 1 to {}, got {v:?}", u32::MAX)),
    }
}

/// The request header carrying a client's expected output length, tokens (an agent harness
/// or RL trainer that knows its length class); gRPC `Route`'s `expected_output_tokens`.
pub const HINT_HEADER: &str = "x-kvmesh-expected-output-tokens";

/// Request headers passed to the engine: everything but hop-by-hop headers and the ones the
/// client connection defines (`Authorization` for vLLM's `--api-key` included).
pub(crate) fn upstream_headers(headers: &HeaderMap) -> HeaderMap {
    // The router picks the data-parallel rank: a client's own rank header never passes.
    const SKIP: [&str; 10] = [
        crate::endpoints::DATA_PARALLEL_RANK_HEADER,
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ];
    let mut out = HeaderMap::with_capacity(headers.len());
    for (k, v) in headers {
        if !SKIP.contains(&k.as_str()) {
            out.append(k.clone(), v.clone());
        }
    }
    // The body was read as JSON whatever the client declared; say so to the engine.
    out.entry(header::CONTENT_TYPE).or_insert(HeaderValue::from_static("application/json"));
    out
}

/// A request's routing inputs once [`check`]ed.
pub(crate) struct Checked {
    /// The model, or LoRA adapter, its `model` names (vLLM's OpenAI server).
    pub selected: crate::models::Selected,
    /// Its `max_tokens` (or `max_completion_tokens`), tokens.
    pub max_tokens: Option<u32>,
    /// The client's output-length hint ([`HINT_HEADER`]), tokens.
    pub hint: Option<u32>,
}

/// Why a request is refused before routing: the HTTP status, the client's message and the
/// `kvmesh_requests_total` outcome.
pub(crate) struct Rejected {
    pub status: StatusCode,
    pub message: String,
    pub outcome: &'static str,
}

impl Rejected {
    /// A 400 `bad_request`.
    fn bad(message: String) -> Rejected {
        Rejected { status: StatusCode::BAD_REQUEST, message, outcome: "bad_request" }
    }
}

/// The checks every routed request passes before it is decided, the proxy's and the
/// endpoint picker's alike: the model asked for is served ([`crate::models::ServedModels::select`];
/// the selection carries `cache_salt`),
/// the prompt (`prompt_tokens`) is within `node.max_prompt_tokens`, and the output-length
/// hint in `headers` is well formed.
///
/// # Errors
/// [`Rejected`]: 404 `unknown_model`, 413 `too_long`, 400 `bad_request`.
pub(crate) fn check(
    shared: &Shared,
    (asked_model, cache_salt): (Option<&str>, Option<String>),
    prompt_tokens: usize,
    max_tokens: Option<u64>,
    headers: &HeaderMap,
) -> Result<Checked, Rejected> {
    let mut selected = shared.models.select(asked_model).map_err(|e| Rejected {
        status: StatusCode::NOT_FOUND,
        message: e.to_string(),
        outcome: "unknown_model",
    })?;
    let model = shared.models.of_replica(selected.model.as_deref());
    if let Some(message) = selected.adapter.as_deref().and_then(|a| shared.core().adapter_unserved(model, a)) {
        return Err(Rejected { status: StatusCode::NOT_FOUND, message, outcome: "unknown_model" });
    }
    selected.salt = cache_salt;
    let limit = shared.settings.max_prompt_tokens;
    if prompt_tokens > limit as usize {
        return Err(Rejected {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "the prompt has {prompt_tokens} tokens; this router accepts at most {limit} (node.max_prompt_tokens)"
            ),
            outcome: "too_long",
        });
    }
    let hint = expected_output_tokens(headers).map_err(|message| Rejected {
        status: StatusCode::BAD_REQUEST,
        message,
        outcome: "bad_request",
    })?;
    Ok(Checked { selected, max_tokens: max_tokens.map(|n| n.min(u32::MAX as u64) as u32), hint })
}

/// The request fields routing reads (everything else passes through untouched); borrowed
/// from the body, no JSON tree built.
#[derive(Deserialize)]
struct RequestFields<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt: Option<Prompt<'a>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "prompt must be a string, an array of token ids or an array of strings")]
enum Prompt<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Ids(Vec<u64>),
    Texts(#[serde(borrow)] Vec<Cow<'a, str>>),
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Parts(#[serde(borrow)] Vec<Part<'a>>),
    Other(serde::de::IgnoredAny),
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// What routing needs from a request body: the model asked for, `max_tokens`, the prompt's
/// token ids, and whether their count is the engine's (token ids given, or a model
/// tokenizer) or an estimate.
pub(crate) struct Parsed {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub tokens: Arc<[u32]>,
    pub exact: bool,
    /// The client asked for a streamed answer (its first token is seen when it comes).
    pub stream: bool,
    /// vLLM's `cache_salt`: the request's prefix cache is its tenant's own (vLLM salts the
    /// first block's hash with it), so only blocks stored with the same salt are overlap.
    pub cache_salt: Option<String>,
}

impl Parsed {
    fn new(f: &RequestFields<'_>, tokens: Vec<u32>, exact: bool) -> Parsed {
        Parsed {
            model: f.model.as_deref().map(str::to_string),
            max_tokens: f.max_tokens.or(f.max_completion_tokens),
            tokens: tokens.into(),
            exact,
            stream: f.stream.unwrap_or(false),
            cache_salt: f.cache_salt.as_deref().filter(|s| !s.is_empty()).map(str::to_string),
        }
    }
}

/// Bodies at least this large are parsed and tokenized on tokio's blocking pool: a real
/// tokenizer on a long prompt (or chat template) takes milliseconds, which would hold up every
/// other request on the proxy's thread. Smaller ones stay inline (the hand-off would cost more).
const INLINE_BODY_BYTES: usize = 16 * 1024;

/// Reads a request body of one API: [`read_completion`] or [`read_chat`].
pub(crate) type Reader = fn(&Shared, &[u8]) -> Result<Parsed, Rejected>;

/// Runs `read` on `body`, inline or (for large bodies) on the blocking pool; a client error
/// counts as `bad_request`.
///
/// # Errors
/// What `read` refuses, or a 500 when the blocking pool's task failed.
pub(crate) async fn parse(shared: &Arc<Shared>, body: &Bytes, read: Reader) -> Result<Parsed, Rejected> {
    let parsed = if body.len() < INLINE_BODY_BYTES {
        read(shared, body)
    } else {
        let (s, b) = (shared.clone(), body.clone());
        tokio::task::spawn_blocking(move || read(&s, &b)).await.unwrap_or_else(|e| {
            Err(Rejected {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!("reading the request failed: {e}"),
                outcome: "internal_error",
            })
        })
    };
    if parsed.as_ref().is_err_and(|r| r.status.is_client_error()) {
        shared.metrics.request("bad_request");
    }
    parsed
}

/// A body that is JSON but not an object would otherwise read as serde's field-by-field
/// complaint about a struct given as a list.
fn object(body: &[u8]) -> Result<&[u8], Rejected> {
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => Ok(body),
        Some(b'[') => Err(Rejected::bad("the body must be a JSON object, not an array".into())),
        _ => Ok(body),
    }
}

pub(crate) fn read_completion(shared: &Shared, body: &[u8]) -> Result<Parsed, Rejected> {
    let f = serde_json::from_slice::<RequestFields<'_>>(object(body)?)
        .map_err(|e| Rejected::bad(format!("the body is not a JSON completion request: {e}")))?;
    let exact = shared.tokenizer.exact(false);
    let (tokens, exact) = match &f.prompt {
        Some(Prompt::Text(p)) => (shared.tokenizer.encode(p), exact),
        Some(Prompt::Ids(ids)) if !ids.is_empty() => {
            (ids.iter().map(|&t| t.min(u32::MAX as u64) as u32).collect(), true)
        }
        // A batch of prompts: route on the first (they share one replica).
        Some(Prompt::Texts(ps)) if !ps.is_empty() => (shared.tokenizer.encode(&ps[0]), exact),
        _ => return Err(Rejected::bad("prompt must be a string, strings, or token ids".into())),
    };
    Ok(Parsed::new(&f, tokens, exact))
}

pub(crate) fn read_chat(shared: &Shared, body: &[u8]) -> Result<Parsed, Rejected> {
    let f = serde_json::from_slice::<RequestFields<'_>>(object(body)?)
        .map_err(|e| Rejected::bad(format!("the body is not a JSON chat completion request: {e}")))?;
    let Some(messages) = &f.messages else {
        return Err(Rejected::bad("messages must be an array".into()));
    };
    let parts: Vec<(&str, String)> = messages
        .iter()
        .map(|m| {
            let content = match &m.content {
                Some(Content::Text(c)) => c.to_string(),
                Some(Content::Parts(ps)) => ps.iter().filter_map(|p| p.text.as_deref()).collect(),
                _ => String::new(),
            };
            (m.role.as_deref().unwrap_or("user"), content)
        })
        .collect();
    let messages: Vec<(&str, &str)> = parts.iter().map(|(r, c)| (*r, c.as_str())).collect();
    let tokens = shared.tokenizer.encode_chat(&messages);
    Ok(Parsed::new(&f, tokens, shared.tokenizer.exact(true)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_prompt_of_another_type_is_told_what_it_may_be() {
        let shared = crate::state::test_node(Default::default());
        let e = super::read_completion(&shared, br#"{"model": "m", "prompt": 5}"#).err().unwrap();
        assert_eq!(
            e.message,
            "the body is not a JSON completion request: prompt must be a string, an array of token ids or an array \
             of strings at line 1 column 27"
        );
    }
}
