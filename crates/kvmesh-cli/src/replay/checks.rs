//! Replay's flags checked before any run: the P:D split, every value in range, policy parameters by name.

use super::*;

/// The disaggregated fleet `--pd` asks for, checked against what it cannot run with.
pub(super) fn pd_of(args: &ReplayArgs) -> anyhow::Result<Option<PdConfig>> {
    let Some(pd) = &args.pd else {
        if args.decode_policy.is_some() {
            bail!("--decode-policy picks a disaggregated request's decode side: give --pd too");
        }
        return Ok(None);
    };
    let mut pd: PdConfig = pd.parse().map_err(|e| anyhow::anyhow!("--pd: {e}"))?;
    if !(args.pd_link_gbps.is_finite() && args.pd_link_gbps > 0.0) {
        bail!("--pd-link-gbps must be a positive number, got {}", args.pd_link_gbps);
    }
    pd.link_gbps = args.pd_link_gbps;
    if args.autoscale.is_some() || args.replication || args.admission || args.admission_slo || args.routers > 1 {
        bail!("--pd runs one router without --autoscale, --replication, --admission or --admission-slo");
    }
    if let Some(d) = &args.decode_policy {
        d.parse::<PolicyKind>().map_err(|e| anyhow::anyhow!("--decode-policy: {e}"))?;
    }
    Ok(Some(pd))
}

/// Rejects flag values that cannot make a simulation, before any work.
pub(super) fn validate(args: &ReplayArgs) -> anyhow::Result<()> {
    if args.seeds == 0 {
        bail!("--seeds must be at least 1");
    }
    if args.replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    if args.routers == 0 {
        bail!("--routers must be at least 1");
    }
    if let Err(e) = args.output_info.parse::<kvmesh_sim::simulation::OutputInfo>() {
        bail!("--output-info: {e}");
    }
    if !(args.gossip_delay_ms.is_finite() && args.gossip_delay_ms >= 0.0) {
        bail!("--gossip-delay-ms must be a non-negative number, got {}", args.gossip_delay_ms);
    }
    if args.block_size == 0 {
        bail!("--block-size must be at least 1 token");
    }
    if !(args.event_delay_ms.is_finite() && args.event_delay_ms >= 0.0) {
        bail!("--event-delay-ms must be a non-negative number, got {}", args.event_delay_ms);
    }
    if !(args.cold_start.is_finite() && args.cold_start >= 0.0) {
        bail!("--cold-start must be non-negative seconds, got {}", args.cold_start);
    }
    if args.autoscale.is_some() && (args.min_replicas > args.replicas || args.initial_replicas > args.replicas) {
        bail!("--min-replicas and --initial-replicas must not exceed --replicas (the pool's largest size)");
    }
    if args.autoscale.is_some() && (args.min_replicas == 0 || args.initial_replicas == 0) {
        bail!("--min-replicas and --initial-replicas must be at least 1: a pool with no replica serves nothing");
    }
    let u = args.target_utilisation;
    if !(u.is_finite() && u > 0.0 && u <= 1.0) {
        bail!("--target-utilisation must be in (0, 1], got {u}");
    }
    if args.scale_csv.is_some() && args.autoscale.is_none() {
        bail!("--scale-csv writes autoscaling decisions: give --autoscale too");
    }
    if !(args.ttft_slo.is_finite() && args.ttft_slo > 0.0) {
        bail!("--ttft-slo must be a positive number of seconds, got {}", args.ttft_slo);
    }
    match (args.rate, &args.trace) {
        (Some(_), Some(_)) => bail!("--rate sets a scenario's arrival rate; for a trace use --rate-scale"),
        (Some(r), None) if !(r.is_finite() && r > 0.0) => {
            bail!("--rate must be a positive number of requests per second, got {r}")
        }
        _ => {}
    }
    Ok(())
}

/// The `--policy-param POLICY.NAME=VALUE` settings that name `kind`.
///
/// # Errors
/// A setting without `.` and `=`, with a value that is not a number, or naming no policy.
pub(super) fn policy_params(settings: &[String], kind: PolicyKind) -> anyhow::Result<Vec<(String, f64)>> {
    let mut mine = Vec::new();
    for s in settings {
        let parsed = s.split_once('=').and_then(|(key, v)| Some((key.split_once('.')?, v.trim().parse::<f64>().ok()?)));
        let Some(((policy, name), v)) = parsed else {
            anyhow::bail!("--policy-param {s:?}: expected POLICY.NAME=VALUE, e.g. token_load.affinity_budget=0.6");
        };
        let named: PolicyKind = policy.parse().map_err(|e| anyhow::anyhow!("--policy-param {s:?}: {e}"))?;
        if named == kind {
            mine.push((name.to_string(), v));
        }
    }
    Ok(mine)
}
