//! `kvmesh replication status|trigger`: a node's `kvmesh.v1.Replication` service from the shell.

use crate::cli::{ClusterTarget, ReplicationCommand};
use crate::cluster::authed;
use anyhow::Context;
use kvmesh_proto::v1;
use std::fmt::Write as _;

pub fn run(cmd: &ReplicationCommand) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        match cmd {
            ReplicationCommand::Status(a) => {
                let mut c = client(&a.target).await?;
                let hot = c
                    .list_hot_prefixes(authed(&a.target, v1::ListHotPrefixesRequest { limit: a.limit })?)
                    .await
                    .context("Replication.ListHotPrefixes")?
                    .into_inner();
                let plan = c
                    .get_plan(authed(&a.target, v1::GetPlanRequest {})?)
                    .await
                    .context("Replication.GetPlan")?
                    .into_inner();
                if a.json {
                    // Both messages in the proto3 JSON mapping (pbjson): hashes and other 64-bit
                    // integers as strings, so no JSON reader rounds them.
                    let both = serde_json::json!({ "hot": hot, "plan": plan });
                    println!("{}", serde_json::to_string_pretty(&both)?);
                } else {
                    print!("{}", render(&hot, &plan, kvmesh_node::replication::unix_now()));
                }
            }
            ReplicationCommand::Trigger(a) => {
                let prefix = match (&a.hash, &a.text, &a.token_ids) {
                    (Some(h), _, _) => v1::trigger_request::Prefix::Hash(*h),
                    (_, Some(t), _) => v1::trigger_request::Prefix::Text(t.clone()),
                    (_, _, Some(ids)) => v1::trigger_request::Prefix::TokenIds(v1::TokenIds { ids: ids.clone() }),
                    _ => anyhow::bail!("give the prefix with --hash, --text or --token-ids"),
                };
                let req = v1::TriggerRequest { prefix: Some(prefix), replicas: a.replicas.clone() };
                let plan = client(&a.target)
                    .await?
                    .trigger(authed(&a.target, req)?)
                    .await
                    .map_err(|s| anyhow::anyhow!("Replication.Trigger: {}", s.message()))?
                    .into_inner();
                println!("plan version {} committed", plan.version);
                print!("{}", render_plan(&plan, kvmesh_node::replication::unix_now()));
            }
        }
        anyhow::Ok(())
    })
}

async fn client(
    t: &ClusterTarget,
) -> anyhow::Result<v1::replication_client::ReplicationClient<tonic::transport::Channel>> {
    let channel = crate::connect::channel(&t.grpc, crate::connect::NODE_HINT).await?;
    Ok(v1::replication_client::ReplicationClient::new(channel))
}

/// Hot prefixes, then the plan.
pub fn render(hot: &v1::HotPrefixList, plan: &v1::ReplicationPlan, now: f64) -> String {
    let mut out = String::new();
    if !hot.enabled {
        out.push_str("replication is off on this node ([replication] enabled = false); counts below are empty\n");
    }
    let nodes: Vec<String> = hot.nodes.iter().map(u64::to_string).collect();
    let whose = if nodes.len() == 1 {
        "this node's counts".to_string()
    } else {
        format!("counts of nodes {}", nodes.join(", "))
    };
    let _ = writeln!(
        out,
        "hot prefixes ({whose}; {:.0} tokens/s of token load over {} routable replicas)",
        hot.total_load_tokens_per_s, hot.routable_replicas
    );
    if hot.prefixes.is_empty() {
        out.push_str("  (none yet)\n");
    } else {
        let mut t = crate::table::plain(
            &["hash", "tokens", "share", "req/s", "planned", "warmable", "held on (KV events)"],
            &[1, 2, 3, 4],
        );
        for p in &hot.prefixes {
            t.add_row(vec![
                p.hash.to_string(),
                p.tokens.to_string(),
                format!("{:.1}%", 100.0 * p.load_share),
                format!("{:.2}", p.requests_per_s),
                if p.planned { "yes" } else { "-" }.to_string(),
                if p.warmable { "yes" } else { "no" }.to_string(),
                if p.holders.is_empty() { "-".to_string() } else { p.holders.join(",") },
            ]);
        }
        let _ = writeln!(out, "{}", crate::table::lines(&t));
    }
    out.push('\n');
    out.push_str(&render_plan(plan, now));
    out
}

/// The plan: one block per prefix, one line per target.
pub fn render_plan(plan: &v1::ReplicationPlan, now: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "replication plan v{}: {} prefix{}, {} KV blocks planned on targets",
        plan.version,
        plan.prefixes.len(),
        if plan.prefixes.len() == 1 { "" } else { "es" },
        plan.planned_blocks
    );
    for p in &plan.prefixes {
        let cooling = p.cool_since.map_or(String::new(), |c| format!(", cooling for {:.0}s", (now - c).max(0.0)));
        let _ = writeln!(
            out,
            "  {} ({} blocks, {}, {:.1}% of load{}): want {} replicas; held on {}",
            p.hash,
            p.depth_blocks,
            p.origin,
            100.0 * p.load_share,
            cooling,
            p.want_replicas,
            if p.holders.is_empty() { "-".to_string() } else { p.holders.join(",") }
        );
        for t in &p.targets {
            let since = t.since.map_or(String::new(), |s| format!(" {:.1}s ago", (now - s).max(0.0)));
            let reason = if t.reason.is_empty() { String::new() } else { format!(": {}", t.reason) };
            let _ =
                writeln!(out, "    → {:<16} {:<9}{} (attempts {}){}", t.replica, t.state, since, t.attempts, reason);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_reads_at_a_glance() {
        let hot = v1::HotPrefixList {
            total_load_tokens_per_s: 5000.0,
            routable_replicas: 4,
            nodes: vec![1, 2],
            enabled: true,
            prefixes: vec![v1::HotPrefix {
                hash: 42,
                depth_blocks: 32,
                tokens: 512,
                load_share: 0.6,
                requests_per_s: 12.5,
                holders: vec!["e0".into()],
                planned: true,
                warmable: true,
                ..Default::default()
            }],
        };
        let plan = v1::ReplicationPlan {
            version: 3,
            planned_blocks: 64,
            enabled: true,
            prefixes: vec![v1::PlannedPrefix {
                hash: 42,
                depth_blocks: 32,
                load_share: 0.6,
                want_replicas: 3,
                holders: vec!["e0".into()],
                origin: "detected".into(),
                targets: vec![
                    v1::PlanTarget {
                        replica: "e1".into(),
                        state: "confirmed".into(),
                        attempts: 1,
                        since: Some(98.0),
                        ..Default::default()
                    },
                    v1::PlanTarget {
                        replica: "e2".into(),
                        state: "failed".into(),
                        attempts: 3,
                        reason: "HTTP 500".into(),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }],
        };
        let text = render(&hot, &plan, 100.0);
        assert_eq!(
            text,
            "hot prefixes (counts of nodes 1, 2; 5000 tokens/s of token load over 4 routable replicas)\n\
             \x20hash  tokens  share  req/s  planned  warmable  held on (KV events)\n\
             \x2042       512  60.0%  12.50      yes  yes       e0\n\
             \n\
             replication plan v3: 1 prefix, 64 KV blocks planned on targets\n\
             \x20 42 (32 blocks, detected, 60.0% of load): want 3 replicas; held on e0\n\
             \x20   → e1               confirmed 2.0s ago (attempts 1)\n\
             \x20   → e2               failed    (attempts 3): HTTP 500\n"
        );
    }
}
