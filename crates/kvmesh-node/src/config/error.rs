//! Why a node configuration is refused.

/// A refused configuration: what `kvmesh node` and `kvmesh node --check` print, and what the
/// admin API returns as `INVALID_ARGUMENT`. Each variant names what is at fault, so a caller
/// can point at it (the key, the replica) without reading the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The text is not TOML for this schema: toml's message (with line and column) and, for a
    /// common mistake, a `hint:` line saying what to write instead (empty when there is none).
    #[error("{message}{hint}")]
    Syntax {
        /// toml's message.
        message: String,
        /// `"\nhint: …"`, or empty.
        hint: String,
    },
    /// One setting's value is refused.
    #[error("{key} {problem}")]
    Setting {
        /// Its dotted name as in the file: `node.block_size`, `autoscaler.cooldown`.
        key: String,
        /// What is wrong, worded to follow the key: `must be positive`.
        problem: String,
    },
    /// One replica (a `[[replicas]]` entry, or one registered through the API) is refused.
    #[error("replica {replica:?}: {problem}")]
    Replica {
        /// Its `name`.
        replica: String,
        /// What is wrong, naming the field.
        problem: String,
    },
    /// Settings or replicas that pass one by one contradict each other.
    #[error("{0}")]
    Conflict(String),
}

/// A replica's refusal for a name an earlier `[[replicas]]` entry has; its line is the
/// repeat's ([`ConfigError::line_in`]).
pub(super) const REPEATED_NAME: &str = "the name appears twice";

impl ConfigError {
    /// A refused setting.
    pub fn setting(key: impl Into<String>, problem: impl Into<String>) -> Self {
        Self::Setting { key: key.into(), problem: problem.into() }
    }

    /// A refused replica.
    pub fn replica(replica: impl Into<String>, problem: impl Into<String>) -> Self {
        Self::Replica { replica: replica.into(), problem: problem.into() }
    }

    /// The line (1-based) of `text`, the configuration file, that this refusal is about: the
    /// refused key's, or the refused replica's `name`; `None` for a conflict, a syntax error
    /// (its message has the line already) or a refused default.
    pub fn line_in(&self, text: &str) -> Option<usize> {
        match self {
            Self::Setting { key, .. } => super::locate::line_of_key(text, key),
            // A repeated name: the repeat's line, not the first entry's.
            Self::Replica { replica, problem } if problem == REPEATED_NAME => {
                super::locate::line_of_name(text, replica, 2)
            }
            // The problem names the field first: `capacity_blocks is required for …`.
            Self::Replica { replica, problem } => {
                let field = problem.split([' ', ':']).next().unwrap_or("");
                super::locate::line_of_replica(text, replica, field)
            }
            Self::Syntax { .. } | Self::Conflict(_) => None,
        }
    }

    /// `path:line: message`, the line found in `text` (the file's contents) when given and
    /// [`Self::line_in`] finds it; `path: message` otherwise.
    pub fn located_in(&self, path: &std::path::Path, text: Option<&str>) -> String {
        match text.and_then(|t| self.line_in(t)) {
            Some(l) => format!("{}:{l}: {self}", path.display()),
            None => format!("{}: {self}", path.display()),
        }
    }

    /// A core config's refusal (`InvalidConfig { field, reason }`) as the key of `section`.
    pub(crate) fn from_core(section: &str, e: kvmesh_core::Error) -> Self {
        match e {
            kvmesh_core::Error::InvalidConfig { field, reason } => Self::setting(format!("{section}.{field}"), reason),
            other => Self::Conflict(format!("{section}: {other}")),
        }
    }
}
