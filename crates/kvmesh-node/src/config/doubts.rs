//! What a valid configuration probably did not mean: the start-up log's warnings.

use super::{human, NodeConfig};
use kvmesh_core::{PolicyKind, Role};

impl NodeConfig {
    /// Valid but probably not meant: each a line for the start-up log.
    pub fn doubts(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.replicas.is_empty() && self.cluster.is_none() {
            out.push(
                "no [[replicas]] configured: the node routes nothing until replicas are added (`kvmesh replica add`, \
                 or [[replicas]] in this file and SIGHUP)"
                    .into(),
            );
        }
        let wanted = self
            .node
            .policy
            .parse::<PolicyKind>()
            .ok()
            .and_then(|k| k.build_with(&self.node.params()).ok())
            .and_then(|p| p.scrape_interval_s().map(|s| (p.name(), s)));
        if let Some((policy, s)) = wanted {
            let theirs = human(std::time::Duration::from_secs_f64(s));
            if self.node.scrape_interval.as_secs_f64() > s {
                out.push(format!(
                    "policy {policy} reproduces a router that reads engine metrics every {theirs}; node.scrape_interval \
                     is {}, so it scores on older gauges than that router would (set node.scrape_interval = \"{theirs}\" to \
                     match)",
                    human(self.node.scrape_interval)
                ));
            }
        }
        // Before 2026-12-06 a replica's `model` was informational; now it is the model it
        // serves, and a request is routed among its model's replicas only.
        let mut others: Vec<&str> = self
            .replicas
            .iter()
            .filter_map(|r| r.model.as_deref())
            .filter(|m| !m.is_empty() && *m != self.node.model)
            .collect();
        others.sort_unstable();
        others.dedup();
        if !others.is_empty() {
            out.push(format!(
                "replicas declare models other than node.model ({:?}): {others:?}; each serves only requests naming its \
                 model (a request naming none goes to node.model's replicas)",
                self.node.model
            ));
        }
        // Two replicas on one KV-event publisher would each be indexed with the other's blocks.
        let mut publishers = std::collections::BTreeMap::<&str, &str>::new();
        for r in self.replicas.iter().filter(|r| !r.kv_events_bind) {
            let Some(ep) = r.kv_events.as_deref() else { continue };
            if let Some(first) = publishers.insert(ep, &r.name) {
                out.push(format!(
                    "replicas {first:?} and {:?} subscribe to the same KV-event publisher {ep}: each would be indexed \
                     with the other's blocks (each engine, and each data-parallel rank, publishes on its own port)",
                    r.name
                ));
            }
        }
        // A disaggregated model needs both sides: one alone serves nothing.
        for (model, (prefill, decode)) in self.sides() {
            if prefill == 0 || decode == 0 {
                let (has, lacks) = if prefill > 0 { ("prefill", "decode") } else { ("decode", "prefill") };
                out.push(format!(
                    "model {model:?} has {has} replicas but no {lacks} replica: its requests go to its `both` replicas \
                     only, and the {has} replicas serve nothing until a {lacks} replica is added"
                ));
            }
        }
        if self.node.booking_lease < self.node.request_timeout {
            out.push(format!(
                "node.booking_lease (\"{}\") is shorter than node.request_timeout (\"{}\"): a proxied request that \
                 runs longer than the lease stops counting in its replica's token load while it runs",
                human(self.node.booking_lease),
                human(self.node.request_timeout)
            ));
        }
        let adm = &self.admission;
        match adm.ttft_slo {
            Some(_) if !adm.enabled => {
                out.push("admission.ttft_slo is set but admission.enabled is false: the TTFT gate is off".into())
            }
            Some(slo) if adm.max_wait > 10 * slo => out.push(format!(
                "admission.max_wait (\"{}\") is over 10x admission.ttft_slo (\"{}\"): late requests wait behind \
                 fresh ones and may wait up to max_wait; a few times the SLO (say 3x) bounds how late an answer can \
                 come",
                human(adm.max_wait),
                human(slo)
            )),
            _ => {}
        }
        // Raft needs a majority: two members stop when either is down, as one would.
        if let Some(n) = self.cluster.as_ref().and_then(|c| c.peer_map().ok()).map(|p| p.len()).filter(|&n| n == 2) {
            out.push(format!(
                "cluster.peers lists {n} nodes: Raft needs a majority, so the tier stops when either is down; run 3 \
                 (or 5) to survive losing one (or two)"
            ));
        }
        let a = &self.autoscaler;
        if a.enabled && self.replicas.len() > a.policy.max_replicas as usize {
            out.push(format!(
                "autoscaler.max_replicas ({}) is below the {} replicas configured: no decision asks for more than {}",
                a.policy.max_replicas,
                self.replicas.len(),
                a.policy.max_replicas
            ));
        }
        out
    }

    /// Per model with disaggregated replicas: how many prefill and decode replicas it has.
    fn sides(&self) -> std::collections::BTreeMap<&str, (usize, usize)> {
        let mut sides = std::collections::BTreeMap::<&str, (usize, usize)>::new();
        for r in self.replicas.iter().filter(|r| r.role != Role::Both) {
            let e = sides.entry(r.model.as_deref().unwrap_or(&self.node.model)).or_default();
            if r.role == Role::Prefill {
                e.0 += 1;
            } else {
                e.1 += 1;
            }
        }
        sides
    }
}
