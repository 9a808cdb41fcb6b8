//! The endpoint picker protocol's messages, built and read without I/O.
//!
//! Source: kubernetes-sigs/gateway-api-inference-extension
//! `docs/proposals/004-endpoint-picker-protocol/README.md` (protocol v1.0.0, 2025-07-29), over
//! Envoy's `envoy/service/ext_proc/v3/external_processor.proto` (the `envoy-types` crate's
//! generated types):
//! - the picked endpoint goes back as the request header `x-gateway-destination-endpoint`
//!   and as dynamic metadata `{"envoy.lb": {"x-gateway-destination-endpoint": "<ip:port>"}}`,
//!   the same value in both;
//! - a gateway may restrict the pick with filter metadata
//!   `{"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": [<ip:port>, …]}}`;
//!   an empty or wholly ineligible subset is a 503;
//! - no endpoint: an `ImmediateResponse` with 503 (none ready) or 429 (shed).

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse,
    ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// The filter-metadata key of the endpoint subset (inside the subset namespace).
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// The request header naming a disaggregated request's prefill endpoint (`<ip:port>`) to the
/// decode pod's sidecar, as llm-d's P/D scheduling sets it (llm-d-inference-scheduler,
/// `x-prefiller-host-port`).
pub const PREFILL_HEADER: &str = "x-prefiller-host-port";

/// How the gateway sends request bodies (Envoy's `ProcessingMode.BodySendMode`, told in
/// `ProcessingRequest.protocol_config`), which decides when the picker may answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    /// `NONE`: no body comes; the pick is made on the headers.
    None,
    /// `FULL_DUPLEX_STREAMED` (the Inference Extension's): body chunks come without waiting;
    /// the headers' answer is held until the whole body is read, and the body is sent back.
    FullDuplex,
    /// `BUFFERED` / `BUFFERED_PARTIAL`: the headers are answered at once, the (whole) body
    /// comes in one message and its answer carries the pick.
    Buffered,
    /// `STREAMED`: chunks each answered before the next; the headers are gone upstream by the
    /// time the body is read, so no pick can be made on it.
    Streamed,
}

impl BodyMode {
    /// From Envoy's enum value; unknown values read as full duplex (the protocol's mode).
    pub fn from_envoy(mode: i32) -> BodyMode {
        match mode {
            0 => BodyMode::None,
            1 => BodyMode::Streamed,
            2 | 3 => BodyMode::Buffered,
            _ => BodyMode::FullDuplex,
        }
    }
}

/// A header's value as Envoy sends it (`raw_value`, or `value` from older data planes).
pub fn header_value(h: &HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

/// Envoy's headers as an [`http::HeaderMap`], pseudo-headers (`:path`, `:status`) dropped
/// (read them with [`pseudo`]); names or values HTTP refuses are skipped.
pub fn to_http_headers(headers: Option<&HeaderMap>) -> http::HeaderMap {
    let mut out = http::HeaderMap::new();
    for h in headers.map(|m| m.headers.as_slice()).unwrap_or_default() {
        if h.key.starts_with(':') {
            continue;
        }
        if let (Ok(k), Ok(v)) =
            (http::HeaderName::from_bytes(h.key.as_bytes()), http::HeaderValue::from_bytes(header_value(h)))
        {
            out.append(k, v);
        }
    }
    out
}

/// A pseudo-header's value (`:path`, `:method`, `:status`), if sent and UTF-8.
pub fn pseudo<'a>(headers: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    let h = headers?.headers.iter().find(|h| h.key == name)?;
    std::str::from_utf8(header_value(h)).ok()
}

/// The endpoint subset in `metadata` under `namespace`, if the gateway sent one: a list of
/// strings (each may itself be `a,b`), or one comma-separated string.
pub fn subset(metadata: Option<&Metadata>, namespace: &str) -> Option<Vec<String>> {
    let value = metadata?.filter_metadata.get(namespace)?.fields.get(SUBSET_KEY)?;
    let mut out = Vec::new();
    let mut push = |s: &str| out.extend(s.split(',').map(str::trim).filter(|e| !e.is_empty()).map(String::from));
    match &value.kind {
        Some(Kind::StringValue(s)) => push(s),
        Some(Kind::ListValue(l)) => {
            for v in &l.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    push(s);
                }
            }
        }
        _ => {}
    }
    Some(out)
}

fn string(s: &str) -> Value {
    Value { kind: Some(Kind::StringValue(s.to_string())) }
}

fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.to_string(), value: String::new(), raw_value: value.as_bytes().to_vec() }),
        ..HeaderValueOption::default()
    }
}

