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
    /// Restart the sequence at 0 (once), its replay buffer emptied, the prefix cache kept:
    /// the event stream restarts as an engine restart's does (case C08), and every block it
    /// held is still held.
    pub restart_seq: bool,
    /// Restart the engine (once), as a crashed and restarted vLLM comes back: its prefix cache
    /// emptied, its requests in flight cut, its counters from 0, its sequence from 0 and its
    /// replay buffer emptied — and, idle, it publishes nothing (only its metrics tell).
    pub restart_engine: bool,
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
    /// Engine restarts so far ([`Faults::restart_engine`]): the engine loop starts afresh when
    /// it moves, and tells its publisher.
    restarts: tokio::sync::watch::Sender<u64>,
}

impl FaultState {
    /// Starts with `faults`.
    pub fn new(faults: Faults) -> Self {
        let state = FaultState { faults: Mutex::new(Faults::default()), restarts: tokio::sync::watch::Sender::new(0) };
        state.set(faults);
        state
    }

    /// Engine restarts, as they happen.
    pub fn restarts(&self) -> tokio::sync::watch::Receiver<u64> {
        self.restarts.subscribe()
    }

    /// The faults in force.
    pub fn get(&self) -> Faults {
        self.faults.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the faults in force; `restart_engine` restarts the engine now (and is not
    /// kept).
    pub fn set(&self, mut faults: Faults) {
        if std::mem::take(&mut faults.restart_engine) {
            self.restarts.send_modify(|n| *n += 1);
        }
        *self.faults.lock().unwrap_or_else(|p| p.into_inner()) = faults;
    }

    /// Takes the one-shot `restart_seq` switch.
    pub fn take_restart(&self) -> bool {
        let mut f = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut f.restart_seq)
    }
}
