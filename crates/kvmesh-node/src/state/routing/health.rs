//! A replica's status: health checks, backpressure, engine reports, and the routable flag.

use super::Core;
use super::StatusChange;
use crate::state::{HealthState, Replica};
use kvmesh_core::load::EngineMetrics;
use kvmesh_core::ReplicaStatus;

impl Core {
    /// The status operators see for `r` at `now`.
    pub fn status(&self, r: &Replica, now: f64) -> ReplicaStatus {
        if r.starting {
            return ReplicaStatus::Starting;
        }
        if r.draining() {
            return ReplicaStatus::Draining;
        }
        let (unhealthy, overloaded, engine_block_size) = {
            let h = r.health.lock();
            (
                h.failures >= self.unhealthy_after || h.hung.is_some() || self.hung_for(&h, now).is_some(),
                h.overloaded_until > now,
                h.engine_block_size,
            )
        };
        if unhealthy {
            return ReplicaStatus::Unhealthy;
        }
        if overloaded {
            return ReplicaStatus::Overloaded;
        }
        // Registered without `capacity_blocks`, its engine has not reported one yet: the
        // routing core takes no replica of unknown KV capacity.
        if self.capacity_unknown(r) {
            return ReplicaStatus::Starting;
        }
        // Time-based: a quarantine ends by itself even when nothing acts on its end (an
        // `Events.Publish` pusher that never comes back).
        let (bad_events_until, resyncing, socket_down_since) = {
            let s = r.stream.lock();
            (s.bad_events_until, s.resyncing, s.socket_down.as_ref().map(|d| d.0))
        };
        if bad_events_until.is_some_and(|u| now < u) {
            return ReplicaStatus::BadEvents;
        }
        // Its engine's metrics page says its block size before any KV event does.
        if engine_block_size.is_some_and(|b| b != self.fleet.replica_block_size(r.id)) {
            return ReplicaStatus::BlockSizeMismatch;
        }
        if let Some(health) = self.fleet.index().health(r.id) {
            if health.block_size_mismatch.is_some() {
                return ReplicaStatus::BlockSizeMismatch;
            }
            if health.out_of_sync || resyncing {
                return ReplicaStatus::OutOfSync;
            }
        }
        // An event owed for longer than `events_silent`: the stream is silent, however
        // sparse the traffic. So is one whose socket has not come up for as long (a wrong
        // endpoint, an engine without KV events): no event can arrive.
        let silent = |since: Option<f64>| since.is_some_and(|t| now - t > self.events_silent_s);
        if r.config.kv_events.is_some() && (silent(r.unpublished_since) || silent(socket_down_since)) {
            return ReplicaStatus::NoEvents;
        }
        ReplicaStatus::Ready
    }

    /// Whether `r` was registered without `capacity_blocks` and its engine has not reported
    /// its own yet ([`Core::learn_capacity`]).
    fn capacity_unknown(&self, r: &Replica) -> bool {
        self.fleet.replica_capacity_blocks(r.id) == 0
    }

    /// Why `r`, registered without `capacity_blocks`, has none yet: its engine's page not
    /// read yet, or read without the figure.
    fn capacity_detail(&self, r: &Replica) -> String {
        let (read, blocks) = {
            let h = r.health.lock();
            (h.engine.is_some(), h.engine_kv_blocks)
        };
        let url = r.config.metrics();
        match (read, blocks) {
            (true, None) => format!(
                "capacity_blocks is not configured and its engine's metrics page ({url}) does not report its KV \
                 capacity (no vllm:cache_config_info num_gpu_blocks: an SGLang engine never does): set \
                 capacity_blocks; not routed to until then"
            ),
            // (vLLM refuses to start without room for a KV block, so this is an engine that
            // misreports, an attention-free model, which an older vLLM reports with 0 blocks,
            // or not vLLM at all.)
            (true, Some(0)) => format!(
                "capacity_blocks is not configured and its engine's metrics page ({url}) reports \
                 num_gpu_blocks 0 (vllm:cache_config_info): no KV cache to route to; check the engine, or \
                 set capacity_blocks; not routed to until then"
            ),
            _ => format!(
                "waiting for its engine to report its KV capacity (num_gpu_blocks of vllm:cache_config_info at \
                 {url}): capacity_blocks is not configured; not routed to until then"
            ),
        }
    }

    /// Takes `blocks`, the KV capacity `name`'s engine reports (in this node's blocks), as its
    /// capacity when it was registered without one (the engine's figure may change when it
    /// restarts); returns the previous figure (0: none) when it changed. The replica's status
    /// follows at once.
    pub fn learn_capacity(&mut self, name: &str, blocks: u64, now: f64) -> Option<u64> {
        let r = self.replicas.get(name).filter(|r| r.config.capacity_blocks == 0)?;
        let id = r.id;
        let previous = self.fleet.replica_capacity_blocks(id);
        if !self.fleet.set_capacity_blocks(id, blocks).unwrap_or(false) {
            return None;
        }
        let _ = self.sync_routable(name, now);
        Some(previous)
    }

