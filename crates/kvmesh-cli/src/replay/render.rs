//! The replay report as a terminal table and as Markdown.

use super::Report;
use std::fmt::Write;

const COLUMNS: [&str; 14] = [
    "policy",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "no-queue p99",
    "TPOT p50",
    "TPOT p99",
    "E2E p99",
    "req/s",
    "out tok/s",
    "hit rate",
    "queue max",
    "queue mean",
    ">SLO",
];

fn rows(r: &Report) -> Vec<[String; 14]> {
    r.results
        .iter()
        .map(|p| {
            let m = &p.mean;
            [
                p.policy.clone(),
                secs(m.ttft_p50),
                secs(m.ttft_p90),
                secs(m.ttft_p99),
                secs(m.ttft_p99_no_queue),
                format!("{:.1} ms", m.tpot_p50 * 1e3),
                format!("{:.1} ms", m.tpot_p99 * 1e3),
                secs(m.e2e_p99),
                format!("{:.2}", m.throughput_rps),
                format!("{:.0}", m.output_tps),
                format!("{:.3}", m.hit_rate),
                format!("{:.0}", m.load_max),
                format!("{:.0}", m.load_mean),
                m.slo_violations.to_string(),
            ]
        })
        .collect()
}

fn secs(s: f64) -> String {
    if s < 1.0 {
        format!("{:.0} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

fn header(r: &Report) -> String {
    let seeds =
        if r.seeds.len() == 1 { format!("seed {}", r.seeds[0]) } else { format!("mean of {} seeds", r.seeds.len()) };
    let routers = match (r.routers, r.gossip) {
        (1, _) => String::new(),
        (n, true) => format!(", {n} router nodes (gossip delay {:.0} ms)", r.gossip_delay_s * 1e3),
        (n, false) => format!(", {n} router nodes (no gossip)"),
    };
    let routers = match &r.disaggregated {
        Some(pd) => format!("{routers}, disaggregated {pd} (prefill:decode)"),
        None => routers,
    };
    // Disaggregated, every request also waits for its KV transfer, which the floor leaves out.
    let floor = if r.disaggregated.is_some() { "aggregated floor" } else { "floor" };
    let gap = if r.disaggregated.is_some() { "waiting and the KV transfer" } else { "waiting" };
    format!(
        "{} — {} requests over {:.0} s on {} × {} replicas, rate scale {}, KV-event delay {:.0} ms{routers}, {seeds}\n\
         {floor} p99 TTFT (every request of the trace with no queueing, every reusable prefix cached): {} ({} if \
         nothing were cached); SLO {}\n\
         no-queue p99: p99 TTFT if each request had run its prefill alone, keeping the cache hits this policy got \
         (TTFT p99 above it: {gap}); both over completed requests\n",
        r.source,
        r.requests,
        r.span_s,
        r.replicas,
        r.profile,
        r.rate_scale,
        r.event_delay_s * 1e3,
        secs(r.floors.p99_all_cached),
        secs(r.floors.p99_uncached),
        secs(r.ttft_slo_s)
    )
}

/// A fixed-width table for a terminal.
pub fn table(r: &Report) -> String {
    let mut out = header(r);
    out.push('\n');
    out.push_str(&aligned(&COLUMNS, &rows(r)));
    out.push_str(&replication_notes(r));
    out.push_str(&decode_table(r, false));
    let wall: f64 = r.results.iter().flat_map(|p| p.per_seed.iter().map(|m| m.wall_s)).sum();
    let events: u64 = r.results.iter().flat_map(|p| p.per_seed.iter().map(|m| m.events)).sum();
    let _ = writeln!(
        out,
        "\nsimulated {} events in {wall:.1} s of simulation wall time summed over runs ({:.0} events/s)",
        events,
        events as f64 / wall.max(1e-9)
    );
    out
}

/// `columns` over `rows` ([`crate::table::plain`]): the first column left-aligned, the rest
/// (figures) right-aligned.
fn aligned<R: AsRef<[String]>>(columns: &[&str], rows: &[R]) -> String {
    let right: Vec<usize> = (1..columns.len()).collect();
    let mut t = crate::table::plain(columns, &right);
    for row in rows {
        t.add_row(row.as_ref().to_vec());
    }
    crate::table::lines(&t) + "\n"
}

/// `columns` over `rows` as Markdown table lines.
fn markdown_rows<R: AsRef<[String]>>(columns: &[&str], rows: &[R]) -> String {
    let mut out = format!("| {} |\n|{}\n", columns.join(" | "), "---|".repeat(columns.len()));
    for row in rows {
        let _ = writeln!(out, "| {} |", row.as_ref().join(" | "));
    }
    out
}

/// A Markdown table (for BENCHMARKS.md).
pub fn markdown(r: &Report) -> String {
    let mut out = header(r).lines().map(|l| format!("{l}  \n")).collect::<String>();
    out.push('\n');
    out.push_str(&markdown_rows(&COLUMNS, &rows(r)));
    out.push_str(&replication_notes(r));
    out.push_str(&decode_table(r, true));
    out
}

/// With a trace of groups (RL steps, agent sessions) or any preemption: E2E, step completion,
/// throughput and preemptions per policy, the figures decode-heavy traffic is judged by (the
/// step columns only when the traffic has steps).
fn decode_table(r: &Report, markdown: bool) -> String {
    let steps = r.results.iter().any(|p| p.mean.steps > 0);
    if !steps && !r.results.iter().any(|p| p.mean.preemptions > 0) {
        return String::new();
    }
    let mut columns = vec!["policy", "E2E p50", "E2E p99"];
    if steps {
        columns.extend(["steps", "step p50", "step p99"]);
    }
    columns.extend(["out tok/s", "preemptions"]);
    let rows: Vec<Vec<String>> = r
        .results
        .iter()
        .map(|p| {
            let m = &p.mean;
            let mut row = vec![p.policy.clone(), secs(m.e2e_p50), secs(m.e2e_p99)];
            if steps {
                row.extend([m.steps.to_string(), secs(m.step_p50), secs(m.step_p99)]);
            }
            row.extend([format!("{:.0}", m.output_tps), m.preemptions.to_string()]);
            row
        })
        .collect();
    let title = if steps { "decode and steps" } else { "decode" };
    let mut out = format!("\n{title} (output lengths known to the router: {})\n", r.output_info);
    // What no router reaches: the decode tables' targets are ratios to a peer, and a ratio
    // below floor ÷ peer is out of any router's reach. (Over every request of the trace: a
    // run that refused some is measured over fewer.)
    let f = &r.floors;
    let step_floor = if steps { format!(", step p99 {}", secs(f.step_p99_all_cached)) } else { String::new() };
    let _ = writeln!(
        out,
        "floor (every request of the trace alone, decoding in a batch of one, every reusable prefix cached): E2E p99 \
         {}{step_floor}; out tok/s at most {:.0} (all output over the trace's shortest span, at any fleet size)",
        secs(f.e2e_p99_all_cached),
        f.output_tps_ceiling
    );
    if markdown {
        out.push('\n');
        out.push_str(&markdown_rows(&columns, &rows));
    } else {
        out.push_str(&aligned(&columns, &rows));
    }
    out
}

/// One line per replicated policy: warm-ups and the KV memory spent on replicas; one per
/// autoscaled row: SLO attainment, GPU-seconds (against the oracle's) and replicas.
fn replication_notes(r: &Report) -> String {
    let mut out = String::new();
    let oracle = r.results.iter().find(|p| p.policy.ends_with("/oracle")).map(|p| p.mean.gpu_seconds);
    let scaled: Vec<_> = r.results.iter().filter(|p| p.policy.contains('/')).collect();
    if !scaled.is_empty() {
        let means = if r.seeds.len() > 1 {
            format!("; each figure the mean of {} seeds", r.seeds.len())
        } else {
            String::new()
        };
        let _ = writeln!(out, "\nautoscaling (SLO: TTFT ≤ {}{means})", secs(r.ttft_slo_s));
    }
    for p in scaled {
        let m = &p.mean;
        let vs =
            oracle.filter(|o| *o > 0.0).map_or(String::new(), |o| format!(" ({:.2}× the oracle's)", m.gpu_seconds / o));
        let _ = writeln!(
            out,
            "  {:<24} SLO attainment {:>6.2} %  GPU-seconds {:>9.0}{vs}  replicas running at most {} (draining ones included; most asked for {})  replicas started {}",
            p.policy,
            100.0 * m.slo_attainment,
            m.gpu_seconds,
            m.max_replicas,
            m.max_desired,
            m.replicas_started
        );
    }
    for p in r.results.iter().filter(|p| p.policy.ends_with("+replication")) {
        let m = &p.mean;
        let _ = writeln!(
            out,
            "\n{}: {} warm-ups prefilling {} tokens; KV on replicated prefixes {:.2} % of the fleet's on average, {:.2} % at peak",
            p.policy,
            m.warmups,
            m.warm_tokens,
            100.0 * m.replicated_kv_mean,
            100.0 * m.replicated_kv_peak
        );
    }
    out
}
