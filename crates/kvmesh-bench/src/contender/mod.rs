//! The indexes under test, each behind [`Index`]: fed what it natively takes, asked the same
//! queries, answering in one shape so the answers can be compared.

pub mod dynamo;
pub mod kvmesh;

use crate::workload::{Op, Query};

/// One index under test.
///
/// `event` and `query_input` convert the neutral workload into the index's own input and run
/// outside the timers; `apply` and `query` are what is timed.
pub trait Index {
    /// The index's native event.
    type Event;
    /// The index's native query.
    type Query;
    /// The index's native answer.
    type Answer;

    /// The name in reports.
    fn name(&self) -> &'static str;
    /// What a query's time includes (e.g. "lookup only; hashes precomputed").
    fn query_includes(&self) -> &'static str;
    /// `op` as this index's event (`None` for a query op).
    fn event(&mut self, op: &Op) -> Option<Self::Event>;
    /// `q` as this index's query.
    fn query_input(&self, q: &Query) -> Self::Query;
    /// Applies one event.
    fn apply(&mut self, event: Self::Event);
    /// Waits until every applied event is visible to queries (a no-op for synchronous ones).
    fn flush(&mut self) {}
    /// Answers `q` (the timed part).
    fn query(&self, q: Self::Query) -> Self::Answer;
    /// Writes `answer` as `(engine, leading blocks)` for every engine with a match, sorted by
    /// engine, into `out` (cleared first).
    fn answer(&self, answer: Self::Answer, out: &mut Vec<(u32, u32)>);
    /// Errors the index reported while applying events.
    fn apply_errors(&self) -> u64 {
        0
    }
}

/// The two sides of a concurrent run: `write(op)` applies one event; `read(query index)`
/// answers one query. Both are called from their own thread.
pub trait Shared: Sync {
    /// Applies `op` (an event).
    fn write(&self, op: &crate::workload::Op);
    /// Answers query `q` of the workload, returning something to keep the work observable.
    fn read(&self, q: usize) -> usize;
    /// Waits until every written event is applied.
    fn settle(&self) {}
}
