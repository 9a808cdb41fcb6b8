//! Fault injection: what a misbehaving engine does, switchable at runtime.

use serde::{Deserialize, Serialize};
use std::sync::Mutex;

/// The faults in force. Every field's default is "behave".
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Publish no KV events at all (a silent publisher, case C09); they still enter the replay
    /// buffer, so a replay recovers them.
    pub drop_events: bool,
    /// Skip publishing every n-th message (0: none), leaving sequence gaps (case C07).
    pub drop_every: u64,
    /// Delay each KV-event message by this many milliseconds.
    pub delay_events_ms: u64,
    /// Restart the sequence at 0 (once), as an engine restart does (case C08).
    pub restart_seq: bool,
    /// Answer every inference request with this HTTP status (400, 429, 503 …) and a JSON error.
    pub status: Option<u16>,
    /// Accept inference requests and never answer.
    pub hang: bool,
    /// Die: close every socket and stop (the binary exits), as a crashed engine does.
    pub die: bool,
    /// A hostile publisher: every 500 ms, besides the real messages, publish a 4 MiB batch of
    /// nils (`[ts, [nil × 4,194,280], nil]`, numbered like the others, never in the replay
    /// buffer): the message that once stalled every node following a replica.
    pub hostile_events: bool,
}

/// Shared fault switches.
#[derive(Debug)]
pub struct FaultState {
    faults: Mutex<Faults>,
}

impl FaultState {
    /// Starts with `faults`.
    pub fn new(faults: Faults) -> Self {
        FaultState { faults: Mutex::new(faults) }
    }

    /// The faults in force.
    pub fn get(&self) -> Faults {
        self.faults.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the faults in force.
    pub fn set(&self, faults: Faults) {
        *self.faults.lock().unwrap_or_else(|p| p.into_inner()) = faults;
    }

    /// Takes the one-shot `restart_seq` switch.
    pub fn take_restart(&self) -> bool {
        let mut f = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut f.restart_seq)
    }
}
