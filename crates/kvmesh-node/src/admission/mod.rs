//! Admission control while capacity is short (`[admission]`): instead of piling requests onto
//! replicas until they preempt, a request that finds no replica with room — none with KV
//! headroom for it, or every one at `max_num_seqs` — waits in a bounded queue and is routed
//! when capacity frees, smallest token load first; beyond the bound, or after `max_wait`,
//! it gets 429 with `Retry-After`.
//!
//! With `ttft_slo` set, a request also waits when the best replica would make it miss its
//! TTFT SLO while more than half the SLO is queued there (`kvmesh_core::admission::TtftGate`);
//! requests that have waited less than half the SLO are woken before late ones (those that
//! have waited longer), and a full queue refuses its largest late request rather than a new
//! one.
//!
//! "Capacity frees" is every booking that ends on this node, and a 250 ms re-check besides
//! (bookings of peer nodes end there, and their release reaches this node by gossip).
//!
//! Both paths that route go through it ([`crate::admit::Ticket`]): the OpenAI proxy (refusal: 429 with
//! `Retry-After`) and gRPC `Router.Route` (refusal: `RESOURCE_EXHAUSTED` with a `retry-after`
//! metadata entry).

use crate::config::AdmissionSection;
use kvmesh_core::admission::TtftGate;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Refused {
    /// The queue is full.
    QueueFull,
    /// With the TTFT gate: it was the largest late request in a full queue, refused to make
    /// room for a new one.
    Evicted,
    /// It waited `max_wait`.
    Timeout,
}

impl Refused {
    /// Every kind, in the order of [`Admission::refused_total`].
    const ALL: [Refused; 3] = [Refused::QueueFull, Refused::Evicted, Refused::Timeout];

    /// Its place in [`Refused::ALL`].
    fn index(self) -> usize {
        match self {
            Refused::QueueFull => 0,
            Refused::Evicted => 1,
            Refused::Timeout => 2,
        }
    }

    /// The `outcome` label of `kvmesh_admission_refused_total` (and, proxied, of
    /// `kvmesh_requests_total`).
    pub fn outcome(self) -> &'static str {
        match self {
            Refused::QueueFull => "queue_full",
            Refused::Evicted => "evicted_late",
            Refused::Timeout => "admission_timeout",
        }
    }

    /// Why, for the client's error message.
    pub fn reason(self) -> &'static str {
        match self {
            Refused::QueueFull => "the admission queue is full",
            Refused::Evicted => "the admission queue is full and this request had waited past half its TTFT SLO",
            Refused::Timeout => "the request waited admission.max_wait",
        }
    }
}

/// What a waiter is told.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Wake {
    /// Capacity may have freed: route again.
    Retry,
    /// Refused to make room in a full queue.
    Evicted,
}

/// One waiting request.
struct Waiter {
    /// Its token load, tokens.
    load: u64,
    /// When it arrived at the node (the TTFT clock starts there).
    arrived: Instant,
    /// Order of entering the queue, for ties of load and arrival (a request re-enters after
    /// each re-check; its arrival keeps its place).
    seq: u64,
    /// The model it asked for: a booking of another model's replica ending frees nothing
    /// it could use.
    model: kvmesh_core::ModelKey,
    tx: oneshot::Sender<Wake>,
}

/// Refusals since the last warning.
#[derive(Default)]
struct Refusals {
    /// How many.
    pending: u64,
    /// The latest one's kind.
    last: Option<Refused>,
    /// When the last warning was logged.
    warned: Option<Instant>,
}

/// The queue.
pub struct Admission {
    /// The settings.
    pub section: AdmissionSection,
    gate: Option<TtftGate>,
    waiting: Mutex<Vec<Waiter>>,
    seq: AtomicU64,
    /// How long a waiter waits for a wake-up before routing again.
    recheck: Duration,
    /// Refusals not yet logged: refusals are logged at most every 10 s.
    refusals: Mutex<Refusals>,
    /// Refusals since the start, by [`Refused::index`].
    refused_total: [AtomicU64; Refused::ALL.len()],
}

