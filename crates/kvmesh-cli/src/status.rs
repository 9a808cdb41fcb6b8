//! `kvmesh status`: a node's cluster (leader, term, members), replicas, admission queue, the
//! autoscaler's latest decision, hot prefixes and their replication plan, and latest routing
//! decisions, readable in a terminal (gRPC `Cluster.Status`, `Admin.ListReplicas`,
//! `Autoscaler.GetRecommendation`, `Replication.ListHotPrefixes`/`GetPlan`,
//! `Admin.RecentDecisions`).

use crate::cli::StatusArgs;
use crate::cluster::with_token;
use kvmesh_proto::v1;
use std::fmt::Write as _;

pub fn run(args: &StatusArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let token = crate::cluster::admin_token(args.target.token_file.as_deref())?;
    let (cluster, replicas, decisions, replication, scale) = runtime.block_on(async {
        let channel = crate::connect::channel(&args.target.grpc, crate::connect::NODE_HINT).await?;
        let mut admin = v1::admin_client::AdminClient::new(channel.clone());
        let mut rep = v1::replication_client::ReplicationClient::new(channel.clone());
        // Older nodes have no Replication service; nodes with it off show nothing.
        let replication = match rep.list_hot_prefixes(with_token(&token, v1::ListHotPrefixesRequest { limit: 5 })).await
        {
            Ok(hot) if hot.get_ref().enabled => rep
                .get_plan(with_token(&token, v1::GetPlanRequest {}))
                .await
                .ok()
                .map(|plan| (hot.into_inner(), plan.into_inner())),
            _ => None,
        };
        let list = admin
            .list_replicas(with_token(&token, v1::ListReplicasRequest {}))
            .await
            .map_err(|s| crate::cluster::failed("Admin.ListReplicas", &s, &args.target))?;
        // A single node has no Cluster service; an older node no RecentDecisions: both optional.
        let cluster = v1::cluster_client::ClusterClient::new(channel.clone())
            .status(with_token(&token, v1::ClusterStatusRequest {}))
            .await
            .ok()
            .map(|s| s.into_inner());
        let decisions = if args.decisions == 0 {
            Vec::new()
        } else {
            let mut admin = admin.clone();
            let req = with_token(&token, v1::RecentDecisionsRequest { limit: args.decisions });
            admin.recent_decisions(req).await.map(|r| r.into_inner().decisions).unwrap_or_default()
        };
        // Nodes without the autoscaler (or older ones) show nothing.
        let scale = v1::autoscaler_client::AutoscalerClient::new(channel.clone())
            .get_recommendation(with_token(&token, v1::AutoscalerRequest { pool: String::new() }))
            .await
            .ok()
            .map(|r| r.into_inner());
        anyhow::Ok((cluster, list.into_inner(), decisions, replication, scale))
    })?;
    let (replicas, admission) = (replicas.replicas, replicas.admission);
    if args.json {
        let replicas = known_statuses(replicas);
        let all = StatusJson {
            replicas: &replicas,
            admission: admission.as_ref(),
            autoscaler: scale.as_ref(),
            decisions: &decisions,
        };
        return crate::emit(&format!("{}\n", serde_json::to_string_pretty(&all)?));
    }
    let mut out = String::new();
    if let Some(c) = &cluster {
        let text = crate::cluster::render(c);
        // The header and the members; the registry repeats what the replica table shows.
        let members: Vec<&str> = text.lines().take_while(|l| !l.starts_with("registry")).collect();
        let _ = writeln!(out, "{}\n", members.join("\n"));
    }
    out.push_str(&render(&replicas));
    if let Some(a) = &admission {
        let _ = writeln!(out, "\n{}", render_admission(a));
    }
    if let Some(d) = &scale {
        let _ = writeln!(out, "\n{}", render_scale(d, kvmesh_node::replication::unix_now()));
    }
    if let Some((hot, plan)) = &replication {
        let _ = write!(out, "\n{}", crate::replication::render(hot, plan, kvmesh_node::replication::unix_now()));
    }
    if !decisions.is_empty() {
        let _ = writeln!(out, "\n{}", render_decisions(&decisions));
    }
    crate::emit(&out)
}

