//! `kvmesh status`: a node's replicas, readable in a terminal (gRPC `Admin.ListReplicas`).

use crate::cli::StatusArgs;
use anyhow::Context;
use kvmesh_proto::v1;

pub fn run(args: &StatusArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let replicas = runtime.block_on(async {
        let channel = tonic::transport::Channel::from_shared(args.grpc.clone())?
            .connect()
            .await
            .with_context(|| format!("connecting to the node at {} (is `kvmesh node` running?)", args.grpc))?;
        let mut admin = v1::admin_client::AdminClient::new(channel);
        let mut request = tonic::Request::new(v1::ListReplicasRequest {});
        if let Some(t) = crate::cluster::admin_token(args.token_file.as_deref())? {
            t.attach(request.metadata_mut());
        }
        let list = admin.list_replicas(request).await.context("Admin.ListReplicas")?;
        anyhow::Ok(list.into_inner().replicas)
    })?;
    if args.json {
        let rows: Vec<serde_json::Value> = replicas.iter().map(row_json).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    print!("{}", render(&replicas));
    Ok(())
}

fn status_name(raw: i32) -> &'static str {
    match v1::ReplicaStatus::try_from(raw) {
        Ok(v1::ReplicaStatus::Ready) => "ready",
        Ok(v1::ReplicaStatus::Draining) => "draining",
        Ok(v1::ReplicaStatus::OutOfSync) => "out_of_sync",
        Ok(v1::ReplicaStatus::NoEvents) => "no_events",
        Ok(v1::ReplicaStatus::BlockSizeMismatch) => "block_size_mismatch",
        Ok(v1::ReplicaStatus::Unhealthy) => "unhealthy",
        _ => "unknown",
    }
}

fn row_json(r: &v1::Replica) -> serde_json::Value {
    let spec = r.spec.clone().unwrap_or_default();
    serde_json::json!({
        "name": spec.name, "endpoint": spec.http_endpoint, "status": status_name(r.status), "detail": r.status_detail,
        "running": r.running, "waiting": r.waiting, "kv_usage": r.kv_usage,
        "queued_prefill_tokens": r.queued_prefill_tokens, "live_bookings": r.live_bookings,
        "index_blocks": r.index_blocks, "events_applied": r.events_applied, "events_rejected": r.events_rejected,
        "last_event_age_s": r.last_event_age_s, "last_seq": r.last_seq,
    })
}

/// The table `kvmesh status` prints.
fn render(replicas: &[v1::Replica]) -> String {
    let mut out = format!(
        "{:<16} {:<20} {:>7} {:>7} {:>6} {:>12} {:>8} {:>10} {:>10} {:>9}  {}\n",
        "replica",
        "status",
        "running",
        "waiting",
        "kv",
        "queued tok",
        "bookings",
        "blocks",
        "events",
        "last ev",
        "detail"
    );
    for r in replicas {
        let spec = r.spec.clone().unwrap_or_default();
        let age = r.last_event_age_s.map_or_else(|| "—".to_string(), |a| format!("{a:.1} s"));
        out.push_str(&format!(
            "{:<16} {:<20} {:>7} {:>7} {:>5.0}% {:>12} {:>8} {:>10} {:>10} {:>9}  {}\n",
            spec.name,
            status_name(r.status),
            r.running,
            r.waiting,
            r.kv_usage * 100.0,
            r.queued_prefill_tokens,
            r.live_bookings,
            r.index_blocks,
            format!("{}/{}", r.events_applied, r.events_rejected),
            age,
            r.status_detail
        ));
    }
    if replicas.is_empty() {
        out.push_str("(no replicas registered)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_status_load_and_events() {
        let r = v1::Replica {
            spec: Some(v1::ReplicaSpec { name: "vllm-0".into(), ..Default::default() }),
            status: v1::ReplicaStatus::BlockSizeMismatch as i32,
            status_detail: "events carry block size 32, this node uses 16".into(),
            running: 3,
            waiting: 1,
            kv_usage: 0.25,
            queued_prefill_tokens: 4096,
            live_bookings: 4,
            index_blocks: 120,
            events_applied: 10,
            events_rejected: 2,
            last_event_age_s: Some(1.25),
            last_seq: Some(11),
        };
        let table = render(&[r]);
        let row = table.lines().nth(1).unwrap();
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            &cells[..10],
            &["vllm-0", "block_size_mismatch", "3", "1", "25%", "4096", "4", "120", "10/2", "1.2"]
        );
        assert!(row.ends_with("events carry block size 32, this node uses 16"));
        assert_eq!(render(&[]).lines().nth(1), Some("(no replicas registered)"));
    }
}