impl Admission {
    /// A queue for `section` (validated: an invalid `ttft_slo` leaves the gate off).
    pub fn new(section: AdmissionSection) -> Self {
        let gate = section.ttft_slo.and_then(|s| TtftGate::new(s.as_secs_f64()).ok());
        let recheck = Duration::from_millis(250);
        Admission {
            section,
            gate,
            waiting: Mutex::new(Vec::new()),
            seq: AtomicU64::new(0),
            recheck,
            refusals: Mutex::new(Refusals::default()),
            refused_total: Default::default(),
        }
    }

    /// The TTFT gate, when `ttft_slo` is set.
    pub fn gate(&self) -> Option<&TtftGate> {
        self.gate.as_ref()
    }

    /// Requests waiting now (not those that stopped waiting and are not yet swept out).
    pub fn depth(&self) -> usize {
        self.lock().iter().filter(|w| !w.tx.is_closed()).count()
    }

    /// The token load of the requests waiting now, tokens.
    pub fn waiting_load(&self) -> u64 {
        self.lock().iter().filter(|w| !w.tx.is_closed()).map(|w| w.load).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Waiter>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a request that arrived at `arrived` is late at `now` (never without the gate).
    fn late(&self, arrived: Instant, now: Instant) -> bool {
        self.gate.is_some_and(|g| g.late(now.saturating_duration_since(arrived).as_secs_f64()))
    }

    /// Waits until capacity may have freed (a booking ended, or 250 ms passed), as one of at
    /// most `queue_limit` waiters. `load` (tokens) and `arrived` (when the request reached the
    /// node) order who is woken first: requests that are not late, then the smallest load.
    /// `deadline` is when the request's wait ends.
    ///
    /// # Errors
    /// [`Refused::QueueFull`] at once when the queue is full — with the TTFT gate, unless this
    /// request is not late and a late one can be refused instead; [`Refused::Evicted`] later
    /// when this request is the one refused to make room; [`Refused::Timeout`] past
    /// `deadline`.
    pub async fn wait(&self, load: u64, arrived: Instant, deadline: Instant) -> Result<(), Refused> {
        self.wait_as(load, kvmesh_core::ModelKey::ANY, arrived, deadline).await
    }

    /// [`Admission::wait`] for a request of `model`: woken by bookings of that model's
    /// replicas ending ([`Admission::capacity_freed_for`]).
    ///
    /// # Errors
    /// As [`Admission::wait`].
    pub async fn wait_as(
        &self,
        load: u64,
        model: kvmesh_core::ModelKey,
        arrived: Instant,
        deadline: Instant,
    ) -> Result<(), Refused> {
        let now = Instant::now();
        if now >= deadline {
            return Err(Refused::Timeout);
        }
        let (tx, rx) = oneshot::channel();
        {
            let mut w = self.lock();
            // Waiters whose request went away (woken or timed out) do not count.
            w.retain(|x| !x.tx.is_closed());
            if w.len() >= self.section.queue_limit {
                let worst = (0..w.len())
                    .filter(|&k| self.late(w[k].arrived, now))
                    .max_by_key(|&k| (w[k].load, w[k].arrived, w[k].seq));
                let Some(k) = worst.filter(|_| !self.late(arrived, now)) else { return Err(Refused::QueueFull) };
                let _ = w.swap_remove(k).tx.send(Wake::Evicted);
            }
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            w.push(Waiter { load, arrived, seq, model, tx });
        }
        let recheck = now + self.recheck;
        match tokio::time::timeout_at(recheck.min(deadline), rx).await {
            Ok(Ok(Wake::Evicted)) => Err(Refused::Evicted),
            _ => Ok(()),
        }
    }

    /// A booking ended: the first waiter in order (not late, then smallest load, then
    /// earliest) tries again.
    pub fn capacity_freed(&self) {
        self.capacity_freed_for(None);
    }

    /// A booking on a replica of `model` ended (`None`: of a model not known): the first
    /// waiter in order among those that could use that replica tries again.
    pub fn capacity_freed_for(&self, model: Option<kvmesh_core::ModelKey>) {
        let now = Instant::now();
        let mut w = self.lock();
        let fits = |x: &Waiter| model.is_none_or(|m| x.model == m || x.model == kvmesh_core::ModelKey::ANY);
        while let Some(k) = (0..w.len())
            .filter(|&k| fits(&w[k]))
            .min_by_key(|&k| (self.late(w[k].arrived, now), w[k].load, w[k].arrived, w[k].seq))
        {
            if w.swap_remove(k).tx.send(Wake::Retry).is_ok() {
                return;
            }
        }
    }

    /// Counts a refusal, and logs a warning with the count at most every 10 s (a full queue
    /// refuses requests by the thousand; [`Admission::flush_refusals`] logs the rest).
    pub fn refused(&self, why: Refused) {
        self.refused_at(why, Instant::now());
    }

    fn refused_at(&self, why: Refused, now: Instant) {
        self.refused_total[why.index()].fetch_add(1, Ordering::Relaxed);
        let mut r = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        r.pending += 1;
        r.last = Some(why);
        self.warn_refusals(&mut r, now);
    }

    /// Logs refusals not yet logged once 10 s have passed since the last warning (called
    /// every second: the end of a burst of refusals is logged too, without a next refusal).
    pub fn flush_refusals(&self) {
        self.flush_refusals_at(Instant::now());
    }

    fn flush_refusals_at(&self, now: Instant) {
        let mut r = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        self.warn_refusals(&mut r, now);
    }

    /// Logs a warning if one is due: refusals not yet logged, and none logged in 10 s.
    fn warn_refusals(&self, r: &mut Refusals, now: Instant) {
        let due = r.warned.is_none_or(|at| now - at >= Duration::from_secs(10));
        if let (true, Some(last)) = (due && r.pending > 0, r.last) {
            tracing::warn!(
                refused = r.pending,
                last = last.outcome(),
                queue_depth = self.depth(),
                queue_limit = self.section.queue_limit,
                "admission control refused requests (HTTP 429, gRPC RESOURCE_EXHAUSTED) since the last warning: \
                 capacity is short"
            );
            r.pending = 0;
            r.warned = Some(now);
        }
    }

    /// Requests refused since the start: (queue full, evicted as late, timed out).
    pub fn refused_total(&self) -> (u64, u64, u64) {
        let [q, e, t] = Refused::ALL.map(|why| self.refused_total[why.index()].load(Ordering::Relaxed));
        (q, e, t)
    }

    /// Seconds a refused client should wait before retrying: how long the pool takes to
    /// serve the backlog ahead of it, `backlog_tokens` (tokens) at `pool_tokens_per_s` (the
    /// routable replicas' capacity, tokens per second), rounded up and between 1 and
    /// `max_wait` (rounded up); `max_wait` when the pool has no capacity (no routable
    /// replica). An estimate: requests arriving meanwhile compete for the same capacity.
    pub fn retry_after_s(&self, backlog_tokens: u64, pool_tokens_per_s: f64) -> u64 {
        let most = self.section.max_wait.as_secs_f64().ceil().max(1.0);
        let s = if pool_tokens_per_s > 0.0 { backlog_tokens as f64 / pool_tokens_per_s } else { most };
        s.ceil().clamp(1.0, most) as u64
    }

    /// What a refused client is told, on either path: seconds to wait before retrying
    /// ([`Admission::retry_after_s`] for `backlog_tokens` at `pool_tokens_per_s`) and the
    /// message saying why.
    pub fn refusal(&self, why: Refused, backlog_tokens: u64, pool_tokens_per_s: f64) -> (u64, String) {
        let after = self.retry_after_s(backlog_tokens, pool_tokens_per_s);
        (after, format!("capacity is short ({}); retry after {after} s", why.reason()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::task::JoinHandle;

    /// A queue whose waiters re-check only after a minute: in these tests only
    /// `capacity_freed` and refusals end a wait.
    fn queue(queue_limit: usize, ttft_slo_s: Option<f64>) -> Arc<Admission> {
        let section = AdmissionSection {
            enabled: true,
            queue_limit,
            max_wait: std::time::Duration::from_secs(300),
            ttft_slo: ttft_slo_s.map(std::time::Duration::from_secs_f64),
        };
        Arc::new(Admission { recheck: Duration::from_secs(60), ..Admission::new(section) })
    }

    /// A request of `load` tokens that reached the node `ago_s` seconds ago starts waiting.
    async fn waiter(q: &Arc<Admission>, load: u64, ago_s: f64) -> JoinHandle<Result<(), Refused>> {
        let now = Instant::now();
        let arrived = now.checked_sub(Duration::from_secs_f64(ago_s)).unwrap();
        let queued = q.seq.load(Ordering::Relaxed);
        let q2 = q.clone();
        let h = tokio::spawn(async move { q2.wait(load, arrived, now + Duration::from_secs(30)).await });
        while q.seq.load(Ordering::Relaxed) == queued && !h.is_finished() {
            tokio::task::yield_now().await;
        }
        h
    }

    /// Wakes one waiter and returns which of `hs` finished, by index.
    async fn wake_one(q: &Admission, hs: &[&JoinHandle<Result<(), Refused>>]) -> Vec<usize> {
        q.capacity_freed();
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        (0..hs.len()).filter(|&i| hs[i].is_finished()).collect()
    }

    #[tokio::test]
    async fn a_freed_replica_wakes_a_waiter_of_its_model() {
        use kvmesh_core::ModelKey;
        let q = queue(8, None);
        let now = Instant::now();
        let deadline = now + Duration::from_secs(30);
        let (m1, m2) = (ModelKey::of("m1"), ModelKey::of("m2"));
        let start = |model| {
            let q2 = q.clone();
            tokio::spawn(async move { q2.wait_as(100, model, now, deadline).await })
        };
        // The m1 request is first in order (smaller load), yet only an m2 replica freed.
        let first = start(m1);
        let second = {
            let q2 = q.clone();
            tokio::spawn(async move { q2.wait_as(900, m2, now, deadline).await })
        };
        while q.depth() < 2 {
            tokio::task::yield_now().await;
        }
        q.capacity_freed_for(Some(m2));
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        assert_eq!((first.is_finished(), second.is_finished()), (false, true));
        // A release of a model nobody waits for wakes nobody; one of an unknown model, anyone.
        q.capacity_freed_for(Some(ModelKey::of("m3")));
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        assert!(!first.is_finished());
        q.capacity_freed_for(None);
        assert_eq!(first.await.unwrap(), Ok(()));
    }

    #[tokio::test]
    async fn requests_not_yet_late_are_woken_first_smallest_load_first() {
        let q = queue(8, Some(2.0));
        let late = waiter(&q, 100, 1.5).await;
        let big = waiter(&q, 500, 0.0).await;
        let small = waiter(&q, 200, 0.0).await;
        assert_eq!(q.depth(), 3);
        assert_eq!(q.waiting_load(), 800);
        let hs = [&late, &big, &small];
        assert_eq!(wake_one(&q, &hs).await, [2]);
        assert_eq!(wake_one(&q, &hs).await, [1, 2]);
        assert_eq!(wake_one(&q, &hs).await, [0, 1, 2]);
        for h in [late, big, small] {
            assert_eq!(h.await.unwrap(), Ok(()));
        }
    }

    #[tokio::test]
    async fn without_the_gate_the_smallest_load_goes_first_however_long_it_waited() {
        let q = queue(8, None);
        let old = waiter(&q, 300, 5.0).await;
        let new = waiter(&q, 100, 0.0).await;
        assert_eq!(wake_one(&q, &[&old, &new]).await, [1]);
        assert_eq!(wake_one(&q, &[&old, &new]).await, [0, 1]);
    }

    #[tokio::test]
    async fn equal_loads_go_in_arrival_order_whenever_they_entered_the_queue() {
        let q = queue(8, None);
        // The later arrival entered first (the earlier one was re-checking, say).
        let later = waiter(&q, 100, 0.5).await;
        let earlier = waiter(&q, 100, 1.0).await;
        assert_eq!(wake_one(&q, &[&later, &earlier]).await, [1]);
        assert_eq!(wake_one(&q, &[&later, &earlier]).await, [0, 1]);
    }

    #[tokio::test]
    async fn a_full_queue_refuses_its_largest_late_request_for_a_new_one() {
        let q = queue(2, Some(2.0));
        let late_small = waiter(&q, 100, 1.5).await;
        let late_big = waiter(&q, 300, 1.2).await;
        // A new request takes the largest late one's place; that one gets 429.
        let fresh = waiter(&q, 900, 0.0).await;
        assert_eq!(late_big.await.unwrap(), Err(Refused::Evicted));
        assert_eq!(q.depth(), 2);
        // A late request does not push out another late one.
        let late_again = waiter(&q, 50, 1.9).await;
        assert_eq!(late_again.await.unwrap(), Err(Refused::QueueFull));
        assert_eq!(wake_one(&q, &[&late_small, &fresh]).await, [1]);
        // Without the gate a full queue refuses the newcomer.
        let q = queue(1, None);
        let _first = waiter(&q, 300, 5.0).await;
        let second = waiter(&q, 100, 0.0).await;
        assert_eq!(second.await.unwrap(), Err(Refused::QueueFull));
    }

    #[test]
    fn refusals_are_counted_by_why() {
        let q = Admission::new(AdmissionSection { enabled: true, ..AdmissionSection::default() });
        for (why, n) in [(Refused::QueueFull, 1), (Refused::Evicted, 2), (Refused::Timeout, 3)] {
            for _ in 0..n {
                q.refused(why);
            }
        }
        assert_eq!(q.refused_total(), (1, 2, 3));
    }

    #[test]
    fn refusals_are_logged_at_most_every_10_s_and_the_last_ones_without_a_next_refusal() {
        let q = Admission::new(AdmissionSection { enabled: true, ..AdmissionSection::default() });
        let pending = || q.refusals.lock().unwrap().pending;
        let t0 = Instant::now();
        q.refused_at(Refused::QueueFull, t0);
        assert_eq!(pending(), 0, "the first is logged at once");
        q.refused_at(Refused::QueueFull, t0 + Duration::from_secs(3));
        q.refused_at(Refused::Timeout, t0 + Duration::from_secs(4));
        q.flush_refusals_at(t0 + Duration::from_secs(9));
        assert_eq!(pending(), 2, "held back until 10 s after the last warning");
        q.flush_refusals_at(t0 + Duration::from_secs(10));
        assert_eq!(pending(), 0, "logged with no refusal after them");
        q.flush_refusals_at(t0 + Duration::from_secs(30));
        assert_eq!(q.refusals.lock().unwrap().warned, Some(t0 + Duration::from_secs(10)), "nothing new: no warning");
    }

    #[test]
    fn retry_after_is_the_time_to_serve_the_backlog_within_1_s_and_max_wait_s() {
        let q = Admission::new(AdmissionSection {
            enabled: true,
            max_wait: std::time::Duration::from_millis(29_500),
            ..AdmissionSection::default()
        });
        // 100,000 tokens at 2 replicas × 15,000 tokens/s: 3.33 s, rounded up.
        assert_eq!(q.retry_after_s(100_000, 30_000.0), 4);
        assert_eq!(q.retry_after_s(60_000, 30_000.0), 2);
        assert_eq!(q.retry_after_s(0, 30_000.0), 1);
        assert_eq!(q.retry_after_s(10_000_000, 30_000.0), 30);
        // No routable replica: the longest a request would wait.
        assert_eq!(q.retry_after_s(1_000, 0.0), 30);
        let (after, message) = q.refusal(Refused::QueueFull, 100_000, 30_000.0);
        assert_eq!((after, message.as_str()), (4, "capacity is short (the admission queue is full); retry after 4 s"));
    }

    // Paused time: the clock moves only to the next timer, so the waits are exact.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_retries_after_250_ms_and_times_out_at_its_deadline() {
        let q = Admission::new(AdmissionSection { enabled: true, ..AdmissionSection::default() });
        let now = Instant::now();
        assert_eq!(q.wait(10, now, now + Duration::from_secs(5)).await, Ok(()));
        assert_eq!(Instant::now() - now, Duration::from_millis(250));
        // A deadline before the recheck: back to its caller at the deadline, then refused.
        let later = Instant::now();
        assert_eq!(q.wait(10, later, later + Duration::from_millis(100)).await, Ok(()));
        assert_eq!(Instant::now() - later, Duration::from_millis(100));
        assert_eq!(q.wait(10, later, later + Duration::from_millis(100)).await, Err(Refused::Timeout));
        assert_eq!(Instant::now() - later, Duration::from_millis(100));
    }
}
