//! `kvmesh loadtest --mode epp`: drives a node's endpoint picker (Envoy ext_proc) as a
//! gateway in full-duplex mode would, closed loop: per request one stream — request headers
//! (with `protocol_config`), the JSON body with end of stream, then, once the destination is
//! back, a streamed response (headers, one SSE chunk, `data: [DONE]`) so the node releases the
//! booking. The latency recorded is the pick's: first message sent to the destination
//! received. Every request has its own prompt (`prompt(i, …)`), so each is decided once.

use super::{prompt, Tally};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration,
};
use std::time::Instant;

/// Envoy's `BodySendMode::FULL_DUPLEX_STREAMED`.
const FULL_DUPLEX: i32 = 4;

fn headers(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
    let headers = pairs
        .iter()
        .map(|(k, v)| HeaderValue { key: k.to_string(), value: String::new(), raw_value: v.as_bytes().to_vec() })
        .collect();
    Some(HeaderMap { headers })
}

fn message(r: processing_request::Request, first: bool) -> ProcessingRequest {
    let protocol_config = first.then_some(ProtocolConfiguration {
        request_body_mode: FULL_DUPLEX,
        response_body_mode: FULL_DUPLEX,
        send_body_without_waiting_for_header_response: false,
    });
    ProcessingRequest { request: Some(r), protocol_config, ..Default::default() }
}

/// One request through the picker: the pick's latency, microseconds, or what went wrong.
async fn one(client: &mut ExternalProcessorClient<tonic::transport::Channel>, body: Vec<u8>) -> Result<u64, String> {
    let t = Instant::now();
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let request = processing_request::Request::RequestHeaders(HttpHeaders {
        headers: headers(&[(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json")]),
        end_of_stream: false,
        ..Default::default()
    });
    let send = |m| {
        let tx = tx.clone();
        async move { tx.send(m).await.map_err(|_| "stream closed".to_string()) }
    };
    send(message(request, true)).await?;
    send(message(
        processing_request::Request::RequestBody(HttpBody { body, end_of_stream: true, ..Default::default() }),
        false,
    ))
    .await?;
    let mut answers = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .map_err(|e| format!("{:?}", e.code()))?
        .into_inner();
    let mut next = async || match answers.message().await {
        Ok(Some(m)) => m.response.ok_or_else(|| "empty answer".to_string()),
        Ok(None) => Err("stream ended".to_string()),
        Err(e) => Err(format!("{:?}", e.code())),
    };
    let picked_us = match next().await? {
        // A destination header: picked. None: the node failed open (it could not pick).
        Answer::RequestHeaders(h) if h.response.as_ref().and_then(|c| c.header_mutation.as_ref()).is_some() => {
            t.elapsed().as_micros() as u64
        }
        Answer::RequestHeaders(_) => return Err("no destination (the picker failed open)".into()),
        Answer::ImmediateResponse(i) => return Err(format!("immediate {}", i.status.map_or(0, |s| s.code))),
        other => return Err(format!("unexpected {other:?}")),
    };
    // The body back, then the response as an engine would stream it.
    next().await?;
    let response = processing_request::Request::ResponseHeaders(HttpHeaders {
        headers: headers(&[(":status", "200"), ("content-type", "text/event-stream")]),
        end_of_stream: false,
        ..Default::default()
    });
    send(message(response, false)).await?;
    next().await?;
    let sse = b"data: {\"choices\":[{\"text\":\" t\"}]}\n\ndata: [DONE]\n\n".to_vec();
    let chunk =
        processing_request::Request::ResponseBody(HttpBody { body: sse, end_of_stream: true, ..Default::default() });
    send(message(chunk, false)).await?;
    next().await?;
    Ok(picked_us)
}

/// Closed loop with `--concurrency` workers (see `grpc_closed_loop`).
pub async fn run(args: &crate::cli::LoadtestArgs) -> anyhow::Result<(Tally, f64)> {
    let (prefixes, prefix_tokens, max_tokens) = (args.prefixes, args.prefix_tokens, args.max_tokens);
    super::grpc_closed_loop(args, move |channel, i| async move {
        let text = prompt(i, prefixes, "", prefix_tokens);
        let body = serde_json::json!({"prompt": text, "max_tokens": max_tokens, "stream": true});
        one(&mut ExternalProcessorClient::new(channel), body.to_string().into_bytes()).await
    })
    .await
}