/// The pick as the gateway reads it: the header mutation (destination; the data-parallel
/// `rank` of the engine behind `endpoint`, when the pick is one rank of several, as
/// `x-data-parallel-rank`; and with `body_len` the new `content-length` of the body sent
/// back) with the route cache cleared, and the dynamic metadata `{namespace: {header:
/// endpoint}}`.
pub fn destination(
    header_name: &str,
    namespace: &str,
    endpoint: &str,
    rank: Option<u32>,
    body_len: Option<usize>,
) -> (CommonResponse, Struct) {
    let mut set_headers = vec![header(header_name, endpoint)];
    if let Some(k) = rank {
        // Replacing a client's own rank header, not added beside it (Envoy's default appends).
        let action =
            envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd;
        set_headers.push(HeaderValueOption {
            append_action: action as i32,
            ..header(crate::endpoints::DATA_PARALLEL_RANK_HEADER, &k.to_string())
        });
    }
    if let Some(n) = body_len {
        set_headers.push(header("content-length", &n.to_string()));
    }
    let common = CommonResponse {
        // The router picks the rank: a client's own rank header never reaches the engine.
        header_mutation: Some(HeaderMutation {
            set_headers,
            remove_headers: match rank {
                Some(_) => vec![],
                None => vec![crate::endpoints::DATA_PARALLEL_RANK_HEADER.to_string()],
            },
        }),
        clear_route_cache: true,
        ..CommonResponse::default()
    };
    let inner = Struct { fields: [(header_name.to_string(), string(endpoint))].into_iter().collect() };
    let metadata = Struct {
        fields: [(namespace.to_string(), Value { kind: Some(Kind::StructValue(inner)) })].into_iter().collect(),
    };
    (common, metadata)
}

/// Names a disaggregated request's prefill endpoint in [`PREFILL_HEADER`] (replacing any
/// value the client sent), or — for a request served whole — removes a client's own: only
/// the picker says where a prefill runs.
pub fn prefill_header(m: &mut HeaderMutation, prefill: Option<&str>) {
    match prefill {
        Some(p) => {
            let action =
                envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd;
            m.set_headers.push(HeaderValueOption { append_action: action as i32, ..header(PREFILL_HEADER, p) });
        }
        None => m.remove_headers.push(PREFILL_HEADER.to_string()),
    }
}

/// The answer to request headers: `common` (a plain continue when `None`), with `metadata`.
pub fn request_headers(common: Option<CommonResponse>, metadata: Option<Struct>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(HeadersResponse { response: common })),
        dynamic_metadata: metadata,
        ..ProcessingResponse::default()
    }
}

/// The answer to the request body: in full duplex, the body itself sent on (`streamed`); in
/// buffered mode, `common` (the pick) and `metadata`.
pub fn request_body(
    streamed: Option<(Vec<u8>, bool)>,
    common: Option<CommonResponse>,
    metadata: Option<Struct>,
) -> ProcessingResponse {
    let mut common = common.unwrap_or_default();
    if let Some((body, end_of_stream)) = streamed {
        common.body_mutation = Some(streamed_body(body, end_of_stream));
    }
    ProcessingResponse {
        response: Some(processing_response::Response::RequestBody(BodyResponse { response: Some(common) })),
        dynamic_metadata: metadata,
        ..ProcessingResponse::default()
    }
}

fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> BodyMutation {
    BodyMutation {
        mutation: Some(body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
            body,
            end_of_stream,
            ..StreamedBodyResponse::default()
        })),
    }
}

/// A plain continue for response headers.
pub fn response_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseHeaders(HeadersResponse { response: None })),
        ..ProcessingResponse::default()
    }
}

/// The answer to a response-body chunk: in full duplex the chunk sent on unchanged, else a
/// plain continue.
pub fn response_body(full_duplex: Option<(Vec<u8>, bool)>) -> ProcessingResponse {
    let common = full_duplex.map(|(body, eos)| CommonResponse {
        body_mutation: Some(streamed_body(body, eos)),
        ..CommonResponse::default()
    });
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseBody(BodyResponse { response: common })),
        ..ProcessingResponse::default()
    }
}

/// A plain continue for trailers, request (`request` true) or response.
pub fn trailers(request: bool) -> ProcessingResponse {
    let t = TrailersResponse { header_mutation: None };
    let response = if request {
        processing_response::Response::RequestTrailers(t)
    } else {
        processing_response::Response::ResponseTrailers(t)
    };
    ProcessingResponse { response: Some(response), ..ProcessingResponse::default() }
}