    /// How long a replica's engine (its health `h`) has served no token while this node had
    /// requests in flight on it, seconds, once that reaches `hung_after`: a hung engine
    /// whose metrics endpoint still answers (its served-token counter stands still).
    fn hung_for(&self, h: &HealthState, now: f64) -> Option<f64> {
        if !h.counts_every_step {
            return None;
        }
        let (_, still_since) = h.engine_served?;
        let hung = now - still_since.max(h.busy_since?);
        (self.hung_after_s > 0.0 && hung >= self.hung_after_s).then_some(hung)
    }

    /// What `r`'s `status` means at `now`, for operators (empty when the status says it all).
    pub fn status_detail(&self, r: &Replica, status: ReplicaStatus, now: f64) -> String {
        match status {
            ReplicaStatus::BlockSizeMismatch => {
                let ours = self.fleet.replica_block_size(r.id);
                match self.fleet.index().health(r.id).and_then(|h| h.block_size_mismatch) {
                    Some(b) => format!("events carry block size {b}, this node uses {ours}: routed on load only"),
                    None => r.health.lock().engine_block_size.map_or(String::new(), |b| {
                        format!(
                            "its engine reports block size {b} (vllm:cache_config_info), this node uses {ours}: \
                             routed on load only"
                        )
                    }),
                }
            }
            ReplicaStatus::Unhealthy => {
                let h = r.health.lock();
                if h.hung.is_some() || self.hung_for(&h, now).is_some() {
                    let still = h.engine_served.map_or(0.0, |(_, since)| now - since);
                    format!(
                        "hung: its engine served no token for {still:.0} s with requests in flight; routed \
                         around until it serves again (or tried again once idle for node.hung_after)"
                    )
                } else {
                    h.last_error.clone().unwrap_or_default()
                }
            }
            ReplicaStatus::Overloaded => "answered 429/503; backing off".into(),
            ReplicaStatus::BadEvents => r.stream.lock().bad_events_until.map_or(String::new(), |u| {
                format!(
                    "its KV events kept being refused: quarantined for {:.0} s more (blocks dropped, stream \
                     not followed; routed on load only), then rebuilt",
                    (u - now).max(0.0)
                )
            }),
            ReplicaStatus::NoEvents => match r.stream.lock().socket_down.clone() {
                Some((since, why)) => format!(
                    "its KV-event socket has not come up for {:.0} s: {why}; routed on load and the router's record",
                    (now - since).max(0.0)
                ),
                None => "serving, but no KV event arrives: routed on load and the router's record".into(),
            },
            ReplicaStatus::OutOfSync => {
                "KV events were missed: its blocks are being rebuilt (routed on load meanwhile)".into()
            }
            ReplicaStatus::Starting if !r.starting && self.capacity_unknown(r) => self.capacity_detail(r),
            ReplicaStatus::Starting => {
                let h = r.health.lock();
                match (&h.engine, &h.last_error) {
                    (Some(_), None) => "starting: the engine answers; not routed to until marked ready".into(),
                    (_, Some(e)) => format!("starting: the engine does not answer yet ({e})"),
                    (None, None) => "starting: no scrape of the engine yet".into(),
                }
            }
            ReplicaStatus::Draining => self.drain_progress(r, now).map_or(String::new(), |p| p.to_string()),
            ReplicaStatus::Ready | ReplicaStatus::Removed => String::new(),
        }
    }

    /// Brings the routing core's status of `name` in line with what this node sees, and queues a change
    /// of status to be logged once, after the lock ([`crate::state::CoreGuard`]); returns the change, (from,
    /// to), if there was one.
    pub fn sync_routable(&mut self, name: &str, now: f64) -> Option<(ReplicaStatus, ReplicaStatus)> {
        let r = self.replicas.get(name)?;
        let status = self.status(r, now);
        let id = r.id;
        let _ = self.fleet.set_status(id, status);
        let from = r.reported;
        if from == status {
            return None;
        }
        let detail = self.status_detail(r, status, now);
        self.status_changes.push(StatusChange { replica: name.to_string(), from, to: status, detail });
        if let Some(r) = self.replicas.get_mut(name) {
            r.reported = status;
        }
        Some((from, status))
    }

