//! The files a configuration names, checked for being there before anything reads them: so a
//! wrong path is refused with the configuration's other refusals, at its line, instead of
//! alone and later ([`crate::preflight::check`] reads them for use).

use super::{ConfigError, NodeConfig};
use crate::auth::{from_working_directory, token_file, ADMIN_TOKEN_ENV, CLUSTER_TOKEN_ENV, EVENTS_TOKEN_ENV};
use std::path::Path;

impl NodeConfig {
    /// Each file the configuration names, and a starting node reads, that is not there (or is
    /// a directory), as a refusal of its key: the `[security]` token files (unless their
    /// environment variable is set, which the node reads instead: [`token_file`]), the
    /// TLS files (the CA with a certificate only: without one it is not read), and
    /// `node.tokenizer`. Relative paths are the working directory's, as the node reads them;
    /// the refusal says where one led. Whether a file that is there loads (an empty token, a
    /// certificate that does not parse) is [`crate::preflight::check`]'s.
    pub fn unreadable_files(&self) -> Vec<ConfigError> {
        let s = &self.security;
        let ca = s.tls_ca_file.as_deref().filter(|_| s.tls_cert_file.is_some());
        let named = [
            ("security.admin_token_file", token_file(ADMIN_TOKEN_ENV, &s.admin_token_file), ""),
            ("security.cluster_token_file", token_file(CLUSTER_TOKEN_ENV, &s.cluster_token_file), ""),
            ("security.events_token_file", token_file(EVENTS_TOKEN_ENV, &s.events_token_file), ""),
            ("security.tls_cert_file", s.tls_cert_file.as_deref(), ""),
            ("security.tls_key_file", s.tls_key_file.as_deref(), ""),
            ("security.tls_ca_file", ca, ""),
            ("node.tokenizer", self.node.tokenizer.as_deref(), " (without it, prompts are counted approximately)"),
        ];
        named
            .into_iter()
            .filter_map(|(key, path, without)| {
                let problem = unreadable(path?)?;
                Some(ConfigError::setting(key, format!("{problem}; fix the path, or remove the key{without}")))
            })
            .collect()
    }
}

/// Why `path` cannot be read as a file (`None`: it is there), worded to follow a key. A
/// regular file is opened (that finds missing permissions); anything else but a directory (a
/// pipe, `/dev/fd/N`) is left to the reader, as opening a FIFO would wait for its writer.
fn unreadable(path: &Path) -> Option<String> {
    let why = match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => "it is a directory".to_string(),
        Ok(m) if !m.is_file() => return None,
        Ok(_) => std::fs::File::open(path).err()?.to_string(),
        Err(e) => e.to_string(),
    };
    Some(format!("names {}{}, which cannot be read: {why}", path.display(), from_working_directory(path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_unreadable_file_is_refused_at_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("admin.token");
        std::fs::write(&token, "secret-secret-secret").unwrap();
        let text = format!(
            "[node]\ntokenizer = \"{0}/tokenizer.json\"\n\n[security]\nadmin_token_file = \"{1}\"\n\
             tls_cert_file = \"{0}\"\n",
            dir.path().display(),
            token.display()
        );
        let config = NodeConfig::parse(&text).unwrap();
        let refusals = config.unreadable_files();
        let d = dir.path().display();
        assert_eq!(
            refusals.iter().map(|e| (e.to_string(), e.line_in(&text))).collect::<Vec<_>>(),
            vec![
                (
                    format!(
                        "security.tls_cert_file names {d}, which cannot be read: it is a directory; fix the path, or \
                         remove the key"
                    ),
                    Some(6)
                ),
                (
                    format!(
                        "node.tokenizer names {d}/tokenizer.json, which cannot be read: No such file or directory (os \
                         error 2); fix the path, or remove the key (without it, prompts are counted approximately)"
                    ),
                    Some(2)
                ),
            ]
        );
        // A relative path says where it led; a CA file is checked only with a certificate.
        let config =
            NodeConfig::parse("[security]\ntls_key_file = \"no/such.pem\"\ntls_ca_file = \"no/ca.pem\"\n").unwrap();
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(
            config.unreadable_files().iter().map(ToString::to_string).collect::<Vec<_>>(),
            vec![format!(
                "security.tls_key_file names no/such.pem ({}, from the working directory), which cannot be read: No \
                 such file or directory (os error 2); fix the path, or remove the key",
                cwd.join("no/such.pem").display()
            )]
        );
        // Neither a regular file nor a directory (a character device here): left to the reader.
        let config = NodeConfig::parse("[security]\ntls_cert_file = \"/dev/null\"\n").unwrap();
        assert_eq!(config.unreadable_files(), vec![]);
    }
}
