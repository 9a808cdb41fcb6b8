//! `kvmesh autoscaler decisions | recommend | watch`: a node's `kvmesh.v1.Autoscaler` from the
//! shell — the audit log, the latest decision, and the stream an actuator follows.

use crate::cli::AutoscalerCommand;
use anyhow::Context;
use kvmesh_proto::v1;
use std::fmt::Write as _;

pub fn run(cmd: &AutoscalerCommand) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let (AutoscalerCommand::Decisions(a) | AutoscalerCommand::Recommend(a) | AutoscalerCommand::Watch(a)) = cmd;
        let channel = crate::connect::channel(&a.target.grpc, crate::connect::NODE_HINT).await?;
        let mut client = v1::autoscaler_client::AutoscalerClient::new(channel);
        let request = v1::AutoscalerRequest { pool: a.pool.clone() };
        let now = kvmesh_node::replication::unix_now;
        match cmd {
            AutoscalerCommand::Decisions(_) => {
                let list = client
                    .list_decisions(crate::cluster::authed(&a.target, request)?)
                    .await
                    .map_err(|s| anyhow::anyhow!("Autoscaler.ListDecisions: {}", s.message()))
                    .context("reading the decisions")?
                    .into_inner();
                if a.json {
                    crate::emit(&format!("{}\n", serde_json::to_string_pretty(&list.decisions)?))?;
                } else {
                    crate::emit(&render(&list.decisions, now()))?;
                }
            }
            AutoscalerCommand::Recommend(_) => {
                let d = client
                    .get_recommendation(crate::cluster::authed(&a.target, request)?)
                    .await
                    .map_err(|s| anyhow::anyhow!("Autoscaler.GetRecommendation: {}", s.message()))
                    .context("reading the latest decision")?
                    .into_inner();
                if a.json {
                    crate::emit(&format!("{}\n", serde_json::to_string_pretty(&d)?))?;
                } else {
                    crate::emit(&render(std::slice::from_ref(&d), now()))?;
                }
            }
            AutoscalerCommand::Watch(_) => {
                let mut stream = client
                    .watch_decisions(crate::cluster::authed(&a.target, request)?)
                    .await
                    .map_err(|s| anyhow::anyhow!("Autoscaler.WatchDecisions: {}", s.message()))
                    .context("watching the decisions")?
                    .into_inner();
                // One Ctrl-C future for the whole watch: a fresh one per pass could miss a signal.
                let ctrl_c = tokio::signal::ctrl_c();
                tokio::pin!(ctrl_c);
                let mut line = if a.json { String::new() } else { header() };
                loop {
                    // A reader that went away (`watch | head -1`) ends the watch.
                    if let Err(e) = write_now(&line) {
                        return if e.kind() == std::io::ErrorKind::BrokenPipe { Ok(()) } else { Err(e.into()) };
                    }
                    let next = tokio::select! {
                        next = stream.message() => next,
                        _ = &mut ctrl_c => return Ok(()),
                    };
                    line = match next.map_err(|s| anyhow::anyhow!("Autoscaler.WatchDecisions: {}", s.message()))? {
                        Some(d) if a.json => format!("{}\n", serde_json::to_string(&d)?),
                        Some(d) => row(&d, now()),
                        None => anyhow::bail!("the node ended the stream (it stopped)"),
                    };
                }
            }
        }
        anyhow::Ok(())
    })
}

/// Writes `text` to stdout at once (a watch's lines must not wait in a buffer).
fn write_now(text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// The table's header; the loads are tokens per second.
fn header() -> String {
    format!(
        "{:>9} {:>8}  {:>7}  {:<18} {:>5} {:>8} {:>14} {:>14} {:>14}\n",
        "log index", "ago", "desired", "reason", "ready", "starting", "demand tok/s", "sized tok/s", "tok/s/replica"
    )
}

/// One decision's line (and its drains'); `now` in Unix seconds for its age.
fn row(d: &v1::ScaleDecision, now: f64) -> String {
    let reason = if d.panic { format!("{} (panic)", d.reason) } else { d.reason.clone() };
    let mut out = format!(
        "{:>9} {:>7.0}s  {:>7}  {:<18} {:>5} {:>8} {:>14.0} {:>14.0} {:>14.0}\n",
        d.log_index,
        (now - d.at).max(0.0),
        d.desired_replicas,
        reason,
        d.ready,
        d.starting,
        d.demand_tokens_per_s,
        d.forecast_tokens_per_s,
        d.capacity_tokens_per_s
    );
    if !d.drain.is_empty() {
        let _ = writeln!(out, "{:>9} draining for release: {}", "", d.drain.join(", "));
    }
    out
}

/// One line per decision, oldest first; `now` in Unix seconds for the ages.
fn render(ds: &[v1::ScaleDecision], now: f64) -> String {
    if ds.is_empty() {
        return "no decision yet (the first comes after one interval, from the Raft leader)\n".into();
    }
    ds.iter().fold(header(), |out, d| out + &row(d, now))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_read_as_an_audit_log() {
        let d = v1::ScaleDecision {
            pool: "default".into(),
            desired_replicas: 6,
            reason: "burst".into(),
            ready: 4,
            starting: 2,
            forecast_tokens_per_s: 95_000.0,
            demand_tokens_per_s: 81_234.4,
            capacity_tokens_per_s: 33_000.0,
            panic: true,
            at: 1_000.0,
            log_index: 42,
            drain: Vec::new(),
            cold_start_s: 60.0,
        };
        assert_eq!(
            render(std::slice::from_ref(&d), 1_012.0),
            concat!(
                "log index      ago  desired  reason             ready starting   demand tok/s    sized tok/s  tok/s/replica\n",
                "       42      12s        6  burst (panic)          4        2          81234          95000          33000\n",
            )
        );
        // The proto3 JSON mapping (pbjson): 64-bit integers as strings, defaults printed.
        let json = |d: &v1::ScaleDecision| serde_json::to_value(d).unwrap();
        assert_eq!(json(&d)["log_index"], "42");
        assert_eq!(json(&d)["desired_replicas"], 6);
        let down = v1::ScaleDecision {
            desired_replicas: 4,
            reason: "scale_down".into(),
            ready: 6,
            starting: 0,
            panic: false,
            log_index: 43,
            drain: vec!["vllm-5".into(), "vllm-2".into()],
            ..d.clone()
        };
        assert_eq!(
            render(std::slice::from_ref(&down), 1_012.0).lines().skip(1).collect::<Vec<_>>(),
            [
                "       43      12s        4  scale_down             6        0          81234          95000          33000",
                "          draining for release: vllm-5, vllm-2",
            ]
        );
        assert_eq!(json(&down)["drain"], serde_json::json!(["vllm-5", "vllm-2"]));
        assert!(render(&[], 0.0).starts_with("no decision yet"));
    }
}