    /// Re-evaluates every replica (overload marks expire with time, case C18).
    pub fn sync_all(&mut self, now: f64) {
        // One pass by reference; only a replica whose status moved is synced by name. (The
        // sweep cloned every name and looked each up again, every 10 ms of routing: with the
        // statuses it computes, a few per cent of a node's CPU following 1,024 busy replicas.)
        let moved: Vec<String> = self
            .replicas
            .iter()
            .filter(|(_, r)| {
                let status = self.status(r, now);
                status != r.reported || self.fleet.replica(r.id).is_some_and(|f| f.status != status)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in moved {
            let _ = self.sync_routable(&name, now);
        }
    }

    /// A request that began at `began` (node seconds) finished on `name` having filled KV
    /// blocks its engine did not hold: the engine owes an event for them unless one came
    /// since it began (the no-events status counts from the oldest such request).
    pub fn served_new_blocks(&mut self, name: &str, began: f64) {
        if let Some(r) = self.replicas.get_mut(name) {
            if r.last_event_at.is_none_or(|e| e < began) {
                r.unpublished_since.get_or_insert(began);
            }
        }
    }

    /// Records a failed scrape or connect; returns the replica's status after it. A replica
    /// never scraped well yet is out at once, as after a connect failure: nothing says it is
    /// up (a wrong URL, an engine still loading), where a known engine gets `unhealthy_after`
    /// tries.
    pub fn record_failure(&mut self, name: &str, error: String, now: f64) -> Option<ReplicaStatus> {
        let threshold = self.unhealthy_after;
        {
            let mut h = self.replicas.get(name)?.health.lock();
            h.failures += 1;
            if h.engine.is_none() {
                h.failures = h.failures.max(threshold);
            }
            h.last_error = Some(error);
        }
        let _ = self.sync_routable(name, now);
        self.note_idle(name, now);
        self.replicas.get(name).map(|r| self.status(r, now))
    }

    /// A connect failure takes a replica out at once: a dead engine is routed around now, not
    /// after `unhealthy_after` scrapes.
    pub fn record_down(&mut self, name: &str, error: String, now: f64) {
        let threshold = self.unhealthy_after;
        if let Some(r) = self.replicas.get(name) {
            let mut h = r.health.lock();
            h.failures = h.failures.max(threshold);
            h.last_error = Some(error);
        }
        let _ = self.sync_routable(name, now);
    }

    /// The replicas out of rotation only for backpressure at `now` (status `overloaded`), and
    /// when the first of them is back, node seconds.
    pub fn backing_off(&self, now: f64) -> (usize, Option<f64>) {
        let ends = self
            .replicas
            .values()
            .filter(|r| self.status(r, now) == ReplicaStatus::Overloaded)
            .map(|r| r.health.lock().overloaded_until);
        ends.fold((0, None), |(n, first), until| (n + 1, Some(first.map_or(until, |f: f64| f.min(until)))))
    }

    /// Records a backpressure answer (429/503): out of rotation until `until`.
    pub fn record_overload(&mut self, name: &str, until: f64, now: f64) {
        if let Some(r) = self.replicas.get(name) {
            r.health.lock().overloaded_until = until;
        }
        let _ = self.sync_routable(name, now);
    }

    /// Records a good scrape, asked for at `asked_at` and answered by `now` (node seconds),
    /// with the engine's served-token counter when its page has one (tokens).
    pub fn record_metrics(&mut self, name: &str, metrics: EngineMetrics, served: Option<f64>, asked_at: f64, now: f64) {
        let threshold = self.unhealthy_after;
        let hung_after_s = self.hung_after_s;
        let Some(r) = self.replicas.get(name) else { return };
        let id = r.id;
        let recovered = {
            let mut h = r.health.lock();
            let recovered = h.failures >= threshold;
            h.failures = 0;
            h.last_error = None;
            h.engine = Some(metrics);
            h.engine_at = Some(asked_at);
            h.engine_served = match (served, h.engine_served) {
                (Some(v), Some((old, since))) if v == old => Some((old, since)),
                (Some(v), old) => {
                    // Served something (or restarted): not hung.
                    if old.is_some() {
                        h.hung = None;
                    }
                    Some((v, asked_at))
                }
                (None, _) => None,
            };
            h.busy_since = (r.proxied > 0).then(|| h.busy_since.unwrap_or(asked_at));
            if h.hung.is_none() && self.hung_for(&h, now).is_some() {
                h.hung = Some(None);
            }
            // Nothing of ours in flight on a hung engine for hung_after_s: try it again (if it
            // is still hung, the next requests find that out within hung_after_s).
            let proxied = r.proxied;
            if let Some(idle_since) = h.hung.as_mut() {
                if proxied > 0 {
                    *idle_since = None;
                } else if now - *idle_since.get_or_insert(asked_at) >= hung_after_s {
                    h.hung = None;
                }
            }
            recovered
        };
        if recovered {
            r.stream.lock().resync_requested = Some("recovery");
        }
        let _ = self.fleet.report_metrics(id, metrics);
        let _ = self.sync_routable(name, now);
        self.note_idle(name, now);
    }
}
