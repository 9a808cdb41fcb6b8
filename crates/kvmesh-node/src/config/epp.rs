//! `[epp]`: the Gateway API Inference Extension's endpoint picker (see [`crate::epp`]).

use super::ConfigError;
use serde::{Deserialize, Serialize};

/// `[epp]`: kvmesh as the endpoint picker (EPP) of a Gateway API Inference Extension
/// `InferencePool`. The node serves Envoy's `envoy.service.ext_proc.v3.ExternalProcessor` on
/// its gRPC port; the gateway sends each request's headers and body, kvmesh picks a replica
/// with its policy and answers with the replica's `<ip:port>` in a header and in dynamic
/// metadata (the protocol: gateway-api-inference-extension
/// `docs/proposals/004-endpoint-picker-protocol`, v1.0.0), then follows the response to
/// release the booking. The names below are that protocol's defaults; change them only to
/// match a gateway configured otherwise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EppSection {
    /// When kvmesh cannot pick — no replica ready, a body it cannot read, a request it would
    /// refuse (unknown model, a prompt over `node.max_prompt_tokens`) — `false` (fail
    /// closed) answers the client with that error at once (an `ImmediateResponse`: 503,
    /// 400, 404, 413); `true` (fail open) lets the request go on with no destination, for
    /// the gateway's own fallback load balancing to place. Answered in both modes: admission
    /// control's 429; an endpoint subset with no eligible replica, 503 (the protocol's
    /// rule); and the node's body limits (413 over `limits.http_max_body_bytes`, 503 when
    /// `limits.http_body_budget_bytes` is full, 408 after `limits.http_idle_timeout`).
    pub fail_open: bool,
    /// The request header that carries the picked endpoint to the gateway.
    pub destination_header: String,
    /// The dynamic-metadata namespace of the picked endpoint (its key is
    /// `destination_header`).
    pub metadata_namespace: String,
    /// The filter-metadata namespace a gateway may send an endpoint subset in (key
    /// `x-gateway-destination-endpoint-subset`, a list of `<ip:port>`); the pick is made
    /// among those replicas only.
    pub subset_namespace: String,
}

impl Default for EppSection {
    fn default() -> Self {
        EppSection {
            fail_open: false,
            destination_header: "x-gateway-destination-endpoint".into(),
            metadata_namespace: "envoy.lb".into(),
            subset_namespace: "envoy.lb.subset_hint".into(),
        }
    }
}

impl EppSection {
    /// Checks the names.
    ///
    /// # Errors
    /// A message naming the `epp.` key: an empty namespace, or a header that is not a
    /// lower-case HTTP header name (Envoy matches them lower-cased).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let h = &self.destination_header;
        let header_ok =
            !h.is_empty() && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if !header_ok {
            return Err(ConfigError::setting(
                "epp.destination_header",
                format!("must be a lower-case HTTP header name, got {h:?}"),
            ));
        }
        for (key, v) in [("metadata_namespace", &self.metadata_namespace), ("subset_namespace", &self.subset_namespace)]
        {
            if v.trim().is_empty() {
                return Err(ConfigError::setting(format!("epp.{key}"), "must not be empty"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_protocols_and_bad_names_are_refused() {
        let d = EppSection::default();
        assert_eq!(d.validate(), Ok(()));
        assert_eq!(
            (d.destination_header.as_str(), d.metadata_namespace.as_str(), d.subset_namespace.as_str()),
            ("x-gateway-destination-endpoint", "envoy.lb", "envoy.lb.subset_hint")
        );
        let upper = EppSection { destination_header: "X-Pick".into(), ..EppSection::default() };
        assert_eq!(
            upper.validate().unwrap_err().to_string(),
            "epp.destination_header must be a lower-case HTTP header name, got \"X-Pick\""
        );
        let empty = EppSection { metadata_namespace: " ".into(), ..EppSection::default() };
        assert_eq!(empty.validate().unwrap_err().to_string(), "epp.metadata_namespace must not be empty");
    }
}