/// `kvmesh status --json`: the node's messages in the proto3 JSON mapping (pbjson), as
/// `grpcurl` shows them: `replicas` as `Admin.ListReplicas` returns them (`spec.name`, `status`
/// `"REPLICA_STATUS_READY"`, 64-bit counts as strings), the admission state, and the autoscaler's
/// latest decision (`null` where the node has none).
#[derive(serde::Serialize)]
struct StatusJson<'a> {
    replicas: &'a [v1::Replica],
    admission: Option<&'a v1::AdmissionState>,
    autoscaler: Option<&'a v1::ScaleDecision>,
    /// The latest `--decisions` routing decisions, newest first.
    decisions: &'a [v1::RecentDecision],
}

/// `replicas` with every status this CLI does not know (a newer node's) as
/// `REPLICA_STATUS_UNSPECIFIED`: the generated serializer refuses a value outside the enum, and
/// one replica's new status must not cost the whole answer (the table prints it `unknown`).
fn known_statuses(mut replicas: Vec<v1::Replica>) -> Vec<v1::Replica> {
    for r in &mut replicas {
        if v1::ReplicaStatus::try_from(r.status).is_err() {
            r.status = v1::ReplicaStatus::Unspecified as i32;
        }
    }
    replicas
}

/// The autoscaler's latest committed decision, one line, with its age at `now` (Unix seconds):
/// an unchanged decision is committed again only every 30 s, so its load figures can be that
/// old (`kvmesh_autoscaler_*{decision="evaluated"}` on `/metrics` has every interval's).
fn render_scale(d: &v1::ScaleDecision, now: f64) -> String {
    format!(
        "autoscaler (pool {}): {} {} wanted ({}{}) · {} ready, {} starting · load {:.0} tokens/s, sized for {:.0} tokens/s at {:.0} per replica{} · decided {:.0} s ago",
        d.pool,
        d.desired_replicas,
        if d.desired_replicas == 1 { "replica" } else { "replicas" },
        d.reason,
        if d.panic { ", panic" } else { "" },
        d.ready,
        d.starting,
        d.demand_tokens_per_s,
        d.forecast_tokens_per_s,
        d.capacity_tokens_per_s,
        // Decisions from older nodes carry none.
        if d.cold_start_s > 0.0 { format!(" · cold start {:.0} s", d.cold_start_s) } else { String::new() },
        (now - d.at).max(0.0)
    )
}

/// The node's admission queue, one line. Shown when off too (the default): an operator
/// seeing replicas pile up wants to know that nothing holds requests back.
fn render_admission(a: &v1::AdmissionState) -> String {
    if !a.enabled {
        return "admission control: off".into();
    }
    let gate = if a.ttft_slo_s > 0.0 { format!(", TTFT SLO {} s", a.ttft_slo_s) } else { String::new() };
    format!(
        "admission control (this node): {} waiting ({} tokens of load), queue limit {}, max wait {} s{gate} · refused since start: {} queue full, {} evicted as late, {} timed out",
        a.waiting,
        a.waiting_tokens,
        a.queue_limit,
        a.max_wait_s,
        a.refused_queue_full,
        a.refused_evicted_late,
        a.refused_timeout
    )
}

/// The latest decisions, newest first.
fn render_decisions(ds: &[v1::RecentDecision]) -> String {
    let mut t = crate::table::plain(
        &["ago", "via", "replica", "reason", "prompt tok", "overlap blk", "uncached tok", "est. TTFT"],
        &[0, 4, 5, 6, 7],
    );
    for d in ds {
        t.add_row(vec![
            format!("{:.1}s", d.age_s),
            d.via.clone(),
            d.replica.clone(),
            d.reason.clone(),
            d.prompt_tokens.to_string(),
            d.overlap_blocks.to_string(),
            d.uncached_tokens.to_string(),
            format!("{:.0}ms", d.estimated_ttft_s * 1e3),
        ]);
    }
    format!("last decisions (newest first)\n{}", crate::table::lines(&t))
}

