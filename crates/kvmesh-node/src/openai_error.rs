//! Error answers to clients in OpenAI's shape, `{"error": {"message", "type", "code"}}`: one
//! shape for the proxy, the disaggregated flow and the body budget in front of them.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// An OpenAI-shaped error answer of the type `status` implies.
pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    error_of_kind(status, message, None)
}

/// An OpenAI-shaped error answer; `kind` overrides the type the status implies (a
/// disaggregated request's `prefill_error` / `decode_error`).
pub(crate) fn error_of_kind(status: StatusCode, message: impl Into<String>, kind: Option<&'static str>) -> Response {
    let message = message.into();
    // OpenAI's error types: a 429 is `rate_limit_exceeded` to its clients. A 502 is the type
    // a stream that broke off mid-answer gets too (`upstream_error`).
    let kind = kind.unwrap_or(match status {
        StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE | StatusCode::METHOD_NOT_ALLOWED => {
            "invalid_request_error"
        }
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_exceeded",
        StatusCode::GATEWAY_TIMEOUT | StatusCode::REQUEST_TIMEOUT => "timeout",
        StatusCode::BAD_GATEWAY => "upstream_error",
        _ => "service_unavailable",
    });
    (status, Json(json!({"error": {"message": message, "type": kind, "code": status.as_u16()}}))).into_response()
}
