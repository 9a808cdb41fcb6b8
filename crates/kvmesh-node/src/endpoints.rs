//! A replica's OpenAI API URLs, parsed once when the replica is registered.
//!
//! Why: the proxy used to format and parse `<http><path>` for every request it forwarded;
//! parsing (with its IDNA host pass) was ~3 µs of the ~110 µs of CPU a proxied request costs
//! (BENCHMARKS.md, router node).

use reqwest::Url;

/// The OpenAI API the proxy forwards to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    ChatCompletions,
}

impl Api {
    /// The request path, as the engine serves it.
    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::ChatCompletions => "/v1/chat/completions",
        }
    }
}

/// The request header vLLM's OpenAI server reads to schedule a request on one data-parallel
/// rank (`X-data-parallel-rank`, vllm/entrypoints/openai: `_get_data_parallel_rank`; SGLang's
/// data-parallel controller reads the same name).
pub const DATA_PARALLEL_RANK_HEADER: &str = "x-data-parallel-rank";

/// A replica's base URL and the parsed URL of each [`Api`].
#[derive(Debug)]
pub struct Endpoints {
    /// The base URL without a trailing `/` (`http://host:port`), as given in the config.
    pub base: String,
    /// `host:port` of the base URL, the port explicit (80/443 when the URL has none): the
    /// `<ip:port>` an endpoint picker names the replica by (see [`crate::epp`]).
    pub authority: String,
    /// Whether the host is an IP address (what a gateway's endpoints are), not a name.
    pub host_is_ip: bool,
    /// The replica's data-parallel rank, when it is one rank of an engine serving several:
    /// requests to it carry [`DATA_PARALLEL_RANK_HEADER`].
    pub data_parallel_rank: Option<u32>,
    completions: Url,
    chat_completions: Url,
}

/// Why a URL does not parse (`url::ParseError`, named through reqwest, which re-exports `Url`).
pub type UrlError = <Url as std::str::FromStr>::Err;

/// A replica's `http` the node cannot use ([`Endpoints::parse`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointsError {
    /// Not a URL.
    #[error("{url:?}: {error}")]
    Unparsable {
        /// The URL as configured.
        url: String,
        /// Why it does not parse (the `url` crate's error, as reqwest's `Url` gives it).
        error: UrlError,
    },
    /// A URL, but not `http://` or `https://`, or without a host.
    #[error("{0:?} is not an http:// or https:// URL with a host")]
    NotHttp(String),
}

impl Endpoints {
    /// Parses `http` (`http://host:port`, optionally with a path prefix and a trailing `/`).
    ///
    /// # Errors
    /// [`EndpointsError`]: `http` is not an absolute `http://` or `https://` URL with a host.
    pub fn parse(http: &str) -> Result<Endpoints, EndpointsError> {
        let unparsable = |error| EndpointsError::Unparsable { url: http.to_string(), error };
        // The base alone first: `http://` plus a path would parse with the path as its host.
        let parsed = Url::parse(http).map_err(unparsable)?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
            return Err(EndpointsError::NotHttp(http.to_string()));
        }
        let base = http.trim_end_matches('/').to_string();
        let host = parsed.host_str().unwrap_or_default();
        let authority = format!("{host}:{}", parsed.port_or_known_default().unwrap_or(80));
        let url = |api: Api| Url::parse(&format!("{base}{}", api.path())).map_err(unparsable);
        Ok(Endpoints {
            completions: url(Api::Completions)?,
            chat_completions: url(Api::ChatCompletions)?,
            base,
            authority,
            host_is_ip: host.parse::<std::net::IpAddr>().is_ok() || host.starts_with('['),
            data_parallel_rank: None,
        })
    }

    /// These endpoints for data-parallel rank `rank` of the engine behind them.
    pub fn with_rank(mut self, rank: Option<u32>) -> Self {
        self.data_parallel_rank = rank;
        self
    }

    /// The header pinning a request to this replica's data-parallel rank, if it is one.
    pub fn rank_header(&self) -> Option<(&'static str, reqwest::header::HeaderValue)> {
        self.data_parallel_rank.map(|k| (DATA_PARALLEL_RANK_HEADER, reqwest::header::HeaderValue::from(k)))
    }

    /// The URL to send `api` requests to.
    pub fn url(&self, api: Api) -> &Url {
        match api {
            Api::Completions => &self.completions,
            Api::ChatCompletions => &self.chat_completions,
        }
    }
}

/// `tcp://host:port` → `host:port` (`*` → `0.0.0.0`).
///
/// # Errors
/// Another transport, or no port.
pub fn tcp_address(endpoint: &str) -> anyhow::Result<String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| anyhow::anyhow!("{endpoint:?}: only tcp://host:port endpoints are supported"))?;
    let rest = rest.strip_prefix("*:").map_or_else(|| rest.to_string(), |port| format!("0.0.0.0:{port}"));
    if rest.rsplit_once(':').is_none_or(|(_, p)| p.parse::<u16>().is_err()) {
        anyhow::bail!("{endpoint:?} has no port (tcp://host:port)");
    }
    Ok(rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(tcp_address("tcp://vllm-0.vllm:5557").unwrap(), "vllm-0.vllm:5557");
        assert_eq!(tcp_address("tcp://*:5557").unwrap(), "0.0.0.0:5557");
        assert!(tcp_address("ipc:///tmp/x").is_err());
        assert!(tcp_address("tcp://host").is_err());
    }

    #[test]
    fn urls_join_the_base_and_the_path_whatever_the_trailing_slash() {
        for http in ["http://10.0.0.7:8000", "http://10.0.0.7:8000/"] {
            let e = Endpoints::parse(http).unwrap();
            assert_eq!(e.base, "http://10.0.0.7:8000");
            assert_eq!(e.url(Api::Completions).as_str(), "http://10.0.0.7:8000/v1/completions");
            assert_eq!(e.url(Api::ChatCompletions).as_str(), "http://10.0.0.7:8000/v1/chat/completions");
        }
        let prefixed = Endpoints::parse("https://gw.example/pool-a/").unwrap();
        assert_eq!(prefixed.url(Api::ChatCompletions).as_str(), "https://gw.example/pool-a/v1/chat/completions");
        // The endpoint picker's `<ip:port>`: the port made explicit, IPv6 in brackets.
        assert_eq!(prefixed.authority, "gw.example:443");
        assert!(!prefixed.host_is_ip);
        assert!(Endpoints::parse("http://[fd00::7]:8000").unwrap().host_is_ip);
        assert_eq!(Endpoints::parse("http://10.0.0.7:8000/").unwrap().authority, "10.0.0.7:8000");
        assert_eq!(Endpoints::parse("http://[fd00::7]:8000").unwrap().authority, "[fd00::7]:8000");
    }

    #[test]
    fn a_url_without_a_host_or_of_another_scheme_is_refused() {
        assert_eq!(Endpoints::parse("http://").unwrap_err().to_string(), "\"http://\": empty host");
        assert_eq!(
            Endpoints::parse("http://").unwrap_err(),
            EndpointsError::Unparsable { url: "http://".into(), error: UrlError::EmptyHost }
        );
        assert_eq!(Endpoints::parse("ftp://h:21").unwrap_err(), EndpointsError::NotHttp("ftp://h:21".into()));
        assert!(Endpoints::parse("h:8000").unwrap_err().to_string().contains("not an http:// or https:// URL"));
        assert_eq!(
            Endpoints::parse("localhost:8000").unwrap_err().to_string(),
            "\"localhost:8000\" is not an http:// or https:// URL with a host"
        );
    }
}
