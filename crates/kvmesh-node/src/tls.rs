//! TLS (rustls, ring) for the node's two ports and its connections to other nodes, from the
//! PEM files named in `[security]`.
//!
//! - HTTP (OpenAI proxy, `/metrics`): a rustls acceptor in front of axum ([`TlsListener`]).
//! - gRPC: tonic's server TLS, with client certificates required when `tls_client_auth`.
//! - Node to node (Raft, gossip, forwarded writes): `https://` with `tls_ca_file` as the trust
//!   root, presenting this node's certificate (mTLS) when `tls_client_auth`.

use crate::auth::SecuritySection;
use anyhow::Context;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::sync::Arc;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// A node's TLS settings, loaded and checked.
#[derive(Clone)]
pub struct Tls {
    /// For the gRPC server.
    pub grpc: ServerTlsConfig,
    /// For the HTTP server.
    pub http: tokio_rustls::TlsAcceptor,
    /// For connections to other nodes.
    pub client: ClientTlsConfig,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls { .. }")
    }
}

fn read(path: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("[security] {what}: reading {}", path.display()))
}

impl Tls {
    /// TLS from `[security]`, or `None` without `tls_cert_file`.
    ///
    /// # Errors
    /// A certificate without its key (or the reverse), `tls_client_auth` without a CA, a file
    /// that cannot be read, or PEM that holds no certificate or key — naming the file.
    pub fn load(s: &SecuritySection) -> anyhow::Result<Option<Tls>> {
        let (cert_path, key_path) = match (&s.tls_cert_file, &s.tls_key_file) {
            (None, None) => {
                if s.tls_client_auth {
                    anyhow::bail!("[security] tls_client_auth needs tls_cert_file, tls_key_file and tls_ca_file");
                }
                return Ok(None);
            }
            (Some(c), Some(k)) => (c, k),
            _ => anyhow::bail!("[security] tls_cert_file and tls_key_file go together"),
        };
        if s.tls_client_auth && s.tls_ca_file.is_none() {
            anyhow::bail!("[security] tls_client_auth needs tls_ca_file (the CA that signs client certificates)");
        }
        let cert_pem = read(cert_path, "tls_cert_file")?;
        let key_pem = read(key_path, "tls_key_file")?;
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(&cert_pem)
                .collect::<Result<_, _>>()
                .map_err(|e| anyhow::anyhow!("[security] tls_cert_file {}: {e}", cert_path.display()))?;
        if certs.is_empty() {
            anyhow::bail!("[security] tls_cert_file {}: no PEM certificate in it", cert_path.display());
        }
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
            anyhow::anyhow!("[security] tls_key_file {}: no usable PEM private key: {e}", key_path.display())
        })?;
        let ca_pem = s.tls_ca_file.as_ref().map(|p| read(p, "tls_ca_file")).transpose()?;
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let http = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| anyhow::anyhow!("[security] tls_cert_file/tls_key_file do not make a TLS identity: {e}"))?;
        let mut http = http;
        http.alpn_protocols = vec![b"http/1.1".to_vec()];
        let identity = Identity::from_pem(&cert_pem, &key_pem);
        let mut grpc = ServerTlsConfig::new().identity(identity.clone());
        let mut client = ClientTlsConfig::new();
        if let Some(ca) = &ca_pem {
            let ca = Certificate::from_pem(ca);
            client = client.ca_certificate(ca.clone());
            if s.tls_client_auth {
                grpc = grpc.client_ca_root(ca);
                client = client.identity(identity);
            }
        }
        Ok(Some(Tls { grpc, http: tokio_rustls::TlsAcceptor::from(Arc::new(http)), client }))
    }
}

/// A TCP listener whose connections complete a TLS handshake before axum sees them.
/// Handshakes run concurrently (a slow or plain-text client delays nobody) and a failed one
/// drops that connection only. At most `max_pending` connections are accepted and not yet
/// handed out (handshaking or handshaken): beyond, new ones wait in the listen backlog.
pub struct TlsListener {
    addr: std::net::SocketAddr,
    ready: tokio::sync::mpsc::Receiver<(TlsStream, std::net::SocketAddr, tokio::sync::OwnedSemaphorePermit)>,
}

type TlsStream = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

impl TlsListener {
    /// Starts accepting on `tcp`; ends when the listener is dropped.
    ///
    /// # Errors
    /// The socket has no local address.
    pub fn new(
        tcp: tokio::net::TcpListener,
        acceptor: tokio_rustls::TlsAcceptor,
        max_pending: usize,
    ) -> std::io::Result<Self> {
        let addr = tcp.local_addr()?;
        let (tx, ready) = tokio::sync::mpsc::channel(64);
        let pending = std::sync::Arc::new(tokio::sync::Semaphore::new(max_pending.max(1)));
        tokio::spawn(async move {
            loop {
                let permit = tokio::select! {
                    p = pending.clone().acquire_owned() => p.expect("the semaphore is never closed"),
                    _ = tx.closed() => return,
                };
                let accepted = tokio::select! {
                    a = tcp.accept() => a,
                    // The listener was dropped (the server stopped): free the port.
                    _ = tx.closed() => return,
                };
                let (stream, peer) = match accepted {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "HTTPS accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let handshake = tokio::time::timeout(std::time::Duration::from_secs(10), acceptor.accept(stream));
                    match handshake.await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer, permit)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { addr, ready })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            // Handed out: the server's own connection cap counts it from here.
            Some((tls, peer, _permit)) => (tls, peer),
            // The accept task ends only with the listener; never resolve after that.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}