/// An answer the gateway sends the client in place of forwarding: `status` with an OpenAI
/// error body (`{"error": {"message", "type", "code"}}`, as the proxy answers), and
/// `Retry-After` when `retry_after_s` is given.
pub fn immediate(status: u16, message: &str, kind: &str, retry_after_s: Option<u64>) -> ProcessingResponse {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "code": status}}).to_string();
    let mut set_headers = vec![header("content-type", "application/json")];
    if let Some(s) = retry_after_s {
        set_headers.push(header("retry-after", &s.to_string()));
    }
    let headers = HeaderMutation { set_headers, remove_headers: vec![] };
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: i32::from(status) }),
            headers: Some(headers),
            body: body.into_bytes(),
            details: format!("kvmesh_epp_{kind}"),
            ..ImmediateResponse::default()
        })),
        ..ProcessingResponse::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    /// The (name, raw value) pairs a mutation sets.
    fn set_headers(m: Option<HeaderMutation>) -> Vec<(String, Vec<u8>)> {
        m.unwrap().set_headers.into_iter().map(|h| h.header.unwrap()).map(|h| (h.key, h.raw_value)).collect()
    }

    #[test]
    fn the_pick_names_one_endpoint_in_the_header_and_the_metadata() {
        let (common, metadata) =
            destination("x-gateway-destination-endpoint", "envoy.lb", "10.0.0.7:8000", None, Some(42));
        assert_eq!(
            set_headers(common.header_mutation.clone()),
            vec![
                ("x-gateway-destination-endpoint".to_string(), b"10.0.0.7:8000".to_vec()),
                ("content-length".to_string(), b"42".to_vec())
            ]
        );
        // One data-parallel rank of the engine behind the endpoint: its rank header too.
        let (ranked, _) = destination("x-gateway-destination-endpoint", "envoy.lb", "10.0.0.7:8000", Some(3), None);
        assert_eq!(
            set_headers(ranked.header_mutation),
            vec![
                ("x-gateway-destination-endpoint".to_string(), b"10.0.0.7:8000".to_vec()),
                ("x-data-parallel-rank".to_string(), b"3".to_vec())
            ]
        );
        assert!(common.clear_route_cache);
        let Some(Kind::StructValue(inner)) = &metadata.fields["envoy.lb"].kind else { panic!("{metadata:?}") };
        assert_eq!(inner.fields["x-gateway-destination-endpoint"], string("10.0.0.7:8000"));
    }

    #[test]
    fn a_subset_is_read_as_a_list_or_a_comma_separated_string() {
        let with = |v: Value| Metadata {
            filter_metadata: [(
                "envoy.lb.subset_hint".to_string(),
                Struct { fields: [(SUBSET_KEY.to_string(), v)].into_iter().collect() },
            )]
            .into_iter()
            .collect(),
            ..Metadata::default()
        };
        let list = Value {
            kind: Some(Kind::ListValue(ListValue { values: vec![string("10.0.0.1:8000"), string("10.0.0.2:8000")] })),
        };
        let want = vec!["10.0.0.1:8000".to_string(), "10.0.0.2:8000".to_string()];
        assert_eq!(subset(Some(&with(list)), "envoy.lb.subset_hint"), Some(want.clone()));
        assert_eq!(subset(Some(&with(string("10.0.0.1:8000, 10.0.0.2:8000"))), "envoy.lb.subset_hint"), Some(want));
        assert_eq!(subset(Some(&with(string(""))), "envoy.lb.subset_hint"), Some(vec![]), "sent empty: none eligible");
        assert_eq!(subset(Some(&with(string("a:1"))), "other"), None, "another namespace: no subset");
        assert_eq!(subset(None, "envoy.lb.subset_hint"), None);
    }

    #[test]
    fn body_modes_follow_envoys_enum() {
        let modes: Vec<BodyMode> = (0..6).map(BodyMode::from_envoy).collect();
        use BodyMode::*;
        assert_eq!(modes, [None, Streamed, Buffered, Buffered, FullDuplex, FullDuplex]);
    }

    #[test]
    fn an_immediate_answer_is_an_openai_error_with_its_status() {
        let r = immediate(429, "no replica is ready", "rate_limit_exceeded", Some(7));
        let Some(processing_response::Response::ImmediateResponse(i)) = r.response else { panic!() };
        assert_eq!(i.status.unwrap().code, 429);
        let want: Vec<(String, Vec<u8>)> =
            vec![("content-type".into(), b"application/json".to_vec()), ("retry-after".into(), b"7".to_vec())];
        assert_eq!(set_headers(i.headers), want);
        let body: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
        assert_eq!(body["error"]["message"], "no replica is ready");
        assert_eq!(body["error"]["code"], 429);
    }
}