fn status_name(raw: i32) -> &'static str {
    kvmesh_proto::convert::replica_status(raw).map_or("unknown", |s| s.as_str())
}

/// The table `kvmesh status` prints.
fn render(replicas: &[v1::Replica]) -> String {
    let mut t = crate::table::plain(
        &[
            "replica",
            "status",
            "running",
            "waiting",
            "kv",
            "kv blocks",
            "queued tok",
            "bookings",
            "blocks",
            "events ok/bad",
            "last ev",
            "detail",
        ],
        &[2, 3, 4, 5, 6, 7, 8, 9, 10],
    );
    for r in replicas {
        let spec = r.spec.clone().unwrap_or_default();
        let age = r.last_event_age_s.map_or_else(|| "—".to_string(), |a| format!("{a:.1} s"));
        // A disaggregated replica's side, after its name.
        let name = if spec.role.is_empty() || spec.role == "both" {
            spec.name
        } else {
            format!("{} ({})", spec.name, spec.role)
        };
        // The engine's gauges are its last scrape's: shown only while its engine answers them,
        // so a dead replica does not look busy (or idle) on numbers from before it died.
        let gauge = |text: String| if r.engine_up { text } else { "—".to_string() };
        t.add_row(vec![
            name,
            status_name(r.status).to_string(),
            gauge(r.running.to_string()),
            gauge(r.waiting.to_string()),
            gauge(format!("{:.0}%", r.kv_usage * 100.0)),
            // Its KV capacity: configured, or its engine's (marked; "—" until read).
            match (spec.capacity_blocks, r.capacity_from_engine) {
                (0, _) => "—".to_string(),
                (blocks, true) => format!("{blocks} (engine)"),
                (blocks, false) => blocks.to_string(),
            },
            r.queued_prefill_tokens.to_string(),
            r.live_bookings.to_string(),
            r.index_blocks.to_string(),
            format!("{}/{}", r.events_applied, r.events_rejected),
            age,
            r.status_detail.clone(),
        ]);
    }
    let mut out = crate::table::lines(&t);
    out.push('\n');
    if replicas.is_empty() {
        out.push_str("(no replicas registered)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_autoscaler_line_reads_at_a_glance() {
        let d = v1::ScaleDecision {
            pool: "default".into(),
            desired_replicas: 6,
            reason: "burst".into(),
            ready: 4,
            starting: 2,
            demand_tokens_per_s: 81_234.4,
            forecast_tokens_per_s: 95_000.0,
            capacity_tokens_per_s: 33_000.0,
            panic: true,
            at: 1_000.0,
            cold_start_s: 42.4,
            ..Default::default()
        };
        assert_eq!(
            render_scale(&d, 1_012.4),
            "autoscaler (pool default): 6 replicas wanted (burst, panic) · 4 ready, 2 starting · load 81234 tokens/s, sized for 95000 tokens/s at 33000 per replica · cold start 42 s · decided 12 s ago"
        );
    }

    use super::*;

    #[test]
    fn the_admission_line_says_what_waits_and_what_was_refused() {
        let a = v1::AdmissionState {
            enabled: true,
            waiting: 3,
            waiting_tokens: 12_480,
            queue_limit: 256,
            max_wait_s: 30.0,
            ttft_slo_s: 2.0,
            refused_queue_full: 5,
            refused_evicted_late: 1,
            refused_timeout: 0,
        };
        assert_eq!(
            render_admission(&a),
            "admission control (this node): 3 waiting (12480 tokens of load), queue limit 256, max wait 30 s, TTFT SLO 2 s · refused since start: 5 queue full, 1 evicted as late, 0 timed out"
        );
        let off = v1::AdmissionState { ttft_slo_s: 0.0, ..a };
        assert!(render_admission(&off).contains("queue limit 256, max wait 30 s · refused"));
        assert_eq!(render_admission(&v1::AdmissionState::default()), "admission control: off");
    }

    fn decision() -> v1::RecentDecision {
        v1::RecentDecision {
            age_s: 0.25,
            via: "http".into(),
            replica: "vllm-3".into(),
            reason: "lowest_cost".into(),
            prompt_tokens: 4096,
            overlap_blocks: 200,
            uncached_tokens: 896,
            estimated_ttft_s: 0.0215,
        }
    }

    #[test]
    fn decisions_render_newest_first_with_their_reason() {
        let d = decision();
        let text = render_decisions(&[d]);
        assert_eq!(
            text,
            "last decisions (newest first)\n  ago  via   replica  reason       prompt tok  overlap blk  uncached tok  \
             est. TTFT\n 0.2s  http  vllm-3   lowest_cost        4096          200           896       22ms"
        );
        // The endpoint picker's decisions widen the column.
        let g = v1::RecentDecision { via: "gateway".into(), ..decision() };
        assert!(render_decisions(&[g]).lines().nth(2).unwrap().starts_with(" 0.2s  gateway  vllm-3 "));
    }

    #[test]
    fn the_table_shows_status_load_and_events() {
        let r = v1::Replica {
            spec: Some(v1::ReplicaSpec { name: "vllm-0".into(), capacity_blocks: 29_375, ..Default::default() }),
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
            idle: false,
            engine_up: true,
            capacity_from_engine: true,
        };
        let table = render(std::slice::from_ref(&r));
        let row = table.lines().nth(1).unwrap();
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            &cells[..12],
            &["vllm-0", "block_size_mismatch", "3", "1", "25%", "29375", "(engine)", "4096", "4", "120", "10/2", "1.2"]
        );
        assert!(row.ends_with("events carry block size 32, this node uses 16"));
        assert_eq!(render(&[]).lines().nth(1), Some("(no replicas registered)"));
        // An engine that stopped answering its scrapes: no gauges from before it stopped.
        // Its capacity configured, or not known yet.
        let spec = v1::ReplicaSpec { capacity_blocks: 0, ..r.spec.clone().unwrap() };
        let down = v1::Replica {
            status: v1::ReplicaStatus::Unhealthy as i32,
            engine_up: false,
            spec: Some(spec),
            ..r.clone()
        };
        let table = render(&[down]);
        let cells: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(&cells[..7], &["vllm-0", "unhealthy", "—", "—", "—", "—", "4096"]);
        let configured = v1::Replica { capacity_from_engine: false, ..r };
        let table = render(&[configured]);
        assert_eq!(table.lines().nth(1).unwrap().split_whitespace().nth(5), Some("29375"));
    }

    #[test]
    fn a_status_this_cli_does_not_know_prints_as_unspecified_and_the_rest_as_sent() {
        let replica = |name: &str, status: i32| v1::Replica {
            spec: Some(v1::ReplicaSpec { name: name.into(), ..Default::default() }),
            status,
            index_blocks: 1 << 60,
            ..Default::default()
        };
        let replicas = super::known_statuses(vec![replica("e0", 99), replica("e1", v1::ReplicaStatus::Ready as i32)]);
        let all = super::StatusJson { replicas: &replicas, admission: None, autoscaler: None, decisions: &[] };
        let json = serde_json::to_value(&all).unwrap();
        assert_eq!(json["replicas"][0]["status"], "REPLICA_STATUS_UNSPECIFIED");
        assert_eq!(json["replicas"][1]["status"], "REPLICA_STATUS_READY");
        assert_eq!(json["replicas"][1]["spec"]["name"], "e1");
        // 64-bit counts as strings: 2^60 survives a reader that parses numbers as doubles.
        assert_eq!(json["replicas"][1]["index_blocks"], "1152921504606846976");
        assert_eq!(json["admission"], serde_json::Value::Null);
        assert_eq!(json["decisions"], serde_json::json!([]));
    }
}
